"""MLflow logging (embedded default: local SQLite + a local artifact directory under LRKV_HOME)."""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
from pathlib import Path

from prefect import task

from lrkv_core.paths import lrkv_home

from .convert import CACHED, TASK_KEY
from .keys import code_version
from .recipe import flatten, method_label
from .refs import ArtifactRef
from .store import local_path


def default_tracking_uri() -> str:
    home = lrkv_home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'mlflow.db'}"


def _experiment_id(client, name: str, tracking_uri: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if tracking_uri.startswith("sqlite:"):
        # with a SQLite backend MLflow would default to ./mlruns in the current directory
        artifact_location = (lrkv_home() / "mlartifacts").resolve().as_uri()
    return client.create_experiment(name, artifact_location=artifact_location)


def versions() -> dict[str, str]:
    import mlflow
    import prefect
    import torch
    import transformers

    return {
        "lrkv": code_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "prefect": prefect.__version__,
        "mlflow": mlflow.__version__,
        "python": platform.python_version(),
    }


def log_conversion(
    *,
    tracking_uri: str | None,
    experiment: str,
    run_name: str,
    params: dict,
    metrics: dict[str, float],
    json_artifacts: dict[str, dict],
    file_artifacts: dict[str, str],
    tags: dict[str, str],
) -> dict:
    """One MLflow run with params, metrics and artifacts; returns its ids."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri or default_tracking_uri()
    client = MlflowClient(tracking_uri=uri)
    exp_id = _experiment_id(client, experiment, uri)
    run = client.create_run(exp_id, run_name=run_name, tags=tags)
    rid = run.info.run_id
    try:
        for k, v in params.items():
            client.log_param(rid, k, str(v)[:6000])
        for k, v in metrics.items():
            client.log_metric(rid, k, float(v))
        with tempfile.TemporaryDirectory() as tmp:
            for name, obj in json_artifacts.items():
                path = Path(tmp) / name
                path.write_text(json.dumps(obj, indent=2, default=str))
                client.log_artifact(rid, str(path))
            for name, src in file_artifacts.items():  # logged under a readable name, not the store's hash
                path = Path(tmp) / name
                shutil.copyfile(src, path)
                client.log_artifact(rid, str(path))
        client.set_terminated(rid, "FINISHED")
    except BaseException:
        client.set_terminated(rid, "FAILED")
        raise
    return {"run_id": rid, "experiment_id": exp_id, "tracking_uri": uri}


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


@task(name="log_run", cache_key_fn=TASK_KEY, **CACHED)
def log_run(
    recipe: dict,
    model: ArtifactRef,
    calib: ArtifactRef,
    plan: ArtifactRef,
    built: ArtifactRef,
    base_eval: dict | None,
    eval_: dict | None,
    store: str | None = None,
) -> dict:
    """Log params, metrics and artifacts of the conversion to MLflow."""
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
    tracking = recipe["tracking"]
    return log_conversion(
        tracking_uri=tracking["mlflow_uri"],
        experiment=tracking["experiment"],
        run_name=f"convert-{Path(model.meta['ref']).name}-r{comp['ratio']}-g{comp['group_size']}",
        params=params,
        metrics=metrics,
        json_artifacts={
            "eval.json": {k: v for k, v in evals.items() if v is not None},
            "rank_plan.json": json.loads(local_path(plan.uri).read_text()),
            "recipe.json": recipe,
        },
        file_artifacts={"rank_plan_heatmap.png": str(local_path(plan.meta["heatmap"]))},
        tags={
            "lrkv.method": comp["name"],
            "lrkv.model": model.meta["ref"],
            "lrkv.decomposition": method_label(comp["decomposition"]),
            "lrkv.allocator": method_label(comp["allocator"]),
        },
    ) | {"metrics": metrics}
