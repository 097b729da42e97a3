"""MLflow runs: opened when a flow starts, filled with batch calls, closed FINISHED, FAILED or KILLED.

The tracking URI is the recipe's, else ``$MLFLOW_TRACKING_URI``, else local SQLite under ``$LRKV_HOME``
(artifacts in ``$LRKV_HOME/mlartifacts``). A flow opens its run first (:func:`open_run`, status RUNNING,
tagged with the owning host and process), so an interrupted conversion leaves a run marked KILLED or FAILED
rather than none; a process killed outright (SIGKILL) cannot mark its run, so the next flow on the same host
marks runs whose owner is gone as KILLED (:func:`reap_orphaned_runs`). Runs this process has open are listed
in :data:`OPEN_RUNS`, which the CLI's interrupt handler closes as KILLED (:func:`close_open_runs`).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import tempfile
import threading
from pathlib import Path

from lrkv_core.paths import lrkv_home

from .keys import code_version

OPEN_RUNS: dict[str, str] = {}  # run id -> tracking URI, for runs this process opened and has not closed
_OPEN_LOCK = threading.Lock()
OWNER_TAG = "lrkv.owner"  # host:pid of the process that opened the run


def default_tracking_uri() -> str:
    home = lrkv_home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'mlflow.db'}"


def tracking_uri(explicit: str | None = None) -> str:
    """The recipe's URI, else ``$MLFLOW_TRACKING_URI``, else local SQLite under ``$LRKV_HOME``."""
    return explicit or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def client(uri: str | None = None):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(uri))


def experiment_id(mlflow, name: str, uri: str) -> str:
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if uri.startswith("sqlite:"):
        # with a SQLite backend MLflow would default to ./mlruns in the current directory
        artifact_location = (lrkv_home() / "mlartifacts").resolve().as_uri()
    return mlflow.create_experiment(name, artifact_location=artifact_location)


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


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def open_run(uri: str | None, experiment: str, run_name: str, tags: dict[str, str]) -> dict:
    """Create a RUNNING run owned by this process; returns ``{run_id, experiment_id, tracking_uri}``."""
    uri = tracking_uri(uri)
    mlflow = client(uri)
    exp_id = experiment_id(mlflow, experiment, uri)
    reap_orphaned_runs(mlflow, exp_id)
    run = mlflow.create_run(exp_id, run_name=run_name, tags=tags | {OWNER_TAG: _owner()})
    with _OPEN_LOCK:
        OPEN_RUNS[run.info.run_id] = uri
    return {"run_id": run.info.run_id, "experiment_id": exp_id, "tracking_uri": uri}


def close_run(run: dict, status: str) -> None:
    """Set the run's final status (FINISHED, FAILED or KILLED) and forget it."""
    client(run["tracking_uri"]).set_terminated(run["run_id"], status)
    with _OPEN_LOCK:
        OPEN_RUNS.pop(run["run_id"], None)


def discard_run(run: dict) -> None:
    """Delete a run that recorded nothing (a re-run whose results all came from the cache)."""
    client(run["tracking_uri"]).delete_run(run["run_id"])
    with _OPEN_LOCK:
        OPEN_RUNS.pop(run["run_id"], None)


def close_open_runs(status: str = "KILLED") -> list[str]:
    """Close every run this process still has open with ``status`` (the CLI's interrupt handler)."""
    with _OPEN_LOCK:
        runs = dict(OPEN_RUNS)
        OPEN_RUNS.clear()
    for run_id, uri in runs.items():
        client(uri).set_terminated(run_id, status)
    return list(runs)


def reap_orphaned_runs(mlflow, exp_id: str) -> list[str]:
    """Mark RUNNING runs opened on this host by a process that no longer exists as KILLED."""
    host = socket.gethostname()
    reaped = []
    for run in mlflow.search_runs([exp_id], filter_string="attributes.status = 'RUNNING'", max_results=200):
        owner = run.data.tags.get(OWNER_TAG, "")
        owner_host, _, pid = owner.rpartition(":")
        if owner_host == host and pid.isdigit() and not _alive(int(pid)):
            mlflow.set_terminated(run.info.run_id, "KILLED")
            reaped.append(run.info.run_id)
    return reaped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def log_results(
    run: dict,
    *,
    params: dict,
    metrics: dict[str, float],
    json_artifacts: dict[str, dict] | None = None,
    file_artifacts: dict[str, str] | None = None,
    tables: dict[str, dict[str, list]] | None = None,
    figures: dict[str, str] | None = None,
    tags: dict[str, str] | None = None,
) -> None:
    """Params, metrics and tags in batch calls; JSON and file artifacts; tables (``log_table``) and PNG
    figures (``log_image``, which the MLflow UI shows as images)."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.utils.time import get_current_time_millis

    mlflow, rid = client(run["tracking_uri"]), run["run_id"]
    now = get_current_time_millis()
    params_ = [Param(k, str(v)[:6000]) for k, v in params.items()]
    metrics_ = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
    tags_ = [RunTag(k, v) for k, v in (tags or {}).items()]
    for i in range(0, max(len(params_), len(metrics_), 1), 100):  # MLflow's batch limit is 100 params
        mlflow.log_batch(
            rid, metrics=metrics_[i : i + 100], params=params_[i : i + 100], tags=tags_ if not i else ()
        )
    for name, data in (tables or {}).items():
        mlflow.log_table(rid, data=data, artifact_file=name)
    for name, path in (figures or {}).items():
        from PIL import Image

        with Image.open(path) as image:
            mlflow.log_image(rid, image.convert("RGB"), artifact_file=name)
    with tempfile.TemporaryDirectory() as tmp:
        for name, obj in (json_artifacts or {}).items():
            path = Path(tmp) / name
            path.write_text(json.dumps(obj, indent=2, default=str))
            mlflow.log_artifact(rid, str(path))
        for name, src in (file_artifacts or {}).items():  # logged under a readable name, not the store's hash
            path = Path(tmp) / name
            shutil.copyfile(src, path)
            mlflow.log_artifact(rid, str(path))


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
    """One complete MLflow run (open, log, close FINISHED; FAILED if logging fails); returns its ids."""
    run = open_run(tracking_uri, experiment, run_name, tags)
    try:
        log_results(
            run, params=params, metrics=metrics, json_artifacts=json_artifacts, file_artifacts=file_artifacts
        )
    except BaseException:
        close_run(run, "FAILED")
        raise
    close_run(run, "FINISHED")
    return run
