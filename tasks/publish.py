"""The convert flow's last steps: log the run to MLflow (with the model), register it, publish a summary."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from lrkv_core.evaluation.longcontext import LongContextResult
from lrkv_core.evaluation.metrics import EvalResult
from lrkv_core.system.fingerprint import hash_json

from .convert import CACHED
from .keys import task_key
from .recipes.convert_recipe import flatten, method_label
from .records import checked
from .results import Evaluations, eval_result
from .store.artifact_store import local_path
from .store.artifacts import ArtifactRef
from .tracking.mlflow_runs import close_run, log_metric_history, log_results, versions
from .tracking.model_registry import log_model, model_name, register_version
from .tracking.plots import plot_long_context


def conversion_metrics(
    plan: ArtifactRef,
    base_eval: EvalResult | None,
    eval_: EvalResult | None,
    before_lora: EvalResult | None = None,
) -> dict[str, float]:
    """The MLflow metrics of one conversion: ratios, perplexities, bytes, KL, zero-shot scores (with LoRA
    recovery, ``compressed_*`` are the recovered model's and ``before_lora_*`` the model's before it)."""
    metrics = {"target_ratio": plan.meta["target_ratio"], "achieved_ratio": plan.meta["achieved_ratio"]}
    objective = plan.meta.get("objective")
    if objective in plan.meta:  # a refined plan: the calibration KL (or NLL) it started from and ended at
        kept = plan.meta[objective]
        metrics[f"refine_{objective}_before"], metrics[f"refine_{objective}_after"] = kept[0], min(kept)
    for label, ev in (("base", base_eval), ("compressed", eval_), ("before_lora", before_lora)):
        if ev is not None:
            metrics |= ev.metrics(f"{label}_")
    if eval_ and eval_.kl is not None:
        metrics["kl_base_compressed"] = eval_.kl_to_base
        metrics["top1_agreement"] = eval_.top1_agreement
    if before_lora and before_lora.kl is not None:
        metrics["before_lora_kl_base_compressed"] = before_lora.kl_to_base
        metrics["before_lora_top1_agreement"] = before_lora.top1_agreement
    if base_eval and eval_:
        metrics["kv_bytes_ratio"] = Evaluations(base_eval, eval_).kv_bytes_ratio
    return metrics


def eval_table(
    base_eval: EvalResult | None, eval_: EvalResult | None, before_lora: EvalResult | None = None
) -> dict[str, list]:
    """Base vs compressed measures (and before LoRA, when recovered) as an MLflow table."""
    rows = [
        ("prefill ppl", "prefill_ppl"),
        ("decode ppl", "decode_ppl"),
        ("KV bytes/token", "kv_bytes_per_token"),
        ("KV bytes/token after the decode", "decode_kv_bytes_per_token"),
    ]
    table = {
        "measure": [name for name, _ in rows],
        "base": [getattr(base_eval, a) if base_eval else None for _, a in rows],
        "compressed": [getattr(eval_, a) if eval_ else None for _, a in rows],
    }
    if before_lora:
        table["before LoRA"] = [getattr(before_lora, a) for _, a in rows]
    return table


def long_context_metrics(long: dict) -> dict[str, float]:
    """MLflow metrics of the long-context suite: continuation perplexity per context length and each
    retrieval task's accuracy per prompt length (mean over depths), the model's and, where measured, the
    original's (``base_`` ...)."""
    result = LongContextResult.from_dict(long)
    metrics: dict[str, float] = {}
    for c in result.continuation:
        metrics[f"long_ppl_at_{c.context_len}"] = c.ppl
        if c.base_ppl is not None:
            metrics[f"long_base_ppl_at_{c.context_len}"] = c.base_ppl
    cells: dict[tuple[str, int], list] = {}
    for r in result.retrieval:
        cells.setdefault((r.task, r.length), []).append(r)
    for (task_name, length), scores in cells.items():
        samples = sum(r.samples for r in scores)
        metrics[f"long_{task_name}_accuracy_at_{length}"] = sum(r.correct for r in scores) / samples
        if all(r.base_correct is not None for r in scores):
            base = sum(r.base_correct for r in scores) / samples
            metrics[f"long_base_{task_name}_accuracy_at_{length}"] = base
    return metrics


def long_context_table(long: dict) -> dict[str, list]:
    """The long-context suite's rows (:meth:`LongContextResult.table`) as an MLflow table's columns."""
    rows = LongContextResult.from_dict(long).table()
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return {k: [row.get(k) for row in rows] for k in columns}


def long_context_outputs(long: dict, directory: str | Path) -> tuple[dict, dict, dict]:
    """The long-context suite's MLflow metrics, tables and figures (drawn into ``directory``)."""
    figure = plot_long_context(LongContextResult.from_dict(long), Path(directory) / "long_context.png")
    tables = {"long_context.json": long_context_table(long)}
    return long_context_metrics(long), tables, {"long_context.png": str(figure)}


