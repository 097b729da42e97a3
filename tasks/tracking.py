"""MLflow logging (embedded default: local SQLite + a local artifact directory under LRKV_HOME)."""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
from pathlib import Path

from lrkv_core.paths import lrkv_home


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

    from .convert import code_version

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
