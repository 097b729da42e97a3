"""Real services for tests, started on loopback: an ``mlflow server`` process, an S3 server (moto)."""

from __future__ import annotations

import os
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


def start_mlflow_server(
    root: Path, timeout: float = 90.0, artifacts: str | None = None, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """``mlflow server`` on 127.0.0.1 with a SQLite backend and proxied artifacts (a local directory, or
    ``artifacts`` such as ``s3://bucket/prefix`` with ``env`` naming the S3 endpoint and credentials)."""
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
            artifacts or (root / "artifacts").as_uri(),
        ],
        env={**os.environ, **(env or {})},
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


S3_ENV = {  # what a client of the loopback S3 server needs (moto accepts any credentials)
    "AWS_ACCESS_KEY_ID": "lrkv-test",
    "AWS_SECRET_ACCESS_KEY": "lrkv-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def s3_env(endpoint: str) -> dict[str, str]:
    """Environment for boto3 (the store), MLflow's S3 artifact repository and subprocesses alike."""
    return S3_ENV | {"AWS_ENDPOINT_URL_S3": endpoint, "MLFLOW_S3_ENDPOINT_URL": endpoint}


def start_s3_server(bucket: str = "lrkv"):
    """moto's S3 HTTP server on 127.0.0.1 (a thread of this process) with ``bucket`` created.

    Returns ``(server, endpoint)``; ``server.stop()`` ends it.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=S3_ENV["AWS_DEFAULT_REGION"],
    )
    client.create_bucket(Bucket=bucket)
    return server, endpoint
