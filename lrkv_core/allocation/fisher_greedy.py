"""``fisher-greedy`` (lrkv): greedy on the Fisher-weighted truncation error ``Σ F ⊙ (W − W_r)²``.

From one step per group, repeatedly give a step to the group with the largest drop of its error curve per
unit of width (:func:`lrkv_core.allocation.features.weighted_error_curve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import ALLOCATORS, Allocation, Allocator
from .problem import RankProblem, fit_to_budget


@ALLOCATORS.register
@dataclass(frozen=True)
class FisherGreedy(Allocator):
    """greedy on the Fisher-weighted truncation error Σ F ⊙ (W − W_r)² per unit of width"""

    name: ClassVar[str] = "fisher-greedy"
    needs: ClassVar[frozenset[str]] = frozenset({"error_curves"})

    def allocate(self, problem: RankProblem) -> Allocation:
        curves = problem.values("error_curves")
        for i, curve in enumerate(curves):
            if curve.numel() != problem.max_rank(i) + 1:
                raise ValueError(
                    f"error curve of {problem.name(problem.groups[i])} must have max_rank + 1 entries"
                )
            if not torch.isfinite(curve[torch.tensor(problem.grid(i))]).all():
                raise ValueError(
                    f"the error curve of {problem.name(problem.groups[i])} lacks ranks on the grid of rank "
                    f"multiple {problem.rank_multiple}: compute it with a rank multiple that divides it"
                )
        values = [c.tolist() for c in curves]

        def gain(i: int, r: int) -> float:
            nxt = problem.next_rank(i, r)
            return (values[i][r] - values[i][nxt]) / (nxt - r)

        base = [problem.min_rank(i) for i in range(len(problem.groups))]
        ranks = fit_to_budget(problem, base, gain)
        return ranks, {"weighted_error": sum(v[r] for v, r in zip(values, ranks))}
