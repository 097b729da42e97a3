"""The search's logic in memory: bisection per arm against enumeration, pruning, the Pareto front."""

import math
import random

import pytest

from lrkv_core.conversion.search import Budget, Point, grid_size, pareto_front, search_smallest

RATIOS = [round(0.05 * k, 2) for k in range(1, 21)]


def monotone_arms(rng: random.Random, n_arms: int) -> dict[str, tuple[float, float, float]]:
    """arm -> (bytes per unit ratio, fixed bytes, rise scale): bytes grow, the rise falls with the ratio."""
    return {
        f"arm{i}": (rng.uniform(100, 2000), rng.uniform(0, 50), rng.uniform(0.005, 2.0))
        for i in range(n_arms)
    }


def evaluator(arms: dict, calls: list):
    def evaluate(arm: str, ratio: float) -> Point:
        calls.append((arm, ratio))
        per_ratio, fixed, scale = arms[arm]
        rise = scale * (1 - ratio) ** 2
        return Point(arm, ratio, fixed + per_ratio * ratio, rise, kl=rise / 3)

    return evaluate


def brute_force(arms: dict, budget: Budget) -> list[Point]:
    return [evaluator(arms, [])(a, r) for a in arms for r in RATIOS]


@pytest.mark.parametrize("seed", range(40))
def test_bisection_finds_the_enumeration_s_smallest_feasible_point(seed):
    rng = random.Random(seed)
    arms = monotone_arms(rng, rng.randint(1, 5))
    budget = Budget(max_ppl_rise=rng.choice([0.01, 0.05, 0.2]), max_kl=rng.choice([None, 0.01, 0.1]))
    calls: list = []
    result = search_smallest(list(arms), RATIOS, evaluator(arms, calls), budget)
    feasible = [p for p in brute_force(arms, budget) if budget.admits(p)]
    if not feasible:
        assert result.best is None
    else:
        assert result.best is not None and budget.admits(result.best)
        assert result.best.kv_bytes == min(p.kv_bytes for p in feasible)
    assert len(calls) == len(set(calls)) == len(result.points)  # each candidate measured once
    assert len(calls) <= len(arms) * math.ceil(math.log2(len(RATIOS) + 1))  # bisection, not enumeration
    assert len(calls) < grid_size(list(arms), RATIOS)


def test_an_arm_stops_where_it_cannot_beat_the_best():
    # "large" meets the budget only from ratio 0.9 and holds 1000 bytes per unit ratio: alone it takes five
    # probes; after "small" (0.5 bytes at ratio 0.05), its first probe (ratio 0.5, over budget, 500 bytes)
    # shows no ratio of it can be both within budget and smaller, and it stops there
    arms = {"small": (10.0, 0.0, 0.01), "large": (1000.0, 0.0, 0.5)}
    alone: list = []
    assert search_smallest(["large"], RATIOS, evaluator(arms, alone), Budget(0.01)).best.ratio == 0.9
    assert len(alone) == 5
    calls: list = []
    result = search_smallest(["small", "large"], RATIOS, evaluator(arms, calls), Budget(0.01))
    assert result.best.arm == "small" and result.best.ratio == RATIOS[0]
    assert [c for c in calls if c[0] == "large"] == [("large", 0.5)]


def test_an_impossible_budget_finds_nothing():
    arms = {"a": (100.0, 0.0, 1.0)}  # the rise is 0 only at ratio 1.0, and ratio 1.0 is not offered
    calls: list = []
    result = search_smallest(["a"], RATIOS[:-1], evaluator(arms, calls), Budget(max_ppl_rise=0.0))
    assert result.best is None
    assert calls[-1] == ("a", RATIOS[-2])  # up to the largest ratio before giving up on the arm


def test_error_points_are_infeasible_and_larger_ratios_are_tried():
    def evaluate(arm, ratio):
        if ratio < 0.3:  # rounds to rank 0
            return Point(arm, ratio, 0.0, math.inf, error="rank 0")
        return Point(arm, ratio, 100 * ratio, 0.0)

    result = search_smallest(["a"], RATIOS, evaluate, Budget(0.01))
    assert result.best.ratio == 0.3


def test_pareto_front_is_the_non_dominated_points():
    rng = random.Random(0)
    points = [Point("a", 0.5, float(rng.randint(1, 30)), rng.uniform(0, 1)) for _ in range(60)]
    points.append(Point("a", 0.1, 0.0, math.inf, error="rank 0"))
    front = pareto_front(points)

    def dominated(p):
        return any(
            q.kv_bytes <= p.kv_bytes
            and q.ppl_rise <= p.ppl_rise
            and (q.kv_bytes, q.ppl_rise) != (p.kv_bytes, p.ppl_rise)
            for q in points
            if q.error is None
        )

    assert front == sorted(front, key=lambda p: p.kv_bytes)
    assert all(not dominated(p) for p in front)
    assert {(p.kv_bytes, p.ppl_rise) for p in points if p.error is None and not dominated(p)} == {
        (p.kv_bytes, p.ppl_rise) for p in front
    }
    assert [p.ppl_rise for p in front] == sorted((p.ppl_rise for p in front), reverse=True)


def test_budget_reads_kl_when_set():
    p = Point("a", 0.5, 10.0, 0.005, kl=0.2)
    assert Budget(0.01).admits(p) and not Budget(0.01, max_kl=0.1).admits(p)
    assert not Budget(0.01, max_kl=0.1).admits(Point("a", 0.5, 10.0, 0.005, kl=None))
    assert not Budget(0.01).admits(Point("a", 0.5, 10.0, math.nan))
