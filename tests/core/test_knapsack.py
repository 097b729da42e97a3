"""The exact solver for separable costs: equal to brute force, and better than greedy on non-convex curves."""

from __future__ import annotations

import itertools

import pytest
import torch

from lrkv_core.allocation import RankProblem, allocate_ranks
from lrkv_core.allocation.knapsack import minimize_separable


def _problem(caps: list[int], multiple: int, ratio: float) -> RankProblem:
    spectra = [{"k": [torch.ones(c, dtype=torch.float64) for c in caps], "v": []}]
    return RankProblem(spectra, group_width=max(caps), ratio=ratio, rank_multiple=multiple)


def _brute_force(problem: RankProblem, costs: list[torch.Tensor], at_least: int = 0) -> float:
    grids = [problem.grid(i) for i in range(len(problem.groups))]
    return min(
        sum(float(c[r]) for c, r in zip(costs, ranks))
        for ranks in itertools.product(*grids)
        if at_least <= sum(ranks) <= problem.budget
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("caps", "multiple"), [([16, 16, 16, 16], 4), ([24, 20, 24], 8), ([12, 9, 12, 12], 3)]
)
def test_minimize_separable_finds_the_brute_force_optimum(seed: int, caps: list[int], multiple: int) -> None:
    """Random non-monotone curves, max ranks off the grid (20 with multiple 8, 9 with 3): DP = enumeration."""
    gen = torch.Generator().manual_seed(seed)
    for ratio in (0.4, 0.6, 0.85):
        problem = _problem(caps, multiple, ratio)
        costs = [torch.rand(c + 1, generator=gen, dtype=torch.float64) for c in caps]
        ranks, total = minimize_separable(problem, costs)
        assert sum(ranks) <= problem.budget
        assert all(problem.allowed(i, r) for i, r in enumerate(ranks))
        assert total == pytest.approx(sum(float(c[r]) for c, r in zip(costs, ranks)), abs=1e-12)
        assert total == pytest.approx(_brute_force(problem, costs), abs=1e-12)
        # a least width (the refinement's: never narrower than the plan it starts from)
        at_least = problem.budget - 2 * multiple
        ranks, total = minimize_separable(problem, costs, at_least=at_least)
        assert at_least <= sum(ranks) <= problem.budget
        assert total == pytest.approx(_brute_force(problem, costs, at_least), abs=1e-12)


def _step_curve(cap: int, drop_at: int, drop: float) -> torch.Tensor:
    """Flat until ``drop_at``, then down by ``drop``: the shape a one-step greedy never climbs."""
    curve = torch.full((cap + 1,), drop, dtype=torch.float64)
    curve[drop_at:] = 0.0
    return curve


def test_exact_beats_greedy_where_a_curve_is_flat_before_it_drops() -> None:
    """Two groups of 32, budget 40: one drops by 10 only at rank 32, the other by 1 a step at a time. Greedy
    spends the budget on the small steady gains (cost 10 + …); the knapsack buys the big drop (cost ~1)."""
    spectra = [{"k": [torch.ones(32, dtype=torch.float64)], "v": [torch.ones(32, dtype=torch.float64)]}]
    steady = torch.tensor([max(0.0, 4 - r / 8) for r in range(33)], dtype=torch.float64)  # −1 per step of 8
    curves = [{"k": [_step_curve(32, 32, 10.0)], "v": [steady]}]
    kw = dict(ratio=40 / 64, group_size=1, head_dim=32, rank_multiple=8, features={"kl_curves": curves})
    exact = allocate_ranks(spectra, allocator="kl", **kw)
    greedy = allocate_ranks(spectra, allocator={"name": "kl", "solver": "greedy"}, **kw)
    assert exact.ranks == {"k": [[32]], "v": [[8]]} and exact.details["kl_estimate"] == pytest.approx(3.0)
    assert greedy.ranks == {"k": [[8]], "v": [[32]]} and greedy.details["kl_estimate"] == pytest.approx(10.0)
    assert exact.kept == greedy.kept == 40


def test_exact_solver_spends_the_leftover_of_flat_curves() -> None:
    """Equal costs at every rank: the knapsack keeps the least width; the shared rule fills the budget."""
    spectra = [
        {"k": [torch.ones(16, dtype=torch.float64)] * 3, "v": [torch.ones(16, dtype=torch.float64)] * 3}
    ]
    flat = [
        {"k": [torch.zeros(17, dtype=torch.float64)] * 3, "v": [torch.zeros(17, dtype=torch.float64)] * 3}
    ]
    problem = RankProblem(spectra, 16, 0.5, 4, {"kl_curves": flat})
    ranks, total = minimize_separable(problem, problem.values("kl_curves"))
    assert ranks == [4] * 6 and total == 0.0
    plan = allocate_ranks(
        spectra,
        ratio=0.5,
        group_size=1,
        head_dim=16,
        rank_multiple=4,
        allocator="kl",
        features={"kl_curves": flat},
    )
    assert plan.kept == plan.budget_width == 48


def test_solver_option_is_checked() -> None:
    with pytest.raises(ValueError, match="solver must be one of"):
        allocate_ranks(
            [{"k": [torch.ones(8)], "v": [torch.ones(8)]}], ratio=0.5, group_size=1, head_dim=8,
            allocator={"name": "kl", "solver": "annealing"},
        )  # fmt: skip
