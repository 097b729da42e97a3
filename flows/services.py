"""``lrkv up`` / ``lrkv down``: a local Prefect server, a process worker and an MLflow server.

The three run detached (their own sessions; logs in ``$LRKV_HOME/logs``) until ``lrkv down``, and
``$LRKV_HOME/services.json`` records their URLs and process ids: the CLI then uses this Prefect server
instead of starting its own (:func:`lrkv_flows.apiserver.connect`), so a warm re-run does not pay a
server's start-up, and the UI (``http://127.0.0.1:4200``) shows every run and its logs. Settings, by
environment variable: ``LRKV_PREFECT_PORT`` (4200), ``LRKV_MLFLOW_PORT`` (5000), ``LRKV_WORK_POOL``
(lrkv), ``LRKV_MLFLOW_BACKEND`` (default SQLite in ``$LRKV_HOME``; e.g. a Postgres URI),
``LRKV_MLFLOW_ARTIFACTS`` (default ``$LRKV_HOME/mlartifacts``; e.g. ``s3://bucket/mlflow`` with
``MLFLOW_S3_ENDPOINT_URL`` and AWS credentials).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from lrkv_core.system.paths import lrkv_home, setup_lock, writable_home
from lrkv_tasks.tracking.mlflow_runs import prepare_database as prepare_mlflow_database

from .apiserver import SERVICES, database_url, healthy, prepare_database
from .deploy import work_pool


def _port(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _start(name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    logs = lrkv_home() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "a") as log:
        return subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )


def _wait(url: str, proc: subprocess.Popen, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); see {lrkv_home() / 'logs'}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{what} did not answer at {url} within {timeout:.0f}s")


def up() -> dict:
    """Start the services unless ``lrkv up`` already did; returns what ``services.json`` holds."""
    path = lrkv_home() / SERVICES
    if path.is_file():
        services = json.loads(path.read_text())
        if healthy(services["prefect_api"]):
            return services
    home = writable_home()
    prefect_port, mlflow_port = _port("LRKV_PREFECT_PORT", 4200), _port("LRKV_MLFLOW_PORT", 5000)
    api = f"http://127.0.0.1:{prefect_port}/api"
    env = {**os.environ, "PREFECT_API_URL": api}
    env.setdefault("PREFECT_API_DATABASE_CONNECTION_URL", database_url())
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    backend = os.environ.get("LRKV_MLFLOW_BACKEND", f"sqlite:///{home / 'mlflow-server.db'}")
    logs = home / "logs"
    logs.mkdir(exist_ok=True)
    with setup_lock(home):  # the databases are created whole, once, before the servers open them
        prepare_database(env["PREFECT_API_DATABASE_CONNECTION_URL"], logs / "prefect-server.log")
    prepare_mlflow_database(backend)  # under its directory's set-up lock
    procs = {
        "prefect": _start(
            "prefect-server",
            [
                sys.executable,
                "-m",
                "prefect",
                "server",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(prefect_port),
            ],
            env,
        )
    }
    mlflow_uri = f"http://127.0.0.1:{mlflow_port}"
    artifacts = os.environ.get("LRKV_MLFLOW_ARTIFACTS", (home / "mlartifacts").resolve().as_uri())
    mlflow_args = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(mlflow_port),
    ]
    mlflow_args += ["--workers", "1", "--backend-store-uri", backend, "--artifacts-destination", artifacts]
    procs["mlflow"] = _start("mlflow-server", mlflow_args, env)
    try:
        _wait(f"{api}/health", procs["prefect"], "the Prefect server")
        _wait(f"{mlflow_uri}/health", procs["mlflow"], "the MLflow server")
        worker_env = env | {"MLFLOW_TRACKING_URI": env.get("MLFLOW_TRACKING_URI", mlflow_uri)}
        worker = [
            sys.executable,
            "-m",
            "prefect",
            "worker",
            "start",
            "--pool",
            work_pool(),
            "--type",
            "process",
        ]
        procs["worker"] = _start("prefect-worker", worker, worker_env)
    except BaseException:
        for proc in procs.values():
            proc.terminate()
        raise
    services = {
        "prefect_api": api,
        "prefect_ui": f"http://127.0.0.1:{prefect_port}",
        "mlflow": mlflow_uri,
        "work_pool": work_pool(),
        "pids": {name: proc.pid for name, proc in procs.items()},
    }
    path.write_text(json.dumps(services, indent=2))
    return services


def _group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def down(grace: float = 20.0) -> list[str]:
    """Stop what ``lrkv up`` started (each whole process session); returns the names stopped.

    The worker goes first (stopped after the server, it retries the dead API on its way out), then the
    servers; a session still alive ``grace`` seconds after SIGTERM is killed.
    """
    path = lrkv_home() / SERVICES
    if not path.is_file():
        return []
    services = json.loads(path.read_text())
    stopped = []
    for name, pid in reversed(services["pids"].items()):  # the reverse of the start order
        try:
            os.killpg(pid, signal.SIGTERM)  # each service leads its own session: this reaches its children
        except ProcessLookupError:
            continue
        stopped.append(name)
        deadline = time.monotonic() + grace
        while _group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    path.unlink()
    return stopped
