"""The convert flow: calibration → statistics → decompose (per layer) → summarize (per layer) → plan → build
→ [LoRA recovery] → evaluate → log (with the model) → register → export. Which statistics and features are
computed follows from the methods' ``needs``; with ``lora:`` the recovered model is what is evaluated,
logged, registered and exported, and the model before recovery is evaluated next to it.

The flow's MLflow run is opened first, so an interrupted or failed conversion leaves a run marked KILLED or
FAILED; a re-run whose every step came from the cache removes its empty run and returns the one that holds
the results. Task results live in the artifact store (JSON), so a killed flow resumes from its last finished
task, in this process or another, on a local or an S3 store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, unmapped
from prefect.exceptions import TerminationSignal

from lrkv_core.allocation import statistics_for
from lrkv_core.heldout import overlap as data_overlap
from lrkv_tasks import convert as t
from lrkv_tasks.lora import lora_recover
from lrkv_tasks.preflight import prepare
from lrkv_tasks.publish import log_run, register_model
from lrkv_tasks.recipe import ConvertRecipe
from lrkv_tasks.store import open_store
from lrkv_tasks.summary import publish_summary
from lrkv_tasks.tracking import OPEN_RUNS, close_run, discard_run, open_run
from lrkv_tasks.zeroshot import zeroshot

from .interrupt import FLOW_RUNS, require_api
from .runner import ConfiguredTaskRunner


def _record(timings: list[dict], name: str, future) -> Any:
    """Wait for a task and note its state (Completed / Cached) and its own run time; return its result."""
    future.wait()
    seconds = t.run_seconds(future.task_run_id)
    timings.append({"task": name, "state": future.state.name, "seconds": seconds})
    return future.result()


def _run_tags(recipe: ConvertRecipe) -> dict[str, str]:
    from prefect.runtime import flow_run

    return {"lrkv.kind": "convert", "lrkv.model": recipe.model, "lrkv.prefect_flow_run": str(flow_run.id)}


@flow(name="lrkv-convert", log_prints=True, task_runner=ConfiguredTaskRunner())
def convert_flow(recipe: ConvertRecipe) -> dict:
    """Compress a model's KV projections to a latent cache, evaluate it, log and register it in MLflow."""
    prepared = prepare(recipe)
    recipe = prepared.recipe
    for note in prepared.notes:
        print(note)
    comp = recipe.compression
    name = f"convert-{Path(recipe.model).name}-r{comp.ratio}-g{comp.group_size}"
    tags = _run_tags(recipe)
    run = open_run(recipe.tracking.mlflow_uri, recipe.tracking.experiment, name, tags)
    FLOW_RUNS.add(tags["lrkv.prefect_flow_run"])
    try:
        result = _convert(recipe, run)
    except BaseException as err:
        if run["run_id"] in OPEN_RUNS:
            killed = isinstance(err, (KeyboardInterrupt, SystemExit, TerminationSignal))
            close_run(run, "KILLED" if killed else "FAILED")
        raise
    finally:
        FLOW_RUNS.discard(tags["lrkv.prefect_flow_run"])
    publish_summary(result)
    return result | {"notes": prepared.notes}


