"""The convert flow: calibration → the conversion's steps
(:func:`lrkv_core.conversion.steps.conversion_steps`, each a cached task, all submitted at once so independent
ones run together) → [LoRA recovery] → evaluate (and, with ``eval.long``, the long-context suite) → log (with
the model) → register → export. With ``lora:`` the recovered model is what is evaluated, logged, registered
and exported, and the model before recovery is evaluated next to it.

The flow's MLflow run is opened first, so an interrupted or failed conversion leaves a run marked KILLED or
FAILED; a re-run whose every step came from the cache removes its empty run and returns the one that holds
the results. Task results live in the artifact store (JSON), so a killed flow resumes from its last finished
task, in this process or another, on a local or an S3 store.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.exceptions import TerminationSignal

from lrkv_core.conversion.steps import conversion_steps
from lrkv_core.data.heldout import overlap as data_overlap
from lrkv_tasks import convert as t
from lrkv_tasks.device import waited_seconds
from lrkv_tasks.lora import lora_recover
from lrkv_tasks.progress import run_peak_rss
from lrkv_tasks.publish import log_run, register_model
from lrkv_tasks.recipes.convert_recipe import ConvertRecipe
from lrkv_tasks.recipes.preflight import prepare
from lrkv_tasks.results import ConvertResult, Evaluations, eval_result
from lrkv_tasks.store.artifact_store import open_store
from lrkv_tasks.summary import publish_summary
from lrkv_tasks.tracking.mlflow_runs import OPEN_RUNS, close_run, discard_run, open_run
from lrkv_tasks.zeroshot import zeroshot

from .interrupt import FLOW_RUNS, require_api
from .runner import ConfiguredTaskRunner, worker_count


def _record(timings: list[dict], name: str, future) -> Any:
    """Wait for a task and note its state (Completed / Cached), its own run time (less any wait for a
    model-pass slot) and the peak RSS of its process while its steps ran (None for a cache hit or a task
    on another worker); return its result."""
    future.wait()
    seconds = t.run_seconds(future.task_run_id)
    if seconds is not None:
        seconds = max(0.0, seconds - waited_seconds(future.task_run_id))
    peak = run_peak_rss(future.task_run_id)
    timings.append({"task": name, "state": future.state.name, "seconds": seconds, "peak_rss_bytes": peak})
    return future.result()


def _run_tags(recipe: ConvertRecipe) -> dict[str, str]:
    from prefect.runtime import flow_run

    return {"lrkv.kind": "convert", "lrkv.model": recipe.model, "lrkv.prefect_flow_run": str(flow_run.id)}


@flow(name="lrkv-convert", log_prints=True, task_runner=ConfiguredTaskRunner())
def convert_flow(recipe: ConvertRecipe) -> ConvertResult:
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
    result = replace(result, notes=list(prepared.notes))
    publish_summary(result)
    return result


def _convert(recipe: ConvertRecipe, run: dict) -> ConvertResult:
    st = open_store(recipe.store)
    store = st.root
    storage = st.result_storage()

    def stored(task):  # the task with its results kept in the artifact store (JSON records)
        return task.with_options(result_storage=storage)

    timings: list[dict] = []
    cal = recipe.calibration  # the shards it used are recorded with the run
    cal = cal.model_copy(update={"shards": cal.shards or worker_count()})
    recipe = recipe.model_copy(update={"calibration": cal})
    comp = recipe.compression
    config = comp.to_config()
    model = _record(timings, "resolve_model", stored(t.resolve_model).submit(recipe.model, store))
    calib = _record(
        timings,
        "extract_calibration",
        stored(t.extract_calibration).submit(model, cal.dataset, cal.n_samples, cal.seq_len, cal.seed, store),
    )
    graph = conversion_steps(
        config,
        model.meta["shape"]["L"],
        shards=cal.shards,
        rows=cal.n_samples,
        seq_len=cal.seq_len,
        batch_size=cal.rows_per_pass,
    )
    ctx = t.StepContext(model, calib, recipe.dtype, cal.rows_per_pass, store, stored, cal.precision)
    futures: dict[str, Any] = {}
    for s in graph:  # every step submitted before any is awaited: independent ones run at once
        futures[s.name] = t.submit_step(s, futures, ctx)
    base_future = None
    ev = recipe.eval.model_dump(exclude={"long"})

    def evaluate_base():
        return stored(t.evaluate).submit(model, ev, recipe.dtype, "base", store=store)

    # the original's evaluation needs nothing of the conversion: beside it on another worker of a cluster;
    # in one process, whose model passes take turns, after it, so the built model comes first
    if recipe.eval.dataset and worker_count() > 1:
        base_future = evaluate_base()
    done = {s.name: _record(timings, t.step_label(s), futures[s.name]) for s in graph}
    if recipe.eval.dataset and base_future is None:
        base_future = evaluate_base()
    plan, built = done[graph.result], done["build"]
    before_lora = recovered = None
    if recipe.lora is not None:  # downstream, "compressed" is the recovered model
        lora = recipe.lora.model_dump(mode="json")
        recovered = _record(
            timings, "lora_recover", stored(lora_recover).submit(built, lora, recipe.dtype, store, model)
        )
        before_lora, built = built, recovered
    base_eval = comp_eval = pre_eval = None
    if base_future is not None:
        label = "compressed" if recovered is None else "recovered"
        comp_future = stored(t.evaluate).submit(built, ev, recipe.dtype, label, model, store)
        pre_future = None
        if before_lora is not None:  # the same task and label as a run without LoRA: served from its cache
            pre_future = stored(t.evaluate).submit(before_lora, ev, recipe.dtype, "compressed", model, store)
        long_future = None
        if recipe.eval.long is not None:  # the compressed model's suite, with the original's on the same data
            long_cfg = recipe.eval.long.model_dump()
            long_future = stored(t.evaluate_long).submit(
                built, ev["dataset"], long_cfg, recipe.dtype, label, model, store
            )
        zeroshots = {}
        if recipe.eval.zeroshot_tasks:
            for label, ref in (("base", model), ("compressed", built)):
                zeroshots[label] = stored(zeroshot).submit(ref, ev, recipe.dtype, label, store)
        base_eval = _record(timings, "evaluate[base]", base_future)
        if pre_future is not None:
            pre_eval = _record(timings, "evaluate[before-lora]", pre_future)
        comp_eval = _record(timings, "evaluate[compressed]", comp_future)
        if long_future is not None:
            comp_eval["long"] = _record(timings, "evaluate_long[compressed]", long_future)
        for label, future in zeroshots.items():
            result = _record(timings, f"zeroshot[{label}]", future)
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
                logged,
                built,
                recipe.model,
                base_eval,
                comp_eval,
                registry,
                store,
                overlap=overlap,
                before_lora=pre_eval,
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
    return ConvertResult(
        recipe=recipe,
        model=model,
        calibration=calib,
        plan=plan,
        compressed=built,
        eval=Evaluations(eval_result(base_eval), eval_result(comp_eval), eval_result(pre_eval)),
        mlflow={k: logged[k] for k in ("run_id", "experiment_id", "tracking_uri")},
        timings=timings,
        exported=exported,
        lora=recovered,
        before_lora=before_lora,
        registered=registered,
    )
