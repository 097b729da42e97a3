"""Rank allocators: one problem in, ranks out, one rounding rule for all.

Every allocator sees a :class:`RankProblem` (per group: its spectrum, max rank, Fisher sum and Fisher-weighted
error curve, whatever is available) and a budget of kept width ``⌊ratio · 2·L·Hkv·D⌋``. It proposes ranks on
the grid of allowed ranks (multiples of the rank multiple m, plus the group's max rank ``min(s·D, d)``), then
:func:`fit_to_budget` makes the proposal meet the budget the same way for every method: never above it,
and less than one step below it unless every group is at its max rank. Each group keeps at least one step
(``min(m, max rank)``). Everything is deterministic: ties go to the first group in (layer, K/V, group) order.

Allocators (:data:`ALLOCATORS`):

- ``uniform``: every group keeps ``ratio × group width``.
- ``fisher`` (Palu, §3.3): rank ∝ the group's Fisher sum, K and V of all layers sharing one budget. Palu
  caps each rank at the group width and loses the excess; here the excess is redistributed (water-filling:
  ``r_g = clamp(λ F_g, min, max)`` with λ solved so the budget is spent).
- ``lorc`` (LoRC, Zhang et al. 2024, eq. 12–13): progressive allocation from cumulative condition numbers
  of the KV *weights*. A layer's condition number is ``κ_l = κ(W_k,l) · κ(W_v,l)``, each of the layer's
  whole projection weight: data-free, whatever the decomposition (:func:`lrkv_core.ranks.weight_log_condition`
  computes it from the factors). The cumulative ``κ̃_l = Π_{j≥l} κ_j`` bounds how much an error made in
  layer l can be amplified by the layers after it, so shallow layers keep more. Layer l keeps the fraction
  ``d_l = d_min + (d_max − d_min) · n_l`` of each group, with ``n_l`` the min-max normalised ``log κ̃_l``.
  ``d_max = 1`` (full rank) and ``d_min`` is solved by bisection so the budget is met; if even
  ``d_min = 0`` is too wide, ``d_min = 0`` and ``d_max`` is solved instead. Layers whose own ``κ_l`` is
  below ``skip_threshold`` are not compressed. Given only spectra (no ``weight_condition``), each matrix's
  κ is the largest ``σ_max/σ_min`` over its groups' spectra: the weight's own κ for ``plain`` at s = Hkv.
- ``eigen`` (Eigen Attention, Saxena et al. 2024, §3.2): one relative error budget ε for every group; a
  group keeps the smallest rank whose relative truncation error ``Σ_{j≥r} σ_j² / Σ_j σ_j²`` is ≤ ε, and ε
  is searched (bisection over the achievable errors) for the smallest value that fits the budget.
- ``fisher-greedy`` (lrkv): from one step per group, repeatedly give a step to the group with the largest
  drop of Fisher-weighted truncation error ``Σ F ⊙ (W − W_r)²`` per unit of width.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .budget import (  # noqa: F401  (re-exported: the problem types and the budget rule)
    KINDS,
    ErrorCurves,
    GroupSpec,
    Priority,
    RankProblem,
    Ranks,
    Sensitivity,
    Spectra,
    WeightCondition,
    bisect_to_budget,
    clamped_total,
    fit_to_budget,
    ranks_from_targets,
    round_rank,
)

# smallest σ_min/σ_max used for condition numbers: a rank-deficient group has κ = 1e12, not inf
KAPPA_FLOOR = 1e-12


Allocation = tuple[list[int], dict[str, Any]]  # flat ranks in problem.groups order, details for the plan


# ------------------------------------------------------------------------------------------------ uniform
def allocate_uniform(problem: RankProblem) -> Allocation:
    """Every group keeps ``ratio × group width`` (capped at its max rank); leftover steps go in order."""
    targets = [problem.ratio * problem.group_width] * len(problem.groups)
    return ranks_from_targets(problem, targets), {}


# ------------------------------------------------------------------------------------------------- fisher
def allocate_fisher(problem: RankProblem) -> Allocation:
    """Palu's Fisher-proportional ranks: ``r_g = clamp(λ F_g, min, max)``, one λ for K and V of all layers."""
    fisher = [spec.fisher for spec in problem.groups]
    if any(f is None or not math.isfinite(f) or f < 0 for f in fisher):
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


# --------------------------------------------------------------------------------------------------- lorc
def log_condition_numbers(problem: RankProblem) -> list[float]:
    """``log κ_l = log κ(K_l) + log κ(V_l)``: the weights' if the problem has them, else from the spectra."""
    if problem.weight_condition is not None:
        return [entry["k"] + entry["v"] for entry in problem.weight_condition]
    out = [0.0] * problem.n_layers
    for kind in KINDS:
        per_layer = [0.0] * problem.n_layers
        for spec in problem.groups:
            if spec.kind == kind:
                per_layer[spec.layer] = max(per_layer[spec.layer], log_condition(spec.sigma))
        out = [a + b for a, b in zip(out, per_layer)]
    return out


def log_condition(sigma: torch.Tensor) -> float:
    """``log σ_max/σ_min`` of a spectrum, with σ_min floored at ``KAPPA_FLOOR · σ_max`` (0 for a zero one)."""
    top = float(sigma.abs().max())
    low = max(float(sigma.abs().min()), KAPPA_FLOOR * top)
    return math.log(top / low) if top > 0 else 0.0


