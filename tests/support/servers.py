"""Real services for tests, started on loopback: an ``mlflow server`` process."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow_server(root: Path, timeout: float = 90.0) -> tuple[subprocess.Popen, str]:
    """``mlflow server`` on 127.0.0.1 with a SQLite backend and proxied local artifacts."""
    port = free_port()
    log = open(root / "mlflow-server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            (root / "artifacts").as_uri(),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited: {(root / 'mlflow-server.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, uri
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"mlflow server did not answer in {timeout}s")
