"""Shared fixtures: one intra-op thread for tiny models, the tiny-model factory, and ``compress``.

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. Triton reads ``TRITON_INTERPRET``
when it is first imported (transformers' model modules import it), so it is set before any other import.

Under pytest-xdist (``scripts/test.sh`` runs two workers) each worker and every process its tests start
use one intra-op thread: two processes of two threads each on two cores slow each other far more than
they gain. Tests that do not choose an ``LRKV_HOME`` of their own share one per session, in a temporary
directory, so a run never writes into the user's ``~/.cache/lrkv`` and two workers never share one.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[_name] = "1"
if "LRKV_HOME" not in os.environ:
    os.environ["LRKV_HOME"] = os.environ["LRKV_TEST_HOME"] = tempfile.mkdtemp(prefix="lrkv-test-home-")
    atexit.register(shutil.rmtree, os.environ["LRKV_HOME"], ignore_errors=True)
if _WORKER and os.environ["LRKV_HOME"] == os.environ.get("LRKV_TEST_HOME"):  # the controller's: a worker each
    os.environ["LRKV_HOME"] = os.path.join(os.environ["LRKV_HOME"], _WORKER)

import torch

if _WORKER:
    torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import copy
from collections.abc import Callable, Iterator

import pytest
from transformers import PreTrainedModel

from lrkv_core.allocation import RankPlan
from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from tests.support.models import tiny_model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """tests/flows first: its files run real processes and servers for minutes each, so two workers that
    start with them end together, with the many short files filling in, instead of one worker running the
    last long file alone."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/flows/"))


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
    """``compress(model, group_size, ratio=1.0, rows=None, stats=None, rank_multiple=1, method="whitened")``.

    Calibrates on ``rows`` (default: 8 random rows of 24 tokens) unless ``stats`` (name → per-layer
    statistics, e.g. ``{"gram": [...], "attention_gram": [...]}``) are given, decomposes every
    layer, allocates uniform ranks and compresses a deep copy: the model passed in is never modified.
    Returns ``(compressed, plan)``.
    """

    def run(
        model: PreTrainedModel,
        group_size: int,
        ratio: float = 1.0,
        rows: torch.Tensor | None = None,
        stats: dict[str, list[torch.Tensor]] | None = None,
        rank_multiple: int = 1,
        method: str = "whitened",
    ) -> tuple[PreTrainedModel, RankPlan]:
        if stats is None and rows is None:
            gen = torch.Generator().manual_seed(123)
            rows = torch.randint(3, model.config.vocab_size, (8, 24), generator=gen)
        config = CompressionConfig(
            ratio=ratio,
            group_size=group_size,
            rank_multiple=rank_multiple,
            decomposition=method,
            allocator="uniform",
        )
        conversion = plan_conversion(model, rows, config, statistics=stats)
        return conversion.apply(copy.deepcopy(model)), conversion.plan

    return run


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` process on loopback (SQLite backend, proxied artifacts) for the session."""
    from tests.support.servers import start_mlflow_server

    proc, uri = start_mlflow_server(tmp_path_factory.mktemp("mlflow"))
    yield uri
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on loopback for the session, with the bucket ``lrkv``; yields its endpoint."""
    from tests.support.servers import start_s3_server

    server, endpoint = start_s3_server("lrkv")
    yield endpoint
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """The loopback S3 server's settings in this test's environment; LRKV_HOME (the download cache) in
    tmp_path. Yields the endpoint."""
    from tests.support.servers import s3_env

    for name, value in s3_env(s3_server).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LRKV_HOME", str(tmp_path / "home"))
    yield s3_server


@pytest.fixture(scope="session")
def mlflow_s3_server(tmp_path_factory, s3_server):
    """A real ``mlflow server`` whose artifact root is ``s3://lrkv/mlflow`` on the loopback S3 server."""
    from tests.support.servers import s3_env, start_mlflow_server

    proc, uri = start_mlflow_server(
        tmp_path_factory.mktemp("mlflow-s3"), artifacts="s3://lrkv/mlflow", env=s3_env(s3_server)
    )
    yield uri
    proc.terminate()
    proc.wait(timeout=30)
