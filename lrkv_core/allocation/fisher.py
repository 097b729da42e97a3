"""``fisher`` (Palu, §3.3): rank proportional to the group's Fisher sum, one budget for K and V of all layers.

Palu caps each rank at the group width and loses the excess; here the excess is redistributed
(water-filling: ``r_g = clamp(λ F_g, min, max)`` with λ solved so the budget is spent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .base import ALLOCATORS, Allocation, Allocator
from .problem import RankProblem, bisect_to_budget, clamped_total, ranks_from_targets


@ALLOCATORS.register
@dataclass(frozen=True)
class Fisher(Allocator):
    """rank ∝ the group's Fisher sum (Palu), K and V of all layers sharing one budget"""

    name: ClassVar[str] = "fisher"
    needs: ClassVar[frozenset[str]] = frozenset({"fisher_sums"})

    def allocate(self, problem: RankProblem) -> Allocation:
        fisher = problem.values("fisher_sums")
        if any(not math.isfinite(f) or f < 0 for f in fisher):
            raise ValueError("Fisher sums must be finite and non-negative")
        if sum(fisher) <= 0:
            raise ValueError("every Fisher sum is zero: were the calibration gradients collected?")
        caps = [spec.max_rank for spec in problem.groups]
        lam_max = max(c / f for c, f in zip(caps, fisher) if f > 0)
        lam = bisect_to_budget(
            lambda x: clamped_total(problem, [x * f for f in fisher]), 0.0, lam_max, problem.budget
        )
        targets = [min(max(lam * f, problem.min_rank(i)), caps[i]) for i, f in enumerate(fisher)]
        return ranks_from_targets(problem, targets), {"lambda": lam}
