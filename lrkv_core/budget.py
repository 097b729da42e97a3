"""The rank problem every allocator solves, and the one budget rule they share.

A :class:`RankProblem` lists, per (layer, K/V, group), what an allocator may use: the spectrum, the max
rank, the width, the Fisher sum and the Fisher-weighted error curve. :func:`fit_to_budget` turns any
proposal into ranks that meet the budget the same way for every method: never above it, and less than one
rank multiple below it unless every group is at its max rank.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
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
# weight_condition[layer][kind] -> log κ of the layer's whole k_proj / v_proj weight (LoRC's condition number)
WeightCondition = list[dict[str, float]]


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
    weight_condition : per-layer ``log κ`` of the k_proj and v_proj weights (``lorc``), optional.
    """

    spectra: Spectra
    group_width: int
    ratio: float
    rank_multiple: int
    sensitivity: Sensitivity | None = None
    error_curves: ErrorCurves | None = None
    weight_condition: WeightCondition | None = None
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
        if self.weight_condition is not None and (
            len(self.weight_condition) != len(self.spectra)
            or any(set(entry) != set(KINDS) for entry in self.weight_condition)
        ):
            raise ValueError(
                f"weight condition numbers must give 'k' and 'v' for each of the {len(self.spectra)} layers"
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


def ranks_from_targets(problem: RankProblem, targets: Sequence[float]) -> list[int]:
    """Round real-valued targets down to the grid, then spend the leftover on the largest deficits."""
    base = [problem.floor_to_grid(i, t) for i, t in enumerate(targets)]
    return fit_to_budget(problem, base, lambda i, r: targets[i] - r)


def bisect_to_budget(
    total: Callable[[float], float], lo: float, hi: float, budget: float, iters: int = 100
) -> float:
    """Largest x in [lo, hi] with ``total(x) ≤ budget``, for ``total`` non-decreasing (total(lo) ≤ budget)."""
    if total(hi) <= budget:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
    return lo


def clamped_total(problem: RankProblem, targets: Sequence[float]) -> float:
    return sum(min(max(t, problem.min_rank(i)), problem.max_rank(i)) for i, t in enumerate(targets))
