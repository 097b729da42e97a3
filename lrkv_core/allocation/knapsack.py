"""The exact rank choice for separable costs: a multiple-choice knapsack over the grid of allowed ranks.

When an allocator prices every group on its own, ``cost_g(r)`` at each allowed rank r (a truncation error,
an estimated KL), the best plan minimises ``Σ_g cost_g(r_g)`` subject to ``Σ_g r_g ≤ budget``. One step at a
time (the greedy rule) is optimal only when every curve is convex on the grid: a curve that is flat for a
while and then drops is never reached, since its next step looks worthless. Measured on SmolLM2-135M at
ratio 0.7, ``kl``'s greedy plan raises held-out perplexity by +22.6 and its exact plan by +0.7
(docs/allocation.md).

Dynamic programming over the budget solves it exactly: with every allowed rank a multiple of a unit u,
``best[i][b]`` = the least cost of groups 0..i using ``b·u`` width, one min-plus step per group and grid
rank, ``O(groups · grid · budget / u)`` vectorised over b.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .problem import RankProblem


def minimize_separable(
    problem: RankProblem, costs: Sequence[torch.Tensor], at_least: int = 0
) -> tuple[list[int], float]:
    """Ranks on the grid minimising ``Σ_g costs[g][r_g]`` with ``at_least ≤ Σ_g r_g ≤ budget``.

    Parameters
    ----------
    problem : the rank problem (grid, budget, groups).
    costs : per group, (max_rank + 1,) finite costs at least on the group's grid ranks.
    at_least : the least total width a plan may keep (where costs can fall as ranks are cut, e.g. a
        loss that a cut lowers, this keeps a plan from spending less than the budget it was given).

    Returns
    -------
    flat ranks in ``problem.groups`` order, and their total cost. Among plans of equal cost the one using
    the least width is returned; :func:`~lrkv_core.allocation.problem.fit_to_budget` spends what is left.
    """
    grids = [problem.grid(i) for i in range(len(problem.groups))]
    unit = math.gcd(*(r for grid in grids for r in grid))
    n_units = problem.budget // unit
    best = torch.full((n_units + 1,), math.inf, dtype=torch.float64)  # best[b]: least cost at b·unit width
    best[0] = 0.0
    choices = []  # per group: (n_units + 1,) index into its grid of the rank chosen at each width
    for grid, cost in zip(grids, costs, strict=True):
        values = cost.to(torch.float64)[torch.tensor(grid)]  # (len(grid),)
        nxt = torch.full_like(best, math.inf)
        pick = torch.full((n_units + 1,), -1, dtype=torch.int32)
        for k, (r, value) in enumerate(zip(grid, values.tolist())):
            w = r // unit
            if w > n_units:
                break  # the grid ascends: wider ranks never fit either
            candidate = torch.full_like(best, math.inf)
            candidate[w:] = best[: n_units + 1 - w] + value
            better = candidate < nxt
            nxt = torch.where(better, candidate, nxt)
            pick = torch.where(better, torch.tensor(k, dtype=torch.int32), pick)
        best = nxt
        choices.append(pick)
    low = -(-at_least // unit)  # the least width in units
    if low > n_units or not math.isfinite(float(best[low:].min())):
        raise ValueError("no plan meets the budget with one allowed rank per group")
    b = low + int(torch.argmin(best[low:]))  # the first minimum: the least width among plans of equal cost
    total = float(best[b])
    ranks = []
    for grid, pick in zip(reversed(grids), reversed(choices)):
        r = grid[int(pick[b])]
        ranks.append(r)
        b -= r // unit
    return ranks[::-1], total
