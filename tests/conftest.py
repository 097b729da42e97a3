"""Shared fixtures: one intra-op thread for tiny models, and a factory of tiny random Llama/Mistral models."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedModel

from lrkv_core.adapters import get_adapter
from lrkv_core.decompose import decompose_layer
from lrkv_core.fuse import compress_model
from lrkv_core.ranks import RankPlan, allocate_ranks
from lrkv_core.stats import collect_gram


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second thread on a 2-core CI box, and lose to contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TINY = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=8,
    max_position_embeddings=128,
    initializer_range=0.2,  # large enough that predictions depend on the context, not on ties
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture
def make_tiny() -> Callable[..., PreTrainedModel]:
    """``make_tiny(family, n_kv_heads, seed=0, **overrides)``: a fresh 2-layer model in eval mode."""

    def build(family: str = "llama", n_kv_heads: int = 2, seed: int = 0, **overrides) -> PreTrainedModel:
        families = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}
        cfg_cls, model_cls = families[family]
        torch.manual_seed(seed)
        config = cfg_cls(**(TINY | {"num_key_value_heads": n_kv_heads} | overrides))
        return model_cls(config).eval()

    return build


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
