"""``eigen`` (Eigen Attention, Saxena et al. 2024, §3.2): one relative error budget ε for every group.

A group keeps the smallest rank whose relative truncation error ``Σ_{j≥r} σ_j² / Σ_j σ_j²`` is ≤ ε, and ε is
searched (bisection over the achievable errors) for the smallest value that fits the budget.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import ALLOCATORS, Allocation, Allocator
from .problem import RankProblem, fit_to_budget


def relative_errors(sigma: torch.Tensor) -> torch.Tensor:
    """(max_rank + 1,) relative truncation error ``Σ_{j≥r} σ_j² / Σ_j σ_j²`` of keeping the first r."""
    s2 = sigma.to(torch.float64) ** 2
    tail = torch.cat([s2.flip(0).cumsum(0).flip(0), s2.new_zeros(1)])  # tail[r] = Σ_{j≥r} σ_j²
    return tail / tail[0] if tail[0] > 0 else torch.zeros_like(tail)


@ALLOCATORS.register
@dataclass(frozen=True)
class Eigen(Allocator):
    """one relative spectral error budget for every group (Eigen Attention), searched to meet the ratio"""

    name: ClassVar[str] = "eigen"

    def allocate(self, problem: RankProblem) -> Allocation:
        errors = [relative_errors(spec.sigma).tolist() for spec in problem.groups]
        grids = [problem.grid(i) for i in range(len(problem.groups))]
        # the error is non-increasing along the grid (and 0 at max rank): negated, it is sorted for bisect
        neg_errors = [[-err[r] for r in grid] for grid, err in zip(grids, errors)]

        def ranks_at(eps: float) -> list[int]:
            """Per group, the smallest allowed rank whose relative error is ≤ eps."""
            return [grid[bisect.bisect_left(neg, -eps)] for grid, neg in zip(grids, neg_errors)]

        candidates = sorted({-e for neg in neg_errors for e in neg})
        lo, hi = 0, len(candidates) - 1  # ranks_at(candidates[-1]) keeps one step per group: feasible
        while lo < hi:  # bisection over the achievable errors: the smallest that fits the budget
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if sum(ranks_at(candidates[mid])) <= problem.budget else (mid + 1, hi)
        eps = candidates[lo]
        ranks = fit_to_budget(problem, ranks_at(eps), lambda i, r: errors[i][r])
        return ranks, {"epsilon": eps, "max_relative_error": max(err[r] for err, r in zip(errors, ranks))}
