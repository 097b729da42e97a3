"""The convert flow: calibration → stats → per-layer decomposition (mapped) → ranks → build → eval → log."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, unmapped

from lrkv_core.decompose import needs_gram
from lrkv_core.ranks import needs_fisher
from lrkv_tasks import convert as t
from lrkv_tasks.recipe import ConvertRecipe
from lrkv_tasks.store import LocalStore
from lrkv_tasks.zeroshot import zeroshot


def _record(timings: list[dict], name: str, future_or_state) -> Any:
    """Wait for a task, note its state (Completed / Cached) and duration, and return its result."""
    start = time.perf_counter()
    state = future_or_state.wait() or future_or_state.state
    timings.append({"task": name, "state": state.name, "seconds": round(time.perf_counter() - start, 3)})
    return future_or_state.result()


@flow(name="lrkv-convert", log_prints=True)
def convert_flow(recipe: ConvertRecipe) -> dict:
    """Compress a model's KV projections to a latent cache, evaluate it and log it to MLflow."""
    store = str(LocalStore(recipe.store).root)
    timings: list[dict] = []
    comp = recipe.compression
    model = _record(timings, "resolve_model", t.resolve_model.submit(recipe.model))
    cal = recipe.calibration
    calib = _record(
        timings,
        "extract_calibration",
        t.extract_calibration.submit(model, cal.dataset, cal.n_samples, cal.seq_len, cal.seed, store),
    )
    stats = None
    if needs_gram(comp.decomposition):
        stats = _record(
            timings,
            "collect_stats",
            t.collect_stats.submit(model, calib, recipe.dtype, cal.batch_size, store),
        )
    futures = t.decompose_layer.map(
        model=unmapped(model),
        stats=unmapped(stats),
        layer=list(range(model["shape"]["L"])),
        group_size=unmapped(comp.group_size),
        method=unmapped(comp.decomposition),
        store=unmapped(store),
    )
    layers = [_record(timings, f"decompose_layer[{i}]", f) for i, f in enumerate(futures)]
    fisher = None
    if needs_fisher(comp.allocator):
        fisher = _record(
            timings,
            "collect_fisher",
            t.collect_fisher.submit(model, calib, recipe.dtype, cal.batch_size, comp.fisher_per_row, store),
        )
    plan = _record(timings, "plan_ranks", t.plan_ranks.submit(layers, comp.model_dump(), fisher, store))
    built = _record(
        timings,
        "build_model",
        t.build_model.submit(model, layers, plan, comp.decomposition, recipe.dtype, store),
    )
    exported = None
    if recipe.out:
        refresh = not t.export_is_current(built, recipe.out)  # a deleted or edited export is redone
        exported = _record(
            timings,
            "export_model",
            t.export_model.with_options(refresh_cache=refresh).submit(built, recipe.out),
        )
    base_eval = comp_eval = None
    if recipe.eval.dataset:
        ev = recipe.eval.model_dump()
        base_eval = _record(timings, "evaluate[base]", t.evaluate.submit(model, ev, recipe.dtype, "base"))
        comp_eval = _record(
            timings, "evaluate[compressed]", t.evaluate.submit(built, ev, recipe.dtype, "compressed", model)
        )
        if recipe.eval.zeroshot_tasks:
            for label, ref in (("base", model), ("compressed", built)):
                result = _record(timings, f"zeroshot[{label}]", zeroshot.submit(ref, ev, recipe.dtype, label))
                (base_eval if label == "base" else comp_eval)["zeroshot"] = result
    run = _record(
        timings,
        "log_run",
        t.log_run.submit(recipe.model_dump(mode="json"), model, calib, plan, built, base_eval, comp_eval),
    )
    return {
        "model": model,
        "plan": plan,
        "compressed": built,
        "exported": exported,
        "eval": {"base": base_eval, "compressed": comp_eval},
        "mlflow": run,
        "timings": timings,
    }
