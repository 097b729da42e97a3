"""Shared fixtures: one intra-op thread for tiny models, the tiny-model factory, and ``compress``."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import PreTrainedModel

from lrkv_core.adapters import get_adapter
from lrkv_core.decompose import decompose_layer
from lrkv_core.fuse import compress_model
from lrkv_core.ranks import RankPlan, allocate_ranks
from lrkv_core.stats import collect_gram
from tests.support.models import tiny_model


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second thread on a 2-core CI box, and lose to contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_tiny() -> Callable[..., PreTrainedModel]:
    """``make_tiny(arch, n_kv_heads, seed=0, **overrides)``: :func:`tests.support.models.tiny_model`."""
    return tiny_model


@pytest.fixture
def compress() -> Callable[..., tuple[PreTrainedModel, RankPlan]]:
    """``compress(model, group_size, ratio=1.0, rows=None, grams=None, rank_multiple=1, method="whitened")``.

    Calibrates on ``rows`` (default: 8 random rows of 24 tokens) unless ``grams`` are given, decomposes every
    layer, allocates uniform ranks and compresses a deep copy: the model passed in is never modified.
    Returns ``(compressed, plan)``.
    """

    def run(
        model: PreTrainedModel,
        group_size: int,
        ratio: float = 1.0,
        rows: torch.Tensor | None = None,
        grams: list[torch.Tensor] | None = None,
        rank_multiple: int = 1,
        method: str = "whitened",
    ) -> tuple[PreTrainedModel, RankPlan]:
        adapter, shape = get_adapter(model.config), get_adapter(model.config).shape(model.config)
        if grams is None:
            if rows is None:
                gen = torch.Generator().manual_seed(123)
                rows = torch.randint(3, model.config.vocab_size, (8, 24), generator=gen)
            grams, _ = collect_gram(model, rows)
        factors = []
        for i in range(shape.L):
            attn = adapter.attention(model, i)
            w_k, w_v = getattr(attn, adapter.k_name).weight, getattr(attn, adapter.v_name).weight
            kw = dict(n_kv_heads=shape.Hkv, head_dim=shape.D, group_size=group_size, method=method)
            factors.append(decompose_layer(i, w_k, w_v, grams[i], **kw))
        spectra = [f.spectra() for f in factors]
        plan = allocate_ranks(
            spectra, ratio=ratio, group_size=group_size, head_dim=shape.D, rank_multiple=rank_multiple
        )
        return compress_model(copy.deepcopy(model), factors, plan, method), plan

    return run


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` process on loopback (SQLite backend, proxied artifacts) for the session."""
    from tests.support.servers import start_mlflow_server

    proc, uri = start_mlflow_server(tmp_path_factory.mktemp("mlflow"))
    yield uri
    proc.terminate()
    proc.wait(timeout=30)
