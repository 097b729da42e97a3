"""The convert flow: calibration → statistics → decompose (per layer) → summarize (per layer) → plan → build
→ evaluate → log → export. Which statistics and features are computed follows from the methods' ``needs``."""

from __future__ import annotations

from typing import Any

from prefect import flow, unmapped

from lrkv_core.allocation import statistics_for
from lrkv_tasks import convert as t
from lrkv_tasks.preflight import prepare
from lrkv_tasks.recipe import ConvertRecipe
from lrkv_tasks.store import LocalStore
from lrkv_tasks.tracking import log_run
from lrkv_tasks.zeroshot import zeroshot


def _record(timings: list[dict], name: str, future) -> Any:
    """Wait for a task and note its state (Completed / Cached) and its own run time; return its result."""
    future.wait()
    seconds = t.run_seconds(future.task_run_id)
    timings.append({"task": name, "state": future.state.name, "seconds": seconds})
    return future.result()


@flow(name="lrkv-convert", log_prints=True)
def convert_flow(recipe: ConvertRecipe) -> dict:
    """Compress a model's KV projections to a latent cache, evaluate it and log it to MLflow."""
    prepared = prepare(recipe)
    recipe = prepared.recipe
    for note in prepared.notes:
        print(note)
    store = str(LocalStore(recipe.store).root)
    timings: list[dict] = []
    comp, cal = recipe.compression, recipe.calibration
    config = comp.to_config()
    model = _record(timings, "resolve_model", t.resolve_model.submit(recipe.model))
    calib = _record(
        timings,
        "extract_calibration",
        t.extract_calibration.submit(model, cal.dataset, cal.n_samples, cal.seq_len, cal.seed, store),
    )
    stats = {
        s.name: _record(
            timings,
            f"collect_statistic[{s.name}]",
            t.collect_statistic.submit(model, calib, s.to_dict(), recipe.dtype, cal.batch_size, store),
        )
        for s in config.needed_statistics()
    }
    layer_ids = list(range(model.meta["shape"]["L"]))
    decomposed = t.decompose_layer.map(
        model=unmapped(model),
        stats=unmapped({name: stats[name] for name in config.decomposition.needs}),
        layer=layer_ids,
        group_size=unmapped(comp.group_size),
        decomposition=unmapped(comp.decomposition.to_dict()),
        store=unmapped(store),
    )
    layers = [_record(timings, f"decompose_layer[{i}]", f) for i, f in enumerate(decomposed)]
    features = sorted(config.features())
    summarized = t.summarize_layer.map(
        factors=layers,
        stats=unmapped({name: stats[name] for name in statistics_for(features)}),
        features=unmapped(features),
        store=unmapped(store),
    )
    summaries = [_record(timings, f"summarize_layer[{i}]", f) for i, f in enumerate(summarized)]
    plan = _record(
        timings,
        "plan_ranks",
        t.plan_ranks.submit(
            model, summaries, comp.ratio, comp.group_size, comp.rank_multiple, comp.allocator.to_dict(), store
        ),
    )
    built = _record(
        timings,
        "build_model",
        t.build_model.submit(
            model,
            layers,
            plan,
            comp.decomposition.to_dict(),
            comp.cache.to_dict(),
            recipe.dtype,
            store,
            rotation=comp.rotation,
            rotation_seed=comp.rotation_seed,
        ),
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
        log_run.submit(recipe.model_dump(mode="json"), model, calib, plan, built, base_eval, comp_eval),
    )
    exported = None
    if recipe.out:  # last: a failed evaluation or log leaves no complete-looking --out
        refresh = not t.export_is_current(built, recipe.out)  # a deleted or edited export is redone
        exported = _record(
            timings,
            "export_model",
            t.export_model.with_options(refresh_cache=refresh).submit(built, recipe.out),
        )
    return {
        "recipe": recipe,
        "notes": prepared.notes,
        "model": model,
        "plan": plan,
        "compressed": built,
        "exported": exported,
        "eval": {"base": base_eval, "compressed": comp_eval},
        "mlflow": run,
        "timings": timings,
    }
