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
- ``lorc`` (LoRC, Zhang et al. 2024, eq. 12–13): progressive allocation from cumulative condition numbers.
  A layer's condition number is ``κ_l = κ(K_l) · κ(V_l)`` (each the largest ``σ_max/σ_min`` over the layer's
  groups); the cumulative ``κ̃_l = Π_{j≥l} κ_j`` bounds how much an error made in layer l can be amplified
  by the layers after it. Layer l keeps the fraction ``d_l = d_min + (d_max − d_min) · n_l`` of each group,
  with ``n_l`` the min-max normalised ``log κ̃_l`` (shallow layers keep more). ``d_max = 1`` (full rank) and
  ``d_min`` is solved by bisection so the budget is met; if even ``d_min = 0`` is too wide, ``d_min = 0`` and
  ``d_max`` is solved instead. Layers whose own ``κ_l`` is below ``skip_threshold`` are not compressed.
- ``eigen`` (Eigen Attention, Saxena et al. 2024, §3.2): one relative error budget ε for every group; a
  group keeps the smallest rank whose relative truncation error ``Σ_{j≥r} σ_j² / Σ_j σ_j²`` is ≤ ε, and ε
  is searched (bisection over the achievable errors) for the smallest value that fits the budget.
- ``fisher-greedy`` (lrkv): from one step per group, repeatedly give a step to the group with the largest
  drop of Fisher-weighted truncation error ``Σ F ⊙ (W − W_r)²`` per unit of width.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("k", "v")

# spectra[layer][kind][group] -> the group's singular values (prefix truncation keeps the first r)
Spectra = list[dict[str, list[torch.Tensor]]]
# sensitivity[layer][kind][group] -> the group's Fisher sum (see lrkv_core.fisher.group_sensitivity)
Sensitivity = list[dict[str, list[float]]]
# error_curves[layer][kind][group] -> (max_rank + 1,) Fisher-weighted error at every rank (NaN: not computed)
ErrorCurves = list[dict[str, list[torch.Tensor]]]
Ranks = dict[str, list[list[int]]]  # {"k": [[r_g for g] for layer], "v": ...}

# smallest σ_min/σ_max used for condition numbers: a rank-deficient group has κ = 1e12, not inf
KAPPA_FLOOR = 1e-12


def round_rank(r: float, multiple: int, max_rank: int) -> int:
    """Largest multiple of ``multiple`` that is ≤ r, capped at the group's max rank."""
    return min(int(math.floor(r / multiple + 1e-9)) * multiple, max_rank)


@dataclass(frozen=True)
class GroupSpec:
    """One (layer, kind, group): what an allocator may know about it."""

    layer: int
    kind: str
    index: int
    sigma: torch.Tensor  # (max_rank,) float64
    fisher: float | None  # Σ of the group's per-element Fisher
    curve: torch.Tensor | None  # (max_rank + 1,) float64 Fisher-weighted error at rank r

    @property
    def max_rank(self) -> int:
        return int(self.sigma.numel())


