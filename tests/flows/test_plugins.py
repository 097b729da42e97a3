"""A toy allocator and a toy cache storage, registered from this module alone, run through the convert flow.

Nothing else in lrkv names them: the recipe validates them from the registries, the flow plans with the
allocator, the model-format section records both, and evaluating the saved model (loaded back from disk in
the evaluate task) uses the toy storage, whose bytes the measured KV bytes per token show.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from lrkv_core import load_compressed
from lrkv_core.allocation import ALLOCATORS, Allocation, Allocator, RankProblem, fit_to_budget
from lrkv_core.cache import CACHE_STORAGES, CacheStorage, LatentStore, split_groups
from lrkv_flows.convert import convert_flow
from lrkv_tasks.recipes.convert_recipe import load_recipe
from tests.support.models import tiny_model_dir, token_parquet


@dataclass(frozen=True)
class DeepFirst(Allocator):
    """toy: one step per group, then every spare step to the deepest layers first"""

    name: ClassVar[str] = "test-deep-first"

    def allocate(self, problem: RankProblem) -> Allocation:
        start = [problem.min_rank(i) for i in range(len(problem.groups))]
        return fit_to_budget(problem, start, lambda i, r: problem.groups[i].layer), {"toy": True}


class HalfStore(LatentStore):
    """Latents kept in float16, decoded to the model's dtype."""

    def encode(self, h_k: torch.Tensor, h_v: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"k": h_k.half(), "v": h_v.half()}

    def decode(self, parts: Mapping[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], ...]:
        return split_groups(parts["k"].to(self.dtype), self.ranks_k), split_groups(
            parts["v"].to(self.dtype), self.ranks_v
        )


@dataclass(frozen=True)
class Half(CacheStorage):
    """toy: latents in float16"""

    name: ClassVar[str] = "test-half"

    def create_store(self, ranks_k: tuple[int, ...], ranks_v: tuple[int, ...]) -> HalfStore:
        return HalfStore(ranks_k, ranks_v)


@pytest.fixture
def toys() -> Iterator[None]:
    ALLOCATORS.register(DeepFirst)
    CACHE_STORAGES.register(Half)
    yield
    ALLOCATORS.unregister(DeepFirst.name)
    CACHE_STORAGES.unregister(Half.name)


def test_a_toy_allocator_and_storage_run_through_the_convert_flow(prefect_api, toys, tmp_path):
    model_dir = tiny_model_dir(tmp_path)  # 2 layers, Hkv = 2, D = 8: one group of width 16 per K/V
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    recipe = load_recipe(
        None,
        {
            "model": str(model_dir),
            "calibration": {"dataset": data, "n_samples": 8, "seq_len": 32},
            "compression": {
                "ratio": 0.75,  # budget 48 of 64: one step of 8 per group (32), 16 to spare
                "group_size": 2,
                "rank_multiple": 8,
                "allocator": {"name": "test-deep-first"},
                "cache": "test-half",
            },
            "eval": {
                "dataset": data,
                "seq_len": 32,
                "max_windows": 4,
                "decode_prefix": 16,
                "decode_windows": 1,
            },
            "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
            "store": str(tmp_path / "store"),
            "out": str(tmp_path / "out"),
        },
    )
    result = convert_flow(recipe)
    plan = result.plan.meta
    assert plan["achieved_ratio"] == 0.75
    fmt = load_compressed(tmp_path / "out").config.lrkv
    assert fmt["ranks_k"] == [[8], [16]] and fmt["ranks_v"] == [[8], [16]]  # the spare went to layer 1
    assert fmt["allocator"] == {"name": "test-deep-first"} and fmt["cache"] == {"name": "test-half"}
    kv = result.eval.compressed.kv
    # float16 latents: (8 + 8 + 16 + 16) · 2 bytes, plus an int32 position per layer, per token
    assert kv["cache_class"] == "LatentCache" and kv["kv_bytes_per_token"] == 48 * 2 + 2 * 4
    assert result.eval.base.kv["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4  # 2 layers × K,V × Hkv·D fp32
