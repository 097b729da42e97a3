"""Rank plans: how many latent dimensions each (layer, K/V, group) keeps.

Budget = kept fraction of the KV width, ``Σ r / (2·L·Hkv·D)``. Ranks are rounded to a multiple so the
latents map to efficient matmul shapes; the achieved ratio after rounding is reported next to the target
and never exceeds it. Allocators share one signature (spectra, budget → ranks) and live in
:data:`ALLOCATORS`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# spectra[layer][kind][group] -> descending singular values (only the length is used by "uniform")
Spectra = list[dict[str, list[torch.Tensor]]]


@dataclass
class RankPlan:
    """Ranks per layer, per K/V, per group, with the budget they were chosen for."""

    allocator: str
    group_size: int
    group_width: int  # s·D
    rank_multiple: int
    target_ratio: float
    ranks: dict[str, list[list[int]]]  # {"k": [[r_g for g] for layer], "v": ...}

    @property
    def full_width(self) -> int:
        n = sum(len(groups) for groups in self.ranks["k"])
        return 2 * n * self.group_width

    @property
    def kept(self) -> int:
        return sum(r for kind in ("k", "v") for layer in self.ranks[kind] for r in layer)

    @property
    def achieved_ratio(self) -> float:
        return self.kept / self.full_width

    def to_dict(self) -> dict:
        return {**asdict(self), "achieved_ratio": self.achieved_ratio, "full_width": self.full_width}

    @classmethod
    def from_dict(cls, d: dict) -> RankPlan:
        fields = ("allocator", "group_size", "group_width", "rank_multiple", "target_ratio", "ranks")
        return cls(**{k: d[k] for k in fields})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> RankPlan:
        return cls.from_dict(json.loads(Path(path).read_text()))


def round_rank(r: float, multiple: int, max_rank: int) -> int:
    """Largest multiple of ``multiple`` that is ≤ r, capped at the group's max rank."""
    return min(int(math.floor(r / multiple + 1e-9)) * multiple, max_rank)


def allocate_uniform(
    spectra: Spectra, ratio: float, multiple: int, group_width: int
) -> dict[str, list[list[int]]]:
    """Every group keeps ``ratio × group width`` dimensions, rounded down to the multiple."""
    ranks: dict[str, list[list[int]]] = {"k": [], "v": []}
    for layer in spectra:
        for kind in ("k", "v"):
            ranks[kind].append([round_rank(ratio * group_width, multiple, len(s)) for s in layer[kind]])
    return ranks


ALLOCATORS: dict[str, Callable[..., dict[str, list[list[int]]]]] = {"uniform": allocate_uniform}


def allocate_ranks(
    spectra: Spectra,
    *,
    ratio: float,
    group_size: int,
    head_dim: int,
    rank_multiple: int = 8,
    allocator: str = "uniform",
) -> RankPlan:
    """Choose ranks for every group so that the kept KV width is at most ``ratio`` of the original."""
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if rank_multiple < 1:
        raise ValueError(f"rank multiple must be ≥ 1, got {rank_multiple}")
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator!r}; choose from {sorted(ALLOCATORS)}")
    width = group_size * head_dim
    ranks = ALLOCATORS[allocator](spectra, ratio, rank_multiple, width)
    zero = [(kind, i) for kind in ("k", "v") for i, layer in enumerate(ranks[kind]) if min(layer) < 1]
    if zero:
        raise ValueError(
            f"ratio {ratio} with rank multiple {rank_multiple} leaves rank 0 for {zero[:4]} "
            f"(group width {width}); "
            "use a smaller --rank-multiple, a larger --group-size or a larger ratio"
        )
    plan = RankPlan(allocator, group_size, width, rank_multiple, ratio, ranks)
    if plan.achieved_ratio > ratio + 1e-9:
        raise AssertionError(f"allocator {allocator} exceeded the budget: {plan.achieved_ratio} > {ratio}")
    return plan
