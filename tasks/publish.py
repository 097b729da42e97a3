"""The convert flow's last steps: log the run to MLflow (with the model), register it, publish a summary."""

from __future__ import annotations

import json
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from lrkv_core.fingerprint import hash_json

from .cache import checked
from .convert import CACHED
from .keys import task_key
from .recipe import flatten, method_label
from .refs import ArtifactRef
from .registry import log_model, model_name, register_version
from .store import local_path
from .tracking import close_run, log_results, versions


def conversion_metrics(plan: ArtifactRef, base_eval: dict | None, eval_: dict | None) -> dict[str, float]:
    """The MLflow metrics of one conversion: ratios, perplexities, bytes, KL, zero-shot scores."""
    metrics = {"target_ratio": plan.meta["target_ratio"], "achieved_ratio": plan.meta["achieved_ratio"]}
    for label, ev in (("base", base_eval), ("compressed", eval_)):
        if ev is None:
            continue
        metrics[f"{label}_prefill_ppl"] = ev["prefill"]["ppl"]
        metrics[f"{label}_decode_ppl"] = ev["decode"]["ppl"]
        metrics[f"{label}_kv_bytes_per_token"] = ev["kv"]["kv_bytes_per_token"]
        for task_name, task_metrics in ev.get("zeroshot", {}).get("results", {}).items():
            for metric, value in task_metrics.items():
                metrics[f"{label}_zeroshot.{task_name}.{metric}"] = value
    if eval_ and "kl" in eval_:
        metrics["kl_base_compressed"] = eval_["kl"]["kl"]
        metrics["top1_agreement"] = eval_["kl"]["top1_agreement"]
    if base_eval and eval_:
        metrics["kv_bytes_ratio"] = eval_["kv"]["kv_bytes_per_token"] / base_eval["kv"]["kv_bytes_per_token"]
    return metrics


def eval_table(base_eval: dict | None, eval_: dict | None) -> dict[str, list]:
    """Base vs compressed measures as an MLflow table (columns of equal length)."""
    rows = [
        ("prefill ppl", "prefill", "ppl"),
        ("decode ppl", "decode", "ppl"),
        ("KV bytes/token", "kv", "kv_bytes_per_token"),
    ]
    return {
        "measure": [r[0] for r in rows],
        "base": [base_eval[a][b] if base_eval else None for _, a, b in rows],
        "compressed": [eval_[a][b] if eval_ else None for _, a, b in rows],
    }


def quality(base_eval: dict | None, eval_: dict | None) -> dict | None:
    """What the registry's quality gate compares: prefill perplexities and a fingerprint of their protocol."""
    if not base_eval or not eval_:
        return None
    return {
        "ppl": eval_["prefill"]["ppl"],
        "base_ppl": base_eval["prefill"]["ppl"],
        "protocol": hash_json(eval_["prefill"]["protocol"])[:16],
    }


def _key_without_run(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    """The run a result is logged into is not part of what the result is."""
    return task_key(ctx, {k: v for k, v in params.items() if k != "run"})


@task(name="log_run", cache_key_fn=checked(_key_without_run), **CACHED)
def log_run(
    run: dict,
    recipe: dict,
    model: ArtifactRef,
    calib: ArtifactRef,
    plan: ArtifactRef,
    built: ArtifactRef,
    base_eval: dict | None,
    eval_: dict | None,
    store: str | None = None,
) -> dict:
    """Log params, metrics, tables, figures, artifacts and the compressed model (an MLflow model) into the
    flow's MLflow run, then close it FINISHED."""
    params = {f"recipe.{k}": v for k, v in flatten(recipe).items()}
    params.update({f"version.{k}": v for k, v in versions().items()})
    params.update(
        {
            "fingerprint.model": model.sha256,
            "fingerprint.calibration": calib.sha256,
            "fingerprint.compressed": built.sha256,
        }
    )
    metrics = conversion_metrics(plan, base_eval, eval_)
    comp = recipe["compression"]
    evals = {"base": base_eval, "compressed": eval_}
    log_results(
        run,
        params=params,
        metrics=metrics,
        json_artifacts={
            "eval.json": {k: v for k, v in evals.items() if v is not None},
            "rank_plan.json": json.loads(local_path(plan.uri).read_text()),
            "recipe.json": recipe,
        },
        tables={"eval_table.json": eval_table(base_eval, eval_)} if eval_ else {},
        figures={"rank_plan_heatmap.png": str(local_path(plan.meta["heatmap"]))},
        tags={
            "lrkv.method": comp["name"],
            "lrkv.model": model.meta["ref"],
            "lrkv.decomposition": method_label(comp["decomposition"]),
            "lrkv.allocator": method_label(comp["allocator"]),
        },
    )
    logged = log_model(run, local_path(built.uri), built.sha256)
    close_run(run, "FINISHED")
    return run | {"metrics": metrics, "model": logged}


@task(name="register_model", cache_key_fn=checked(task_key), **CACHED)
def register_model(
    logged: dict,
    built: ArtifactRef,
    model_ref: str,
    base_eval: dict | None,
    eval_: dict | None,
    registry: dict,
    store: str | None = None,
) -> dict:
    """Register the logged model as ``lrkv-<model>`` with alias ``candidate`` (and ``champion`` if the
    quality gate passes); nothing is left half-registered on failure."""
    name = registry["name"] or model_name(model_ref)
    return register_version(
        logged, logged["model"], built.sha256, name, quality(base_eval, eval_), registry["max_ppl_rise"]
    )
