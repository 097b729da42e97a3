"""Reading conversions back from MLflow: list, show one (metrics, params, artifact tree), compare two."""

from __future__ import annotations

from typing import Any

from .mlflow_runs import client

SUMMARY_METRICS = {  # metric -> the column ``lrkv runs list`` shows it under
    "achieved_ratio": "width ratio",
    "base_prefill_ppl": "original PPL",
    "compressed_prefill_ppl": "PPL",
    "kv_bytes_ratio": "KV bytes ratio",
}


def list_runs(uri: str | None, experiment: str, limit: int = 20) -> list[dict[str, Any]]:
    """The newest runs of ``experiment``: id, name, status, model, start time and the summary metrics."""
    mc = client(uri)
    exp = mc.get_experiment_by_name(experiment)
    if exp is None:
        raise ValueError(f"no MLflow experiment {experiment!r} at {mc.tracking_uri}")
    runs = mc.search_runs([exp.experiment_id], max_results=limit, order_by=["attributes.start_time DESC"])
    return [
        {
            "run_id": r.info.run_id,
            "name": r.info.run_name,
            "status": r.info.status,
            "model": r.data.tags.get("lrkv.model", ""),
            "start_time": r.info.start_time,
            **{k: r.data.metrics.get(k) for k in SUMMARY_METRICS},
        }
        for r in runs
    ]


def _artifact_tree(mc, run_id: str, path: str | None = None) -> list[dict[str, Any]]:
    out = []
    for item in mc.list_artifacts(run_id, path):
        node = {"path": item.path, "size": item.file_size}
        if item.is_dir:
            node["children"] = _artifact_tree(mc, run_id, item.path)
        out.append(node)
    return out


def show_run(uri: str | None, run_id: str) -> dict[str, Any]:
    """One run: its info, params, metrics, tags (lrkv's) and the tree of its artifacts."""
    from mlflow.exceptions import MlflowException

    mc = client(uri)
    try:
        run = mc.get_run(run_id)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise ValueError(f"no MLflow run {run_id!r} at {mc.tracking_uri}") from None
        raise
    return {
        "run_id": run.info.run_id,
        "name": run.info.run_name,
        "status": run.info.status,
        "experiment_id": run.info.experiment_id,
        "params": dict(sorted(run.data.params.items())),
        "metrics": dict(sorted(run.data.metrics.items())),
        "tags": {k: v for k, v in sorted(run.data.tags.items()) if k.startswith("lrkv.")},
        "artifacts": _artifact_tree(mc, run.info.run_id),
    }


def compare_runs(uri: str | None, a: str, b: str) -> dict[str, Any]:
    """Metrics of two runs side by side (with b − a) and the params whose values differ."""
    ra, rb = show_run(uri, a), show_run(uri, b)
    metrics = []
    for key in sorted(set(ra["metrics"]) | set(rb["metrics"])):
        va, vb = ra["metrics"].get(key), rb["metrics"].get(key)
        metrics.append(
            {"metric": key, "a": va, "b": vb, "diff": vb - va if va is not None and vb is not None else None}
        )
    params = [
        {"param": key, "a": ra["params"].get(key), "b": rb["params"].get(key)}
        for key in sorted(set(ra["params"]) | set(rb["params"]))
        if ra["params"].get(key) != rb["params"].get(key) and not key.startswith("version.")
    ]
    return {"a": ra["run_id"], "b": rb["run_id"], "metrics": metrics, "params": params}
