"""``eigen`` (Eigen Attention, Saxena et al. 2024): spectral thresholds, per layer by the decoder layer's
output error (the paper's Algorithm 1) or one for every group.

Both keep, per group, the smallest rank whose prefix holds at least the share ε of the group's energy (the
paper's Eq. 5 on the decomposition's spectrum ``σ``; equivalently a relative truncation error
``Σ_{j≥r} σ_j² / Σ_j σ_j² ≤ 1 − ε``).

- ``rule: layerwise`` (the paper's Algorithm 1): each layer lowers its own ε from 1 in steps of ε_s while the
  decoder layer's relative output error on the calibration activations stays within the budget ``e_b``
  (measured by the ``layer_output_error`` statistic at every step), and stops at the last ε within it; ``e_b``
  is searched (bisection over the measured errors) for the smallest value whose plan fits the ratio.
- ``rule: global`` (lrkv's variant, the default): one ε for every group of every layer, searched for the
  smallest relative truncation error that fits the ratio; no statistic beyond the spectra.

Ranks are rounded up to the rank multiple's grid; what the ratio leaves after the search is spent a step at a
time on the groups with the largest relative truncation error.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from ..statistics.layer_error import energy_rank
from .base import ALLOCATORS, Allocation, Allocator
from .features import Feature, PerKind, register_feature
from .problem import RankProblem, fit_to_budget

RULES = ("layerwise", "global")


def relative_errors(sigma: torch.Tensor) -> torch.Tensor:
    """(max_rank + 1,) relative truncation error ``Σ_{j≥r} σ_j² / Σ_j σ_j²`` of keeping the first r."""
    s2 = sigma.to(torch.float64) ** 2
    tail = torch.cat([s2.flip(0).cumsum(0).flip(0), s2.new_zeros(1)])  # tail[r] = Σ_{j≥r} σ_j²
    return tail / tail[0] if tail[0] > 0 else torch.zeros_like(tail)


def _layer_errors(factors, stats) -> PerKind:
    """Every group of a layer carries the layer's curve: (2, n) float64, thresholds ε then errors e(ε)
    (allocators read it flattened)."""
    value = stats["layer_output_error"]
    curve = torch.stack([value["epsilon"].to(torch.float64), value["error"].to(torch.float64)])
    return {kind: [curve] * len(factors.groups[kind]) for kind in ("k", "v")}


register_feature(Feature("layer_errors", frozenset({"layer_output_error"}), _layer_errors))


def lowest_threshold(curve: torch.Tensor, budget: float) -> float:
    """Algorithm 1 for one layer: from ε = 1, step down the thresholds of ``curve`` ((2, n): ε descending,
    then the layer's output error at each) while the error stays within ``budget``; the last ε within it."""
    chosen = float(curve[0, 0])
    for eps, err in zip(curve[0].tolist(), curve[1].tolist(), strict=True):
        if err > budget:
            break
        chosen = eps
    return chosen


@ALLOCATORS.register
@dataclass(frozen=True)
class Eigen(Allocator):
    """spectral thresholds: one for every group, or per layer by its output error within one budget (rule
    layerwise: Eigen Attention's Algorithm 1)"""

    name: ClassVar[str] = "eigen"
    # global: measured better than Algorithm 1 on shakespeare-llama's development split at ratios 0.7 and 0.5
    # (held-out KL 0.0006 vs 0.0086, 0.0062 vs 0.0150), level at 0.3, and far better on SmolLM2's, where one
    # budget cuts the layers that carry a massive activation deep (docs/allocation.md: Eigen's own rule)
    rule: Literal["layerwise", "global"] = "global"

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"eigen rule must be one of {RULES}, got {self.rule!r}")

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset({"layer_errors"}) if self.rule == "layerwise" else frozenset()

    def allocate(self, problem: RankProblem) -> Allocation:
        errors = [relative_errors(spec.sigma).tolist() for spec in problem.groups]
        grids = [problem.grid(i) for i in range(len(problem.groups))]
        if self.rule == "layerwise":
            ranks, details = self._layerwise(problem, grids)
        else:
            ranks, details = self._global(problem, grids, errors)
        ranks = fit_to_budget(problem, ranks, lambda i, r: errors[i][r])
        return ranks, details | {"max_relative_error": max(err[r] for err, r in zip(errors, ranks))}

    @staticmethod
    def _on_grid(grid: list[int], rank: int) -> int:
        """The smallest allowed rank ≥ ``rank`` (the grid's largest if none)."""
        return grid[min(bisect.bisect_left(grid, rank), len(grid) - 1)]

    def _layerwise(self, problem: RankProblem, grids: list[list[int]]) -> tuple[list[int], dict[str, Any]]:
        curves = {spec.layer: spec.features["layer_errors"].view(2, -1) for spec in problem.groups}
        layers = sorted(curves)

        def thresholds(budget: float) -> dict[int, float]:
            return {layer: lowest_threshold(curves[layer], budget) for layer in layers}

        def ranks_at(budget: float) -> list[int]:
            eps = thresholds(budget)
            return [
                self._on_grid(grid, energy_rank(spec.sigma, eps[spec.layer]))
                for spec, grid in zip(problem.groups, grids)
            ]

        candidates = sorted({0.0} | {x for c in curves.values() for x in c[1].tolist()})
        if sum(ranks_at(candidates[-1])) > problem.budget:
            raise ValueError(
                f"eigen: every layer at its lowest threshold keeps more than ratio {problem.ratio} allows"
            )
        lo, hi = 0, len(candidates) - 1  # the smallest budget whose plan fits the ratio
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if sum(ranks_at(candidates[mid])) <= problem.budget else (mid + 1, hi)
        budget = candidates[lo]
        eps = thresholds(budget)
        return ranks_at(budget), {"error_budget": budget, "layer_epsilon": [eps[layer] for layer in layers]}

    def _global(
        self, problem: RankProblem, grids: list[list[int]], errors: list[list[float]]
    ) -> tuple[list[int], dict[str, Any]]:
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
        return ranks_at(candidates[lo]), {"epsilon": candidates[lo]}