def _convert(recipe: ConvertRecipe, run: dict) -> dict:
    st = open_store(recipe.store)
    store = st.root
    storage = st.result_storage()

    def stored(task):  # the task with its results kept in the artifact store (JSON records)
        return task.with_options(result_storage=storage)

    timings: list[dict] = []
    comp, cal = recipe.compression, recipe.calibration
    config = comp.to_config()
    model = _record(timings, "resolve_model", stored(t.resolve_model).submit(recipe.model, store))
    calib = _record(
        timings,
        "extract_calibration",
        stored(t.extract_calibration).submit(model, cal.dataset, cal.n_samples, cal.seq_len, cal.seed, store),
    )
    stats = {
        s.name: _record(
            timings,
            f"collect_statistic[{s.name}]",
            stored(t.collect_statistic).submit(
                model, calib, s.to_dict(), recipe.dtype, cal.batch_size, store
            ),
        )
        for s in config.needed_statistics()
        if not s.uses_factors
    }
    layer_ids = list(range(model.meta["shape"]["L"]))
    decomposed = stored(t.decompose_layer).map(
        model=unmapped(model),
        stats=unmapped({name: stats[name] for name in config.decomposition.needs}),
        layer=layer_ids,
        group_size=unmapped(comp.group_size),
        decomposition=unmapped(comp.decomposition.to_dict()),
        store=unmapped(store),
    )
    layers = [_record(timings, f"decompose_layer[{i}]", f) for i, f in enumerate(decomposed)]
    for s in config.needed_statistics():  # those that read the factors (kl_response), after decomposing
        if s.uses_factors:
            stats[s.name] = _record(
                timings,
                f"collect_statistic[{s.name}]",
                stored(t.collect_statistic).submit(
                    model, calib, s.to_dict(), recipe.dtype, cal.batch_size, store, layers=layers
                ),
            )
    features = sorted(config.features())
    summarized = stored(t.summarize_layer).map(
        factors=layers,
        stats=unmapped({name: stats[name] for name in statistics_for(features)}),
        features=unmapped(features),
        store=unmapped(store),
    )
    summaries = [_record(timings, f"summarize_layer[{i}]", f) for i, f in enumerate(summarized)]
    plan = _record(
        timings,
        "plan_ranks",
        stored(t.plan_ranks).submit(
            model, summaries, comp.ratio, comp.group_size, comp.rank_multiple, comp.allocator.to_dict(), store
        ),
    )
    if config.refines:  # the plan the model is built with: the refined one
        plan = _record(
            timings,
            "refine_plan",
            stored(t.refine_plan).submit(
                model,
                calib,
                layers,
                plan,
                config.refine_steps,
                comp.refine_rows,
                comp.refine_radius,
                comp.refine_objective,
                recipe.dtype,
                cal.batch_size,
                store,
            ),
        )
    built = _record(
        timings,
        "build_model",
        stored(t.build_model).submit(
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
    before_lora = recovered = None
    if recipe.lora is not None:  # downstream, "compressed" is the recovered model
        lora = recipe.lora.model_dump(mode="json")
        recovered = _record(
            timings, "lora_recover", stored(lora_recover).submit(built, lora, recipe.dtype, store)
        )
        before_lora, built = built, recovered
    base_eval = comp_eval = pre_eval = None
    if recipe.eval.dataset:
        ev = recipe.eval.model_dump()
        base_eval = _record(
            timings, "evaluate[base]", stored(t.evaluate).submit(model, ev, recipe.dtype, "base", store=store)
        )
        if before_lora is not None:  # the same task and label as a run without LoRA: served from its cache
            pre_eval = _record(
                timings,
                "evaluate[before-lora]",
                stored(t.evaluate).submit(before_lora, ev, recipe.dtype, "compressed", model, store),
            )
        comp_eval = _record(
            timings,
            "evaluate[compressed]",
            stored(t.evaluate).submit(
                built, ev, recipe.dtype, "compressed" if recovered is None else "recovered", model, store
            ),
        )
        if recipe.eval.zeroshot_tasks:
            for label, ref in (("base", model), ("compressed", built)):
                result = _record(
                    timings,
                    f"zeroshot[{label}]",
                    stored(zeroshot).submit(ref, ev, recipe.dtype, label, store),
                )
                (base_eval if label == "base" else comp_eval)["zeroshot"] = result
    require_api()  # publish nothing the orchestrator did not record
    logged = _record(
        timings,
        "log_run",
        stored(log_run).submit(
            run,
            recipe.model_dump(mode="json"),
            model,
            calib,
            plan,
            built,
            base_eval,
            comp_eval,
            store,
            lora=recovered,
            before_lora=pre_eval,
        ),
    )
    if logged["run_id"] != run["run_id"]:  # every result came from the cache: its run already holds them
        discard_run(run)
    registered = None
    # evaluation data that overlaps the calibration data never makes a champion
    overlap = data_overlap(cal.dataset, recipe.eval.dataset) if comp_eval is not None else None
    if recipe.registry.enabled:
        registry = recipe.registry.model_dump()
        registered = _record(
            timings,
            "register_model",
            stored(register_model).submit(
                logged, built, recipe.model, base_eval, comp_eval, registry, store, overlap=overlap
            ),
        )
    exported = None
    if recipe.out:  # last: a failed evaluation, log or registration leaves no complete-looking --out
        refresh = not t.export_is_current(built, recipe.out)  # a deleted or edited export is redone
        exported = _record(
            timings,
            "export_model",
            stored(t.export_model).with_options(refresh_cache=refresh).submit(built, recipe.out, store),
        )
    return {
        "recipe": recipe,
        "model": model,
        "plan": plan,
        "compressed": built,
        "exported": exported,
        "lora": recovered,
        "before_lora": before_lora,
        "eval": {"base": base_eval, "compressed": comp_eval, "before_lora": pre_eval},
        "mlflow": {k: logged[k] for k in ("run_id", "experiment_id", "tracking_uri")},
        "registered": registered,
        "timings": timings,
    }