def lora_results(lora: ArtifactRef) -> tuple[dict[str, float], dict[str, list[tuple[int, float]]]]:
    """The LoRA run's summary metrics and its metric histories (loss and learning rate per step, held-out
    loss per evaluation) from the recovered model's reference and its stored history."""
    meta = lora.meta
    metrics = {"lora_steps": meta["steps"], "lora_train_seconds": meta["seconds"]}
    for key in ("final_loss", "eval_loss_before", "eval_loss_after"):
        if meta.get(key) is not None:
            metrics[f"lora_{key}"] = meta[key]
    history = json.loads(local_path(meta["history"]).read_text())
    histories = {
        "lora_train_loss": [(h["step"], h["loss"]) for h in history["history"]],
        "lora_lr": [(h["step"], h["lr"]) for h in history["history"]],
        "lora_eval_loss": [(e["step"], e["eval_loss"]) for e in history["evals"]],
    }
    return metrics, histories


def quality(
    base_eval: EvalResult | None,
    eval_: EvalResult | None,
    overlap: str | None = None,
    before_lora: EvalResult | None = None,
) -> dict | None:
    """What the registry's quality gate compares: prefill perplexities, a fingerprint of their protocol,
    KL(original ‖ compressed) on those windows where measured (and before LoRA recovery, with it) and,
    when the evaluation data overlaps the calibration data, the line saying so (the gate then refuses)."""
    if not base_eval or not eval_:
        return None
    out = {
        "ppl": eval_.prefill_ppl,
        "base_ppl": base_eval.prefill_ppl,
        "protocol": hash_json(eval_.prefill["protocol"])[:16],
    }
    if eval_.kl is not None:
        out["kl"] = eval_.kl_to_base
        if before_lora is not None and before_lora.kl is not None:
            out["before_lora_kl"] = before_lora.kl_to_base
    return out | ({"calibration_overlap": overlap} if overlap else {})


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
    lora: ArtifactRef | None = None,
    before_lora: dict | None = None,
) -> dict:
    """Log params, metrics, tables, figures, artifacts and the compressed model (an MLflow model) into the
    flow's MLflow run, then close it FINISHED (with LoRA recovery: its loss curves as metric history)."""
    params = {f"recipe.{k}": v for k, v in flatten(recipe).items()}
    params.update({f"version.{k}": v for k, v in versions().items()})
    params.update(
        {
            "fingerprint.model": model.sha256,
            "fingerprint.calibration": calib.sha256,
            "fingerprint.compressed": built.sha256,
        }
    )
    evals = {"base": base_eval, "compressed": eval_, "before_lora": before_lora}
    base_eval, eval_, before_lora = (eval_result(e) for e in evals.values())
    metrics = conversion_metrics(plan, base_eval, eval_, before_lora)
    comp = recipe["compression"]
    figures = {"rank_plan_heatmap.png": str(local_path(plan.meta["heatmap"]))}
    files = {}
    if lora is not None:
        lora_metrics, histories = lora_results(lora)
        metrics |= lora_metrics
        log_metric_history(run, histories)
        figures["lora_loss_curve.png"] = str(local_path(lora.meta["loss_curve"]))
        files["lora_history.json"] = str(local_path(lora.meta["history"]))
        params["fingerprint.before_lora"] = lora.meta["source"]
    tables = {"eval_table.json": eval_table(base_eval, eval_, before_lora)} if eval_ else {}
    long = eval_.long if eval_ else None
    with tempfile.TemporaryDirectory(prefix="lrkv-figures-") as scratch:
        if long is not None:
            long_metrics, long_tables, long_figures = long_context_outputs(long, scratch)
            metrics, tables, figures = metrics | long_metrics, tables | long_tables, figures | long_figures
        log_results(
            run,
            params=params,
            metrics=metrics,
            json_artifacts={
                "eval.json": {k: v for k, v in evals.items() if v is not None},
                "rank_plan.json": json.loads(local_path(plan.uri).read_text()),
                "recipe.json": recipe,
            },
            tables=tables,
            figures=figures,
            file_artifacts=files,
            tags={
                "lrkv.method": comp["name"],
                "lrkv.model": model.meta["ref"],
                "lrkv.decomposition": method_label(comp["decomposition"]),
                "lrkv.allocator": method_label(comp["allocator"]),
                "lrkv.lora": "true" if lora is not None else "false",
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
    overlap: str | None = None,
    before_lora: dict | None = None,
) -> dict:
    """Register the logged model as ``lrkv-<model>`` with alias ``candidate`` (and ``champion`` if the
    quality gate passes; never when ``overlap`` says the evaluation data overlaps the calibration data);
    nothing is left half-registered on failure. ``before_lora``: the evaluation before LoRA recovery."""
    name = registry["name"] or model_name(model_ref)
    return register_version(
        logged,
        logged["model"],
        built.sha256,
        name,
        quality(eval_result(base_eval), eval_result(eval_), overlap, eval_result(before_lora)),
        registry["max_ppl_rise"],
        registry.get("max_kl"),
    )