@dataclass
class RankProblem:
    """Everything the allocators see, plus the shared grid arithmetic.

    Parameters
    ----------
    spectra : ``spectra[layer][kind][g]``, (max_rank,) per group.
    group_width : s·D, the width a group has in the uncompressed cache.
    ratio : target kept fraction of the KV width, in (0, 1].
    rank_multiple : m; ranks are multiples of m or the group's max rank.
    sensitivity : per-group Fisher sums (``fisher``), optional.
    error_curves : per-group Fisher-weighted error curves (``fisher-greedy``), optional.
    """

    spectra: Spectra
    group_width: int
    ratio: float
    rank_multiple: int
    sensitivity: Sensitivity | None = None
    error_curves: ErrorCurves | None = None
    groups: list[GroupSpec] = field(init=False)

    def __post_init__(self) -> None:
        self.groups = []
        for layer, entry in enumerate(self.spectra):
            for kind in KINDS:
                for g, sigma in enumerate(entry[kind]):
                    sens = self._lookup(self.sensitivity, "sensitivity", layer, kind, g)
                    curve = self._lookup(self.error_curves, "error curves", layer, kind, g)
                    self.groups.append(
                        GroupSpec(
                            layer,
                            kind,
                            g,
                            sigma.detach().to("cpu", torch.float64).flatten(),
                            None if sens is None else float(sens),
                            None if curve is None else curve.detach().to("cpu", torch.float64).flatten(),
                        )
                    )
        for spec in self.groups:
            if not 0 < spec.max_rank <= self.group_width:
                raise ValueError(
                    f"group {self.name(spec)} has {spec.max_rank} directions, width {self.group_width}"
                )
            if spec.curve is not None and spec.curve.numel() != spec.max_rank + 1:
                raise ValueError(f"error curve of {self.name(spec)} must have max_rank + 1 entries")

    def _lookup(self, table: list | None, what: str, layer: int, kind: str, g: int) -> Any:
        if table is None:
            return None
        try:
            return table[layer][kind][g]
        except (IndexError, KeyError) as err:
            raise ValueError(
                f"{what} do not match the spectra: no entry for layer {layer} {kind} {g}"
            ) from err

    @staticmethod
    def name(spec: GroupSpec) -> str:
        return f"layer {spec.layer} {spec.kind.upper()} group {spec.index}"

    @property
    def n_layers(self) -> int:
        return len(self.spectra)

    @property
    def full_width(self) -> int:
        """2·L·Hkv·D: the width of the uncompressed cache."""
        return len(self.groups) * self.group_width

    @property
    def budget(self) -> int:
        """Kept width allowed: ⌊ratio · full width⌋ (1e-9 absorbs 0.29·100 = 28.999…)."""
        return int(math.floor(self.ratio * self.full_width + 1e-9))

    # ----------------------------------------------------------------------------------- grid arithmetic
    def min_rank(self, i: int) -> int:
        return min(self.rank_multiple, self.groups[i].max_rank)

    def max_rank(self, i: int) -> int:
        return self.groups[i].max_rank

    def next_rank(self, i: int, r: int) -> int:
        """The allowed rank after r (r < max rank)."""
        return min((r // self.rank_multiple + 1) * self.rank_multiple, self.max_rank(i))

    def prev_rank(self, i: int, r: int) -> int:
        """The allowed rank before r (r > min rank)."""
        m = self.rank_multiple
        return (r - 1) // m * m

    def grid(self, i: int) -> list[int]:
        """Allowed ranks of group i, ascending."""
        m, cap = self.rank_multiple, self.max_rank(i)
        return [*range(self.min_rank(i), cap, m), cap] if m < cap else [cap]

    def allowed(self, i: int, r: int) -> bool:
        return self.min_rank(i) <= r <= self.max_rank(i) and (
            r % self.rank_multiple == 0 or r == self.max_rank(i)
        )

    def floor_to_grid(self, i: int, t: float) -> int:
        """Largest allowed rank ≤ t, at least the minimum."""
        return max(self.min_rank(i), round_rank(t, self.rank_multiple, self.max_rank(i)))

    def nest(self, flat: Sequence[int]) -> Ranks:
        ranks: Ranks = {kind: [[] for _ in range(self.n_layers)] for kind in KINDS}
        for spec, r in zip(self.groups, flat, strict=True):
            ranks[spec.kind][spec.layer].append(int(r))
        return ranks

    def check_feasible(self) -> None:
        need = sum(self.min_rank(i) for i in range(len(self.groups)))
        if need > self.budget:
            raise ValueError(
                f"ratio {self.ratio} with rank multiple {self.rank_multiple} leaves rank 0 for some groups "
                f"(group width {self.group_width}): one step per group needs {need} of the {self.budget} "
                "budget width; use a smaller --rank-multiple, a larger --group-size or a larger ratio"
            )


# (group index, rank r) -> benefit of raising the group from r to its next allowed rank (higher: first)
Priority = Callable[[int, int], float]


def fit_to_budget(problem: RankProblem, ranks: Sequence[int], priority: Priority) -> list[int]:
    """Move allowed ranks onto the budget: the one rounding rule every allocator shares.

    While above the budget, remove the step with the least benefit; then, while a step fits, add the step with
    the most benefit. Ties favour the first group (it is the last to lose a step and the first to gain one).
    Afterwards ``kept ≤ budget`` and every group below its max rank has a next step wider than
    ``budget − kept``, so ``budget − kept < m`` unless all groups are at max rank.
    """
    r = list(ranks)
    n = len(r)
    for i in range(n):
        if not problem.allowed(i, r[i]):
            raise AssertionError(f"rank {r[i]} of {problem.name(problem.groups[i])} is not an allowed rank")
    budget, kept = problem.budget, sum(r)
    if kept > budget:
        # min-heap on (benefit of the group's last step, −index): least benefit first, then the last group
        down = [(priority(i, problem.prev_rank(i, r[i])), -i) for i in range(n) if r[i] > problem.min_rank(i)]
        heapq.heapify(down)
        while kept > budget:
            _, neg = heapq.heappop(down)
            i = -neg
            new = problem.prev_rank(i, r[i])
            kept, r[i] = kept - (r[i] - new), new
            if r[i] > problem.min_rank(i):
                heapq.heappush(down, (priority(i, problem.prev_rank(i, r[i])), -i))
    up = [
        (-priority(i, r[i]), i) for i in range(n) if r[i] < problem.max_rank(i)
    ]  # most benefit, first group
    heapq.heapify(up)
    while up:
        _, i = heapq.heappop(up)
        new = problem.next_rank(i, r[i])
        if kept + new - r[i] > budget:
            continue  # the leftover only shrinks: this step never fits again
        kept, r[i] = kept + new - r[i], new
        if r[i] < problem.max_rank(i):
            heapq.heappush(up, (-priority(i, r[i]), i))
    return r


def _from_targets(problem: RankProblem, targets: Sequence[float]) -> list[int]:
    """Round real-valued targets down to the grid, then spend the leftover on the largest deficits."""
    base = [problem.floor_to_grid(i, t) for i, t in enumerate(targets)]
    return fit_to_budget(problem, base, lambda i, r: targets[i] - r)


def _bisect(total: Callable[[float], float], lo: float, hi: float, budget: float, iters: int = 100) -> float:
    """Largest x in [lo, hi] with ``total(x) ≤ budget``, for ``total`` non-decreasing (total(lo) ≤ budget)."""
    if total(hi) <= budget:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
    return lo


def _clamped_sum(problem: RankProblem, targets: Sequence[float]) -> float:
    return sum(min(max(t, problem.min_rank(i)), problem.max_rank(i)) for i, t in enumerate(targets))


Allocation = tuple[list[int], dict[str, Any]]  # flat ranks in problem.groups order, details for the plan


# ------------------------------------------------------------------------------------------------ uniform
def allocate_uniform(problem: RankProblem) -> Allocation:
    """Every group keeps ``ratio × group width`` (capped at its max rank); leftover steps go in order."""
    targets = [problem.ratio * problem.group_width] * len(problem.groups)
    return _from_targets(problem, targets), {}


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
    lam = _bisect(lambda x: _clamped_sum(problem, [x * f for f in fisher]), 0.0, lam_max, problem.budget)
    targets = [min(max(lam * f, problem.min_rank(i)), caps[i]) for i, f in enumerate(fisher)]
    return _from_targets(problem, targets), {"lambda": lam}


# --------------------------------------------------------------------------------------------------- lorc
def log_condition_numbers(problem: RankProblem) -> list[float]:
    """``log κ_l = log κ(K_l) + log κ(V_l)``, each the largest ``log σ_max/σ_min`` over the layer's groups."""
    out = [0.0] * problem.n_layers
    for kind in KINDS:
        per_layer = [0.0] * problem.n_layers
        for spec in problem.groups:
            if spec.kind != kind:
                continue
            top = float(spec.sigma.abs().max())
            low = max(float(spec.sigma.abs().min()), KAPPA_FLOOR * top)
            per_layer[spec.layer] = max(per_layer[spec.layer], math.log(top / low) if top > 0 else 0.0)
        out = [a + b for a, b in zip(out, per_layer)]
    return out


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

    if _clamped_sum(problem, targets(0.0)) > problem.budget:
        raise ValueError(
            f"skip threshold {skip_threshold} keeps layers {skipped} at full rank, which alone exceeds the "
            f"budget of ratio {problem.ratio}; raise the ratio or lower the skip threshold"
        )
    theta = _bisect(lambda x: _clamped_sum(problem, targets(x)), 0.0, 2.0, problem.budget)
    d_min, d_max = fractions(theta)
    details = {
        "d_min": d_min,
        "d_max": d_max,
        "skipped_layers": skipped,
        "log_condition": log_kappa,
        "log_cumulative_condition": cumulative,
    }
    return _from_targets(problem, targets(theta)), details


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


ALLOCATORS: dict[str, Allocator] = {
    "uniform": Allocator(allocate_uniform),
    "fisher": Allocator(allocate_fisher, needs=("sensitivity",)),
    "lorc": Allocator(allocate_lorc, options=("skip_threshold",)),
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
