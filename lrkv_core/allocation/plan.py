"""Rank plans: how many latent dimensions each (layer, K/V, group) keeps, and the entry point that makes them.

Budget = kept fraction of the KV width, ``Σ r / (2·L·Hkv·D)``. Ranks are rounded to a multiple so the
latents map to efficient matmul shapes; the achieved ratio after rounding is reported next to the target:
never above it, and less than one rounding step (in total kept width) below it. The allocators live one per
file beside this module; the shared rounding rule in :mod:`lrkv_core.allocation.problem`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .base import ALLOCATORS, Allocator
from .features import LayerSummary
from .problem import KINDS, PerGroup, RankProblem, Ranks, Spectra, budget_width


@dataclass
class RankPlan:
    """Ranks per layer, per K/V, per group, with the budget they were chosen for."""

    allocator: dict[str, Any]  # the allocator's recipe form: {"name": ..., **options}
    group_size: int
    group_width: int  # s·D
    rank_multiple: int
    target_ratio: float
    ranks: Ranks  # {"k": [[r_g for g] for layer], "v": ...}
    details: dict[str, Any] = field(default_factory=dict)  # what the allocator solved for (ε, d_min, λ, ...)

    @property
    def full_width(self) -> int:
        n = sum(len(groups) for groups in self.ranks["k"])
        return 2 * n * self.group_width

    @property
    def kept(self) -> int:
        return sum(r for kind in KINDS for layer in self.ranks[kind] for r in layer)

    @property
    def budget_width(self) -> int:
        """⌊target ratio · full width⌋: the kept width the plan may use."""
        return budget_width(self.target_ratio, self.full_width)

    @property
    def achieved_ratio(self) -> float:
        return self.kept / self.full_width

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "achieved_ratio": self.achieved_ratio,
            "full_width": self.full_width,
            "budget_width": self.budget_width,
            "kept": self.kept,
        }

    @classmethod
    def from_dict(cls, d: dict) -> RankPlan:
        fields = ("group_size", "group_width", "rank_multiple", "target_ratio", "ranks")
        allocator = d["allocator"] if isinstance(d["allocator"], dict) else {"name": d["allocator"]}
        return cls(allocator, **{k: d[k] for k in fields}, details=d.get("details", {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> RankPlan:
        return cls.from_dict(json.loads(Path(path).read_text()))


def allocate_ranks(
    spectra: Spectra,
    *,
    ratio: float,
    group_size: int,
    head_dim: int,
    rank_multiple: int = 8,
    allocator: str | Mapping[str, Any] | Allocator = "uniform",
    features: Mapping[str, PerGroup] | None = None,
) -> RankPlan:
    """Choose ranks for every group so that the kept KV width is at most ``ratio`` of the original.

    Parameters
    ----------
    spectra : ``spectra[layer][kind][g]``: (max_rank,) importance of each group's latents, most important
        first (:meth:`lrkv_core.decompositions.LayerFactors.spectra`).
    ratio : target kept fraction of the KV width, in (0, 1].
    group_size, head_dim : s and D; a group is s·D wide in the uncompressed cache.
    rank_multiple : ranks are multiples of this (or a group's max rank ``min(s·D, d)``).
    allocator : a registered allocator: its name, its recipe form ``{"name": ..., **options}`` or an instance.
    features : ``features[name][layer][kind][g]``, the per-group features the allocator needs
        (:mod:`lrkv_core.allocation.features`).
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if rank_multiple < 1:
        raise ValueError(f"rank multiple must be ≥ 1, got {rank_multiple}")
    method = ALLOCATORS.create(allocator)
    width = group_size * head_dim
    problem = RankProblem(spectra, width, ratio, rank_multiple, dict(features or {}))
    flat, details = method.run(problem)
    plan = RankPlan(method.to_dict(), group_size, width, rank_multiple, ratio, problem.nest(flat), details)
    if plan.achieved_ratio > ratio + 1e-9:
        raise AssertionError(f"allocator {method.name} exceeded the budget: {plan.achieved_ratio} > {ratio}")
    return plan


def plan_from_summaries(
    summaries: Sequence[LayerSummary],
    *,
    ratio: float,
    group_size: int,
    head_dim: int,
    rank_multiple: int = 8,
    allocator: str | Mapping[str, Any] | Allocator = "uniform",
) -> RankPlan:
    """:func:`allocate_ranks` from per-layer summaries (spectra + features), in layer order."""
    if not summaries:
        raise ValueError("no layer summaries to plan from")
    if [s.layer for s in summaries] != list(range(len(summaries))):
        raise ValueError(f"summaries must be layers 0..{len(summaries) - 1} in order")
    names = set(summaries[0].features)
    if any(set(s.features) != names for s in summaries):
        raise ValueError("every layer summary must carry the same features")
    features = {name: [s.features[name] for s in summaries] for name in names}
    return allocate_ranks(
        [s.spectra for s in summaries],
        ratio=ratio,
        group_size=group_size,
        head_dim=head_dim,
        rank_multiple=rank_multiple,
        allocator=allocator,
        features=features,
    )
