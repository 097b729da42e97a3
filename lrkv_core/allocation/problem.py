"""The rank problem every allocator solves, and the one budget rule they share.

A :class:`RankProblem` lists, per (layer, K/V, group), what an allocator may use: the spectrum, the max
rank, the width and any per-group *features* that were computed for it (Fisher sums, Fisher-weighted error
curves, the weights' condition numbers: see :mod:`lrkv_core.allocation.features`). :func:`fit_to_budget`
turns any proposal into ranks that meet the budget the same way for every method: never above it, and less
than one rank multiple below it unless every group is at its max rank.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("k", "v")

# per_layer[layer][kind][group] -> a value: the layout of spectra and of every feature
PerGroup = list[dict[str, list[Any]]]
# spectra[layer][kind][group] -> the group's singular values (prefix truncation keeps the first r)
Spectra = list[dict[str, list[torch.Tensor]]]
Ranks = dict[str, list[list[int]]]  # {"k": [[r_g for g] for layer], "v": ...}


def check_one_step_fits(need: int, budget: int, ratio: float, rank_multiple: int, group_width: int) -> None:
    """Raise unless one rank step per group (``need`` in total) fits in the budget width."""
    if need > budget:
        raise ValueError(
            f"ratio {ratio} with rank multiple {rank_multiple} leaves rank 0 for some groups "
            f"(group width {group_width}): one step per group needs {need} of the {budget} budget width; "
            "use a smaller --rank-multiple, a larger --group-size or a larger ratio"
        )


def budget_width(ratio: float, full_width: int) -> int:
    """Kept width allowed: ⌊ratio · full width⌋ (1e-9 absorbs 0.29·100 = 28.999…)."""
    return int(math.floor(ratio * full_width + 1e-9))


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
    features: Mapping[str, Any]  # feature name -> this group's value (float, or a float64 tensor)

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
    features : ``features[name][layer][kind][g]``, per-group values laid out like the spectra.
    """

    spectra: Spectra
    group_width: int
    ratio: float
    rank_multiple: int
    features: Mapping[str, PerGroup] = field(default_factory=dict)
    groups: list[GroupSpec] = field(init=False)

    def __post_init__(self) -> None:
        self.groups = []
        for layer, entry in enumerate(self.spectra):
            for kind in KINDS:
                for g, sigma in enumerate(entry[kind]):
                    values = {
                        name: _as_value(self._lookup(table, name, layer, kind, g))
                        for name, table in self.features.items()
                    }
                    self.groups.append(
                        GroupSpec(layer, kind, g, sigma.detach().to("cpu", torch.float64).flatten(), values)
                    )
        for spec in self.groups:
            if not 0 < spec.max_rank <= self.group_width:
                raise ValueError(
                    f"group {self.name(spec)} has {spec.max_rank} directions, width {self.group_width}"
                )

    def _lookup(self, table: PerGroup, what: str, layer: int, kind: str, g: int) -> Any:
        try:
            return table[layer][kind][g]
        except (IndexError, KeyError, TypeError) as err:
            raise ValueError(
                f"feature {what!r} does not match the spectra: no entry for layer {layer} {kind} group {g}"
            ) from err

    def require(self, *names: str) -> None:
        """Raise a clear error unless every named feature was given."""
        missing = [n for n in names if n not in self.features]
        if missing:
            raise ValueError(f"the rank problem lacks the feature(s) {missing}")

    def values(self, name: str) -> list[Any]:
        """The feature's value of every group, in ``groups`` order."""
        self.require(name)
        return [spec.features[name] for spec in self.groups]

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
        """Kept width allowed: ⌊ratio · full width⌋."""
        return budget_width(self.ratio, self.full_width)

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
        check_one_step_fits(need, self.budget, self.ratio, self.rank_multiple, self.group_width)


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


def _as_value(v: Any) -> Any:
    """A feature value as allocators read it: a float64 CPU tensor, or a float."""
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", torch.float64).flatten() if v.numel() > 1 else float(v)
    return float(v)