def allocate_lorc(problem: RankProblem, *, skip_threshold: float | None = None) -> Allocation:
    """LoRC's progressive allocation (eq. 12–13) with d_min solved for the budget."""
    log_kappa = log_condition_numbers(problem)
    cumulative = [sum(log_kappa[layer:]) for layer in range(problem.n_layers)]  # log κ̃_l = Σ_{j≥l} log κ_j
    skipped = [
        layer
        for layer, lk in enumerate(log_kappa)
        if skip_threshold is not None and lk < math.log(max(skip_threshold, 1e-300))
    ]
    active = [layer for layer in range(problem.n_layers) if layer not in skipped]
    lo_c, hi_c = (
        (min(cumulative[a] for a in active), max(cumulative[a] for a in active)) if active else (0, 0)
    )
    norm = [(c - lo_c) / (hi_c - lo_c) if hi_c > lo_c else 1.0 for c in cumulative]

    def fractions(theta: float) -> tuple[float, float]:
        """(d_min, d_max): θ ∈ [1, 2] moves d_min from 0 to 1 at d_max = 1; θ ∈ [0, 1] is d_max = θ."""
        return (theta - 1.0, 1.0) if theta >= 1 else (0.0, theta)

    def targets(theta: float) -> list[float]:
        d_min, d_max = fractions(theta)
        return [
            spec.max_rank
            if spec.layer in skipped
            else (d_min + (d_max - d_min) * norm[spec.layer]) * spec.max_rank
            for spec in problem.groups
        ]

    if clamped_total(problem, targets(0.0)) > problem.budget:
        raise ValueError(
            f"skip threshold {skip_threshold} keeps layers {skipped} at full rank, which alone exceeds the "
            f"budget of ratio {problem.ratio}; raise the ratio or lower the skip threshold"
        )
    theta = bisect_to_budget(lambda x: clamped_total(problem, targets(x)), 0.0, 2.0, problem.budget)
    d_min, d_max = fractions(theta)
    details = {
        "d_min": d_min,
        "d_max": d_max,
        "skipped_layers": skipped,
        "log_condition": log_kappa,
        "log_cumulative_condition": cumulative,
    }
    return ranks_from_targets(problem, targets(theta)), details


# -------------------------------------------------------------------------------------------------- eigen
def relative_errors(sigma: torch.Tensor) -> torch.Tensor:
    """(max_rank + 1,) relative truncation error ``Σ_{j≥r} σ_j² / Σ_j σ_j²`` of keeping the first r."""
    s2 = sigma.to(torch.float64) ** 2
    tail = torch.cat([s2.flip(0).cumsum(0).flip(0), s2.new_zeros(1)])  # tail[r] = Σ_{j≥r} σ_j²
    return tail / tail[0] if tail[0] > 0 else torch.zeros_like(tail)


def allocate_eigen(problem: RankProblem) -> Allocation:
    """Eigen Attention's error budget: the smallest ε whose per-group ranks fit, then leftover steps."""
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


# ------------------------------------------------------------------------------------------ fisher-greedy
def allocate_fisher_greedy(problem: RankProblem) -> Allocation:
    """Greedy on the Fisher-weighted truncation error: largest error drop per unit of width first."""
    curves = [spec.curve for spec in problem.groups]
    for i, curve in enumerate(curves):
        needed = torch.tensor(problem.grid(i))
        if not torch.isfinite(curve[needed]).all():
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


@dataclass(frozen=True)
class Allocator:
    """A registered allocator: the function, what it needs besides spectra, and its options."""

    fn: Callable[..., Allocation]
    needs: tuple[str, ...] = ()  # "sensitivity" | "error_curves"
    options: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()  # optional inputs it uses when given: "weight_condition"


ALLOCATORS: dict[str, Allocator] = {
    "uniform": Allocator(allocate_uniform),
    "fisher": Allocator(allocate_fisher, needs=("sensitivity",)),
    "lorc": Allocator(allocate_lorc, options=("skip_threshold",), uses=("weight_condition",)),
    "eigen": Allocator(allocate_eigen),
    "fisher-greedy": Allocator(allocate_fisher_greedy, needs=("error_curves",)),
}


def needs_fisher(allocator: str) -> bool:
    """Whether ``allocator`` needs the Fisher information (so the Fisher stats must be collected)."""
    return bool(ALLOCATORS[allocator].needs)


def run_allocator(
    problem: RankProblem, allocator: str, options: Mapping[str, Any] | None = None
) -> Allocation:
    """Check the inputs ``allocator`` needs, run it, and return flat ranks meeting the budget."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator!r}; choose from {sorted(ALLOCATORS)}")
    entry = ALLOCATORS[allocator]
    options = dict(options or {})
    unknown = sorted(set(options) - set(entry.options))
    if unknown:
        raise ValueError(f"allocator {allocator!r} has no options {unknown}; it takes {list(entry.options)}")
    for need in entry.needs:
        if getattr(problem, need) is None:
            raise ValueError(
                f"allocator {allocator!r} needs the Fisher information ({need.replace('_', ' ')}): collect "
                "it with lrkv_core.fisher.collect_fisher and pass it in"
            )
    problem.check_feasible()
    ranks, details = entry.fn(problem, **options)
    kept = sum(ranks)
    if kept > problem.budget:
        raise AssertionError(f"allocator {allocator} exceeded the budget: {kept} > {problem.budget}")
    return ranks, details
