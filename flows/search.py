"""The search flow: the smallest KV cache within a quality budget, converted, exported and registered.

Each candidate (an arm: cache storage × allocator, at a width ratio) is a convert subflow with the registry
off and no export, so calibration, statistics, factors, plans and the original's evaluation are computed
once and every candidate measured before comes from the cache;
:func:`lrkv_core.conversion.search.search_smallest` picks which candidates to measure. The winner is then
converted once more with the base recipe's registry and ``out`` (every step but logging, registration and
export served from the cache): registered as ``candidate``, and ``champion`` when the registry's quality gate
passes.
"""

from __future__ import annotations

import time

from prefect import flow

from lrkv_core.conversion.search import Point, grid_size, search_smallest
from lrkv_core.data.heldout import overlap
from lrkv_tasks.recipes.preflight import prepare
from lrkv_tasks.recipes.search_recipe import SearchRecipe
from lrkv_tasks.results import ConvertResult
from lrkv_tasks.search import search_row, summarize_search, to_point

from .convert import convert_flow
from .runner import ConfiguredTaskRunner


def _computed(result: ConvertResult) -> tuple[int, int, int]:
    """Tasks of a conversion computed, served from the cache, and evaluations computed."""
    states = [(row["task"], row["state"]) for row in result.timings]
    computed = sum(state != "Cached" for _, state in states)
    evaluations = sum(name.startswith("evaluate") and state != "Cached" for name, state in states)
    return computed, len(states) - computed, evaluations


@flow(name="lrkv-search", log_prints=True, task_runner=ConfiguredTaskRunner())
def search_flow(recipe: SearchRecipe, out_dir: str | None = None) -> dict:
    """Find the smallest KV cache within the budget by bisection, then convert, export and register it."""
    start = time.perf_counter()
    base = prepare(recipe.base).recipe  # "heldout" and "auto" resolved, paths made absolute
    clash = overlap(base.calibration.dataset, base.eval.dataset)
    if clash is not None:
        raise ValueError(f"a search must be evaluated on held-out data: {clash}")
    recipe = recipe.model_copy(update={"base": base})
    no_registry = base.registry.model_copy(update={"enabled": False})  # candidates are not releases
    rows: list[dict] = []
    cost = {"conversions": 0, "tasks_computed": 0, "tasks_cached": 0, "evaluations": 0}

    def evaluate(arm: str, ratio: float) -> Point:
        comp = recipe.candidate(arm, ratio)
        point = base.model_copy(update={"compression": comp, "out": None, "registry": no_registry})
        try:
            result = convert_flow(point)
        except ValueError as e:  # e.g. a ratio that rounds to rank 0 for this group size
            rows.append(search_row(arm, comp, None, str(e)))
        else:
            rows.append(search_row(arm, comp, result))
            computed, cached, evaluations = _computed(result)
            cost["tasks_computed"] += computed
            cost["tasks_cached"] += cached
            cost["evaluations"] += evaluations
        cost["conversions"] += 1
        p = to_point(rows[-1])
        verdict = "within budget" if recipe.search.budget().admits(p) else "over budget"
        print(
            f"{arm} at ratio {ratio}: {p.kv_bytes:.1f} KV bytes/token, PPL rise {p.ppl_rise:+.3%} ({verdict})"
        )
        return p

    arms = list(recipe.arms())
    found = search_smallest(arms, recipe.search.ratios, evaluate, recipe.search.budget())
    cost["grid_points"] = grid_size(arms, recipe.search.ratios)
    best = None
    if found.best is not None:
        best = next(r for r in rows if (r["arm"], r["ratio"]) == (found.best.arm, found.best.ratio))
    cost["search_seconds"] = round(time.perf_counter() - start, 2)
    summary = summarize_search(rows, found, best, cost, recipe.model_dump(mode="json"), out_dir)
    if best is None:
        closest = min(found.points, key=lambda p: p.ppl_rise)
        raise ValueError(
            f"no candidate within the budget (PPL rise ≤ {found.budget.max_ppl_rise:.2%}"
            + (f", KL ≤ {found.budget.max_kl}" if found.budget.max_kl is not None else "")
            + f") among {len(found.points)} measured; the least rise was {closest.ppl_rise:+.2%} "
            f"({closest.arm} at ratio {closest.ratio}); nothing registered: see {summary['dir']}/search.md"
        )
    winner = convert_flow(
        base.model_copy(update={"compression": recipe.candidate(best["arm"], best["ratio"])})
    )
    return {
        "best": best,
        "rows": summary["rows"],
        "front": [r for r in summary["rows"] if r["on_front"]],
        "cost": cost | {"seconds": round(time.perf_counter() - start, 2)},
        "winner": winner,
        "summary": summary,
    }
