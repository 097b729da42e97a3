"""infra/docker-compose.yml read statically (no Docker on test machines): healthchecks, MinIO's buckets,
and every setting it reads defined in infra/.env.example."""

import re
from collections.abc import Iterator
from pathlib import Path

import yaml

INFRA = Path(__file__).resolve().parents[1] / "infra"
# ${VAR}, ${VAR:-default}, ${VAR?err}: compose interpolates these; $${VAR} is left to the container's shell
VARIABLE = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:[:?+-][^}]*)?\}")


def _compose() -> dict:
    return yaml.safe_load((INFRA / "docker-compose.yml").read_text())


def _strings(node) -> Iterator[str]:
    """Every key and value of the parsed file that is a string (comments are not settings)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)
    elif isinstance(node, str):
        yield node


def _conditions(service: dict) -> dict[str, str]:
    """``depends_on`` as service -> condition (the short list form means service_started)."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def test_every_service_that_keeps_running_has_a_healthcheck():
    """Each service has a healthcheck except one-shot jobs, which others wait for by their completion."""
    services = _compose()["services"]
    waits = [(dep, cond) for s in services.values() for dep, cond in _conditions(s).items()]
    assert all(dep in services for dep, _ in waits), waits
    one_shot = {dep for dep, cond in waits if cond == "service_completed_successfully"}
    assert one_shot == {"minio-buckets", "prefect-db"}
    assert [name for name, s in services.items() if name not in one_shot and "healthcheck" not in s] == []
    assert all("healthcheck" in services[dep] for dep, cond in waits if cond == "service_healthy")
    for name, service in services.items():
        if "healthcheck" in service:
            check = service["healthcheck"]
            assert check["test"][0] in ("CMD", "CMD-SHELL") and check.get("retries", 0) > 0, name


def test_minio_buckets_are_created_before_mlflow_and_the_worker_use_them():
    """minio-buckets makes ${LRKV_BUCKET} and ${MLFLOW_BUCKET} once MinIO is healthy; MLflow waits for it."""
    services = _compose()["services"]
    job = services["minio-buckets"]
    assert _conditions(job) == {"minio": "service_healthy"}
    mb = re.search(r"mc mb (?:--ignore-existing )?([^&\"]+)", job["entrypoint"])
    assert mb is not None and set(mb[1].split()) == {"lrkv/${LRKV_BUCKET}", "lrkv/${MLFLOW_BUCKET}"}
    assert "mc alias set lrkv http://minio:9000" in job["entrypoint"]
    assert _conditions(services["mlflow"])["minio-buckets"] == "service_completed_successfully"
    assert "--artifacts-destination s3://${MLFLOW_BUCKET}/" in services["mlflow"]["command"]
    assert _conditions(services["worker"]) == {
        "prefect-server": "service_healthy",
        "mlflow": "service_healthy",
        "dask-scheduler": "service_healthy",
    }


def test_the_worker_sends_tasks_to_the_dask_scheduler_whose_workers_share_its_settings_and_store():
    """The worker's flow runs read LRKV_DASK; the Dask workers get the worker's settings and its store."""
    services = _compose()["services"]
    worker, scheduler, dask = services["worker"], services["dask-scheduler"], services["dask-worker"]
    port = re.search(r"--port (\d+)", scheduler["command"])[1]
    assert worker["environment"]["LRKV_DASK"] == f"tcp://dask-scheduler:{port}"
    assert dask["command"].startswith(f"dask worker tcp://dask-scheduler:{port} ")
    assert _conditions(dask) == {"dask-scheduler": "service_healthy"}
    shared = {k: v for k, v in worker["environment"].items() if k not in ("LRKV_DASK", "LRKV_WORK_POOL")}
    assert shared and dask["environment"] == shared  # S3 endpoint, credentials, APIs, LRKV_HOME
    assert dask["volumes"] == worker["volumes"] and dask["build"] == worker["build"] == scheduler["build"]


def test_every_variable_the_compose_file_reads_is_in_env_example():
    """The ${VAR}s in the file's settings and the names .env.example defines are the same set."""
    used = {m for s in _strings(_compose()) for m in VARIABLE.findall(s)}
    lines = (INFRA / ".env.example").read_text().splitlines()
    defined = {line.split("=", 1)[0] for line in lines if line.strip() and not line.startswith("#")}
    assert used - defined == set(), "used but not in .env.example"
    assert defined - used == set(), "in .env.example but never used"
