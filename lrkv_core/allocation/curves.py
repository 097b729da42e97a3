"""Allocators on per-group cost curves: ``fisher-greedy`` and ``kl`` (lrkv).

Each reads one curve per group, the cost of keeping the first r latents at every rank r, and minimises the
summed cost within the budget. ``fisher-greedy`` prices a group by its Fisher-weighted truncation error
``Σ F ⊙ (W − W_r)²`` (:func:`lrkv_core.allocation.features.weighted_error_curve`); ``kl`` by the model's
measured second-order KL of cutting that group alone (:mod:`lrkv_core.statistics.response`). Checked
against the KL really measured on calibration rows (``benchmarks/kl_response.py``, docs/allocation.md): it
orders single-group cuts and whole plans as the measured KL does, and better than the Fisher-weighted error.

Two solvers: ``greedy`` gives, from one step per group, a step at a time to the group whose curve drops
most per unit of width; ``exact`` solves the knapsack over the grid (:mod:`lrkv_core.allocation.knapsack`),
which matters as soon as a curve is not convex.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from .base import ALLOCATORS, Allocation, Allocator
from .knapsack import minimize_separable
from .problem import RankProblem, fit_to_budget

SOLVERS = ("exact", "greedy")


@dataclass(frozen=True)
class CurveAllocator(Allocator):
    """Minimise the summed per-group cost curves (the feature ``curve``) within the budget."""

    curve: ClassVar[str]  # the feature holding each group's (max_rank + 1,) curve
    total: ClassVar[str]  # what the plan's details call the chosen curves' sum
    solver: Literal["exact", "greedy"] = "exact"

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise ValueError(f"{self.name}: solver must be one of {SOLVERS}, got {self.solver!r}")

    def curves(self, problem: RankProblem) -> list[torch.Tensor]:
        """Each group's curve, checked: max_rank + 1 entries, finite on the grid."""
        curves = problem.values(self.curve)
        for i, curve in enumerate(curves):
            if not isinstance(curve, torch.Tensor) or curve.numel() != problem.max_rank(i) + 1:
                raise ValueError(
                    f"{self.curve} of {problem.name(problem.groups[i])} must have max_rank + 1 entries"
                )
            if not torch.isfinite(curve[torch.tensor(problem.grid(i))]).all():
                raise ValueError(
                    f"the {self.curve} of {problem.name(problem.groups[i])} lacks ranks on the grid of rank "
                    f"multiple {problem.rank_multiple}: compute it with a rank multiple that divides it"
                )
        return curves

    def allocate(self, problem: RankProblem) -> Allocation:
        curves = self.curves(problem)
        values = [c.tolist() for c in curves]

        def gain(i: int, r: int) -> float:
            nxt = problem.next_rank(i, r)
            return (values[i][r] - values[i][nxt]) / (nxt - r)

        if self.solver == "exact":
            start, _ = minimize_separable(problem, curves)
        else:
            start = [problem.min_rank(i) for i in range(len(problem.groups))]
        ranks = fit_to_budget(problem, start, gain)  # greedy: the whole rule; exact: spend what is left
        return ranks, {self.total: sum(v[r] for v, r in zip(values, ranks))}


@ALLOCATORS.register
@dataclass(frozen=True)
class FisherGreedy(CurveAllocator):
    """the Fisher-weighted truncation error Σ F ⊙ (W − W_r)², greedy per unit of width by default"""

    name: ClassVar[str] = "fisher-greedy"
    needs: ClassVar[frozenset[str]] = frozenset({"error_curves"})
    curve: ClassVar[str] = "error_curves"
    total: ClassVar[str] = "weighted_error"
    solver: Literal["exact", "greedy"] = "greedy"


@ALLOCATORS.register
@dataclass(frozen=True)
class KL(CurveAllocator):
    """the least summed KL of cutting each group alone, measured by one gradient pass (exact knapsack)"""

    name: ClassVar[str] = "kl"
    needs: ClassVar[frozenset[str]] = frozenset({"kl_curves"})
    curve: ClassVar[str] = "kl_curves"
    total: ClassVar[str] = "kl_estimate"
    # measured on SmolLM2-135M's held-out test text (the KL on 32 rows): 3 steps lowered the perplexity rise
    # from +1.01 to +0.60 at ratio 0.7, +3.87 to +2.06 at 0.5 and +20.23 to +14.77 at 0.3, for about 400 s;
    # on shakespeare-llama they change only the plan at 0.5 (docs/allocation.md)
    refine_steps: ClassVar[int] = 3
