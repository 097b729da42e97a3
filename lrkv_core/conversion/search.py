"""The smallest KV cache within a quality budget: bisection on the width ratio per arm, and the Pareto front.

An *arm* is everything of a candidate but its width ratio (a cache storage with its bits, an allocator);
a *point* is one arm at one ratio, converted and measured: KV bytes per token, the relative rise of the
prefill perplexity over the original's and the KL divergence from it. Within an arm the search assumes what
the measurements show closely: the bytes grow with the ratio, and so does the quality (a ratio that meets the
budget is followed by larger ones that meet it too). Then the smallest feasible ratio of an arm is found by
bisection over the sorted ratios (about log2(n + 1) points instead of n), and a point whose bytes are not
below the best feasible point found so far ends its arm's search above it: no larger ratio of that arm can
beat it. Nothing here converts or measures; the caller's ``evaluate`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Budget:
    """The quality a candidate may give up: ``max_ppl_rise`` relative (0.01: PPL at most 1 % above the
    original's) and, when set, ``max_kl`` nats of KL(original ‖ compressed) per token."""

    max_ppl_rise: float
    max_kl: float | None = None

    def admits(self, point: Point) -> bool:
        if point.error is not None or not point.ppl_rise <= self.max_ppl_rise:  # NaN fails too
            return False
        return self.max_kl is None or (point.kl is not None and point.kl <= self.max_kl)


@dataclass(frozen=True)
class Point:
    """One measured candidate: its arm, ratio, KV bytes/token and quality (or the error that stopped it,
    e.g. a ratio that rounds to rank 0; such a point is never within budget)."""

    arm: Hashable
    ratio: float
    kv_bytes: float
    ppl_rise: float
    kl: float | None = None
    error: str | None = None


@dataclass
class SearchResult:
    """``best``: the feasible point with the fewest KV bytes (None: none within budget); ``points``: every
    point measured, in order; ``arms``: per arm, the ratios probed."""

    best: Point | None
    points: list[Point]
    budget: Budget
    arms: dict[Hashable, list[float]] = field(default_factory=dict)

    @property
    def front(self) -> list[Point]:
        return pareto_front(self.points)


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The points no other point beats on both KV bytes and perplexity rise (fewer-or-equal bytes and a
    lower-or-equal rise, one of them strictly), by increasing bytes; points with an error are left out."""
    ok = sorted((p for p in points if p.error is None and math.isfinite(p.ppl_rise)),
                key=lambda p: (p.kv_bytes, p.ppl_rise))  # fmt: skip
    front: list[Point] = []
    for p in ok:  # by bytes: p is on the front iff its rise is below every rise of fewer-or-equal bytes
        if not front or p.ppl_rise < front[-1].ppl_rise:
            if front and front[-1].kv_bytes == p.kv_bytes:
                continue  # same bytes, sorted by rise: the earlier one dominates
            front.append(p)
    return front


def search_smallest(
    arms: Sequence[Hashable],
    ratios: Sequence[float],
    evaluate: Callable[[Hashable, float], Point],
    budget: Budget,
) -> SearchResult:
    """The point with the fewest KV bytes within ``budget``, found by bisection on the ratio in each arm.

    Parameters
    ----------
    arms : the arms, searched in this order (an arm that holds small caches early prunes the others more).
    ratios : the width ratios an arm may take; sorted and deduplicated here.
    evaluate : ``(arm, ratio) -> Point``; called at most once per pair.
    budget : what a point must meet.
    """
    grid = sorted(set(ratios))
    if not grid or not arms:
        raise ValueError("a search needs at least one arm and one ratio")
    points: list[Point] = []
    probed: dict[Hashable, list[float]] = {}
    best: Point | None = None
    for arm in arms:
        probed[arm] = []
        lo, hi, found = -1, len(grid), None  # lo: known infeasible; hi: known feasible, or beyond the grid
        while hi - lo > 1:
            mid = (lo + hi) // 2
            p = evaluate(arm, grid[mid])
            points.append(p)
            probed[arm].append(grid[mid])
            feasible = budget.admits(p)
            if best is not None and p.kv_bytes >= best.kv_bytes:  # mid and every larger ratio: no better
                if not feasible:
                    break  # and every smaller ratio fails the budget
                hi = mid
            elif feasible:
                hi, found = mid, p
            else:
                lo = mid
        if found is not None and (best is None or found.kv_bytes < best.kv_bytes):
            best = found
    return SearchResult(best, points, budget, probed)


def grid_size(arms: Sequence[Hashable], ratios: Sequence[float]) -> int:
    """The points an enumeration of every arm and ratio would measure."""
    return len(arms) * len(set(ratios))
