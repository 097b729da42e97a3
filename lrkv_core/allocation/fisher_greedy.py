"""Greedy allocators on per-group error curves (lrkv).

From one step per group, repeatedly give a step to the group with the largest drop of its error curve per
unit of width. ``fisher-greedy`` reads the Fisher-weighted truncation error ``Σ F ⊙ (W − W_r)²``
(:func:`lrkv_core.allocation.features.weighted_error_curve`); ``kl-greedy`` the model's measured
second-order KL of cutting each group alone (:mod:`lrkv_core.statistics.response`).
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
    curve: ClassVar[str] = "error_curves"  # the feature holding each group's (max_rank + 1,) curve
    total: ClassVar[str] = "weighted_error"  # what the plan's details call the curves' sum

    def allocate(self, problem: RankProblem) -> Allocation:
        curves = problem.values(self.curve)
        for i, curve in enumerate(curves):
            if curve.numel() != problem.max_rank(i) + 1:
                raise ValueError(
                    f"{self.curve} of {problem.name(problem.groups[i])} must have max_rank + 1 entries"
                )
            if not torch.isfinite(curve[torch.tensor(problem.grid(i))]).all():
                raise ValueError(
                    f"the {self.curve} of {problem.name(problem.groups[i])} lacks ranks on the grid of rank "
                    f"multiple {problem.rank_multiple}: compute it with a rank multiple that divides it"
                )
        values = [c.tolist() for c in curves]

        def gain(i: int, r: int) -> float:
            nxt = problem.next_rank(i, r)
            return (values[i][r] - values[i][nxt]) / (nxt - r)

        base = [problem.min_rank(i) for i in range(len(problem.groups))]
        ranks = fit_to_budget(problem, base, gain)
        return ranks, {self.total: sum(v[r] for v, r in zip(values, ranks))}


@ALLOCATORS.register
@dataclass(frozen=True)
class KLGreedy(FisherGreedy):
    """greedy on the measured second-order KL of cutting each group alone, per unit of width"""

    name: ClassVar[str] = "kl-greedy"
    needs: ClassVar[frozenset[str]] = frozenset({"kl_curves"})
    curve: ClassVar[str] = "kl_curves"
    total: ClassVar[str] = "kl_estimate"
