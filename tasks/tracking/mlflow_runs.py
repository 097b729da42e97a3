"""MLflow runs: opened when a flow starts, filled with batch calls, closed FINISHED, FAILED or KILLED.

The tracking URI is the recipe's, else ``$MLFLOW_TRACKING_URI``, else local SQLite under ``$LRKV_HOME``
(artifacts in ``$LRKV_HOME/mlartifacts``); the registry is ``$MLFLOW_REGISTRY_URI``, else the tracking URI,
and every client lrkv makes (:func:`client`) names both, never leaving MLflow to its own default (a
``./mlflow.db`` in the current directory). A local SQLite database is created whole or not at all
(:func:`prepare_database`): MLflow's schema is built in a temporary file beside it, under the directory's
set-up lock, and renamed into place, so an interrupted first run or two first runs at once leave no
half-migrated database. A flow opens its run first (:func:`open_run`, status RUNNING,
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
from urllib.parse import unquote

from lrkv_core.system.paths import lrkv_home, setup_lock, writable_home

from ..keys import code_version

OPEN_RUNS: dict[str, str] = {}  # run id -> tracking URI, for runs this process opened and has not closed
_OPEN_LOCK = threading.Lock()
OWNER_TAG = "lrkv.owner"  # host:pid of the process that opened the run


_READY: set[str] = set()  # SQLite URIs whose database this process has seen complete


def default_tracking_uri() -> str:
    db = lrkv_home() / "mlflow.db"
    if not db.is_file():  # to be created: the home must be writable (one clear error if not)
        db = writable_home() / "mlflow.db"
    return f"sqlite:///{db}"


def tracking_uri(explicit: str | None = None) -> str:
    """The recipe's URI, else ``$MLFLOW_TRACKING_URI``, else local SQLite under ``$LRKV_HOME``."""
    return explicit or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def registry_uri(tracking: str | None = None) -> str:
    """Where registered model names resolve: ``$MLFLOW_REGISTRY_URI``, else :func:`tracking_uri`."""
    return os.environ.get("MLFLOW_REGISTRY_URI") or tracking_uri(tracking)


def client(uri: str | None = None):
    """An ``MlflowClient`` on the tracking URI (:func:`tracking_uri`) and registry (:func:`registry_uri`)."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(uri)
    registry = registry_uri(uri)
    for store in {uri, registry}:
        prepare_database(store)
    return MlflowClient(tracking_uri=uri, registry_uri=registry)


def _sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///PATH`` URI; None for other stores and in-memory SQLite."""
    if not uri.startswith("sqlite:///"):
        return None
    path = unquote(uri[len("sqlite:///") :].split("?", 1)[0])
    return Path(path) if path and path != ":memory:" else None


def prepare_database(uri: str) -> None:
    """Create the SQLite database ``uri`` names, with MLflow's whole schema, unless it exists (else no-op).

    Under the set-up lock of the database's directory: files a killed set-up left are removed, the schema
    is built in a temporary file there and renamed onto the database's name only when complete.
    """
    path = _sqlite_file(uri)
    if path is None or uri in _READY:
        return
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with setup_lock(path.parent):
            for stale in path.parent.glob(f".{path.name}.*.tmp*"):  # a set-up that was killed midway
                stale.unlink(missing_ok=True)
            if not path.is_file():
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                try:
                    _create_schema(tmp)
                    os.replace(tmp, path)
                finally:
                    tmp.unlink(missing_ok=True)
    _READY.add(uri)


def _create_schema(path: Path) -> None:
    """MLflow's tracking and registry schema at its newest revision in a new SQLite file."""
    from mlflow.store.db import utils

    engine = utils.create_sqlalchemy_engine(f"sqlite:///{path}")
    try:
        utils._initialize_tables(engine)  # what MLflow's store runs on an empty database
        utils._verify_schema(engine)
    finally:
        engine.dispose()


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


def log_metric_history(run: dict, histories: dict[str, list[tuple[int, float]]]) -> int:
    """Log each metric's values at their steps (``name -> [(step, value), ...]``) as MLflow metric history, in
    ``log_batch`` calls of at most 1000 metrics (MLflow's limit); returns how many values were logged."""
    from mlflow.entities import Metric
    from mlflow.utils.time import get_current_time_millis

    mlflow, rid = client(run["tracking_uri"]), run["run_id"]
    now = get_current_time_millis()
    metrics = [Metric(k, float(v), now, int(s)) for k, values in histories.items() for s, v in values]
    for i in range(0, len(metrics), 1000):
        mlflow.log_batch(rid, metrics=metrics[i : i + 1000])
    return len(metrics)


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
    tables: dict[str, dict[str, list]] | None = None,
    figures: dict[str, str] | None = None,
) -> dict:
    """One complete MLflow run (open, log, close FINISHED; FAILED if logging fails); returns its ids."""
    run = open_run(tracking_uri, experiment, run_name, tags)
    try:
        log_results(
            run,
            params=params,
            metrics=metrics,
            json_artifacts=json_artifacts,
            file_artifacts=file_artifacts,
            tables=tables,
            figures=figures,
        )
    except BaseException:
        close_run(run, "FAILED")
        raise
    close_run(run, "FINISHED")
    return run
