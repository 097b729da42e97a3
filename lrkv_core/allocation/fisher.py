"""``fisher`` (Palu, §3.3): ranks proportional to each group's Fisher score, one budget for K and V of all
layers.

Palu's rule, on a group score ``f_g`` (``score="rms"``, Palu's: the mean over the group's weight elements of
the root-mean-square gradient ``√F``; ``score="sum"``: the Fisher summed over the group, ``Σ F``):

1. the target kept width is the budget ``T`` (⌊ratio · full width⌋); each group starts at
   ``r_g = min(width_g, ⌊T · f_g / Σ f⌋)``;
2. what the floors and the caps leave over is handed out one rank at a time, group by group, in ascending
   order of the group's deficit ``T f_g / Σ f − r_g`` (capped groups are skipped), pass after pass, until the
   budget is spent (``leftover="round-robin"``).

Palu then rounds every rank to the nearest multiple of 32, which can exceed the budget; here the ranks go
through lrkv's one rounding rule instead (multiples of the rank multiple, never above the budget). lrkv's
earlier rule is kept as ``leftover="water-fill"``: ``r_g = clamp(λ f_g, min, max)`` with λ solved so the
budget is spent, which hands a capped group's excess to the other groups in proportion to their scores
(measured: it starves K, see docs/allocation.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from .base import ALLOCATORS, Allocation, Allocator
from .problem import RankProblem, bisect_to_budget, clamped_total, ranks_from_targets

FEATURE = {"rms": "fisher_rms", "sum": "fisher_sums"}


def palu_ranks(scores: list[float], caps: list[int], budget: int) -> list[int]:
    """Palu's rank rule at granularity 1 (steps 1–2 above): integer ranks summing to ``budget``."""
    total = sum(scores)
    shares = [budget * f / total for f in scores]
    ranks = [min(cap, math.floor(s)) for s, cap in zip(shares, caps)]
    order = sorted(range(len(ranks)), key=lambda i: shares[i] - ranks[i])  # stable: ties keep group order
    left = budget - sum(ranks)
    while left > 0 and any(r < cap for r, cap in zip(ranks, caps)):
        for i in order:
            if left == 0:
                break
            if ranks[i] < caps[i]:
                ranks[i] += 1
                left -= 1
    return ranks


@ALLOCATORS.register
@dataclass(frozen=True)
class Fisher(Allocator):
    """rank ∝ the group's Fisher score (Palu's rule), K and V of all layers sharing one budget"""

    name: ClassVar[str] = "fisher"
    score: Literal["rms", "sum"] = "rms"  # Palu: mean of √F over the group; "sum": Σ F
    leftover: Literal["round-robin", "water-fill"] = "round-robin"  # Palu's, or lrkv 0.1's proportional rule

    def __post_init__(self) -> None:
        if self.score not in FEATURE or self.leftover not in ("round-robin", "water-fill"):
            raise ValueError(f"fisher: unknown score {self.score!r} or leftover rule {self.leftover!r}")

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset({FEATURE[self.score]})

    def allocate(self, problem: RankProblem) -> Allocation:
        scores = problem.values(FEATURE[self.score])
        if any(not math.isfinite(f) or f < 0 for f in scores):
            raise ValueError("Fisher scores must be finite and non-negative")
        if sum(scores) <= 0:
            raise ValueError("every Fisher score is zero: were the calibration gradients collected?")
        caps = [spec.max_rank for spec in problem.groups]
        if self.leftover == "round-robin":
            targets = palu_ranks(scores, caps, problem.budget)
            return ranks_from_targets(problem, targets), {"palu_ranks": targets}
        lam_max = max(c / f for c, f in zip(caps, scores) if f > 0)
        lam = bisect_to_budget(
            lambda x: clamped_total(problem, [x * f for f in scores]), 0.0, lam_max, problem.budget
        )
        targets = [min(max(lam * f, problem.min_rank(i)), caps[i]) for i, f in enumerate(scores)]
        return ranks_from_targets(problem, targets), {"lambda": lam}
