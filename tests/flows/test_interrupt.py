"""Killing ``lrkv convert`` midway, as a user does (a terminal's Ctrl-C, a SIGKILL), then resuming it.

Real processes: the CLI in its own process group, with the Prefect API server it owns and MLflow on SQLite;
the store a local directory or an S3 bucket (moto's server on loopback). The model has many thin layers so
that the per-layer decomposition takes long enough to be interrupted, and enough evaluation data that
evaluation does too. A re-run must recompute none of the layer tasks that had finished (counted from the
CLI's task table), and no process may outlive a killed CLI.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import psutil
import pytest
from mlflow.tracking import MlflowClient

from tests.support.models import tiny_model_dir, token_parquet

LAYERS = 48  # thin layers: decomposing them all takes a few seconds of task overhead, time to be interrupted
S3_LAYERS = 16  # decomposed one at a time in the first run (see the S3 test), so fewer layers suffice
ROW = re.compile(
    r"│\s*(decompose_layer\[\d+\]|summarize_layer\[\d+\]|build_model|evaluate\[\w+\])\s*│\s*(\w+)\s*│"
)


def _setup(tmp_path: Path, layers: int, evaluate: bool, store: str | None = None) -> tuple[list[str], dict]:
    """The CLI command: ``layers`` layers; with ``evaluate``, 96 windows decoded token by token (seconds);
    the store ``tmp_path / "store"`` unless given."""
    model = tiny_model_dir(tmp_path, num_hidden_layers=layers)
    data = token_parquet(tmp_path / "data.parquet", rows=96, seq_len=64)
    args = [
        sys.executable,
        "-m",
        "lrkv_flows.cli",
        "convert",
        "--model",
        str(model),
        "--dataset",
        f"parquet:{data}",
    ]
    args += ["--ratio", "0.5", "--group-size", "2", "--n-samples", "8", "--seq-len", "64"]
    args += ["--store", store or str(tmp_path / "store"), "--set", "registry.enabled=false"]
    if evaluate:
        args += ["--eval-dataset", f"parquet:{data}", "--set", "eval.max_windows=96"]
        args += ["--set", "eval.decode_windows=96", "--set", "eval.decode_prefix=4"]
    else:
        args += ["--eval-dataset", "none"]
    env = {**os.environ, "LRKV_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    for name in ("PREFECT_API_URL", "PREFECT_LOCAL_STORAGE_PATH", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    return args, env


def _start(args, env, log: Path, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        args, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
    )


def _wait_for(predicate, proc, timeout=300.0, every=0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the CLI exited early ({proc.returncode})"
        assert time.monotonic() < deadline, "timed out waiting for the run to get there"
        time.sleep(every)


def _count(folder: Path) -> int:
    return len(list(folder.iterdir())) if folder.is_dir() else 0


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _gone(procs: list[psutil.Process], timeout: float = 10.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def _records(store: Path | str) -> list[bytes]:
    """The task result records in a store: a local directory, or ``s3://bucket/prefix`` (read with boto3)."""
    if isinstance(store, str) and store.startswith("s3://"):
        bucket, _, prefix = store.removeprefix("s3://").partition("/")
        client = boto3.client("s3")  # the loopback server, from the environment the s3 fixture set
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=f"{prefix}/prefect-results/"
        )
        keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
        return [client.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys]
    out = []
    records = Path(store) / "prefect-results"
    for record in records.iterdir() if records.is_dir() else ():
        try:
            out.append(record.read_bytes())
        except OSError:  # a temporary file renamed away meanwhile
            continue
    return out


def _recorded(store: Path | str, kind: str) -> int:
    """Task results holding an artifact of ``kind`` that were recorded (a task cut off has no complete
    record): ``factors`` for finished layer decompositions, ``model`` for a finished build."""
    done = 0
    for raw in _records(store):
        try:
            done += f'"kind": "{kind}"' in json.loads(raw)["result"]
        except (ValueError, KeyError, TypeError):
            continue
    return done


def _states(log: Path) -> dict[str, str]:
    return {m[1]: m[2] for m in ROW.finditer(log.read_text())}


def _runs(home: Path) -> list:
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lrkv")
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def _rerun(args, env, tmp_path, name) -> dict[str, str]:
    log = tmp_path / f"{name}.log"
    res = subprocess.run(args, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, timeout=900)
    assert res.returncode == 0, log.read_text()[-3000:]
    return _states(log)


def test_sigkill_during_decomposition_leaves_no_process_and_resumes_without_redoing_layers(tmp_path):
    args, env = _setup(tmp_path, LAYERS, evaluate=False)
    proc = _start(args, env, tmp_path / "first.log")
    _wait_for(lambda: _recorded(tmp_path / "store", "factors") >= 2, proc)  # recorded, not only written
    children = _descendants(proc.pid)
    assert children, "the CLI owns its Prefect API server"
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert not _gone(children), "the Prefect API server outlived a SIGKILLed CLI"
    assert [r.info.status for r in _runs(tmp_path / "home")] == ["RUNNING"]  # nobody could mark it
    finished = _recorded(tmp_path / "store", "factors")
    assert 0 < finished < LAYERS

    states = _rerun(args, env, tmp_path, "resume")
    decomposed = {k: v for k, v in states.items() if k.startswith("decompose_layer")}
    assert len(decomposed) == LAYERS
    cached = sum(v == "Cached" for v in decomposed.values())
    assert cached == finished, (cached, finished)  # every finished layer from the cache, the rest computed
    assert [r.info.status for r in _runs(tmp_path / "home")] == ["KILLED", "FINISHED"]  # the orphan reaped


def test_sigkill_with_the_store_on_s3_resumes_in_a_new_process_with_a_fresh_home(tmp_path, s3):
    """``--store s3://`` reaches S3; a re-run with another LRKV_HOME recomputes no layer finished there."""
    store = f"s3://lrkv/resume-{uuid.uuid4().hex[:8]}"
    args, env = _setup(tmp_path, S3_LAYERS, evaluate=False, store=store)
    first = {"LRKV_HOME": str(tmp_path / "home-1"), "PREFECT_TASKS_RUNNER_THREAD_POOL_MAX_WORKERS": "1"}
    proc = _start(args, env | first, tmp_path / "first.log", cwd=tmp_path)  # one layer at a time: killable
    _wait_for(lambda: _recorded(store, "factors") >= 2, proc, every=0.2)  # recorded in the bucket
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    finished = _recorded(store, "factors")
    assert 0 < finished < S3_LAYERS
    assert not (tmp_path / "s3:").exists()  # what a store path folded from s3:// would have created

    env |= {"LRKV_HOME": str(tmp_path / "home-2")}  # no local download cache, no local Prefect or MLflow
    log = tmp_path / "resume.log"
    res = subprocess.run(
        args, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, timeout=900, cwd=tmp_path
    )
    assert res.returncode == 0, log.read_text()[-3000:]
    decomposed = {k: v for k, v in _states(log).items() if k.startswith("decompose_layer")}
    assert len(decomposed) == S3_LAYERS
    cached = sum(v == "Cached" for v in decomposed.values())
    assert cached == finished, (cached, finished)  # every finished layer from the records in S3
    assert [r.info.status for r in _runs(tmp_path / "home-2")] == ["FINISHED"]
    assert not (tmp_path / "s3:").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_evaluation_stops_inside_it_records_killed_and_resumes_from_the_cache(tmp_path, sig):
    """A terminal's Ctrl-C (SIGINT) and ``timeout``/``kill`` (SIGTERM) stop the run inside a task that is
    busy in a worker thread: the flow engine's own SIGTERM handling (which waits for running tasks to end)
    must not stand in the way."""
    args, env = _setup(tmp_path, 8, evaluate=True)
    log = tmp_path / "first.log"
    proc = _start(args, env, log)
    _wait_for(lambda: _recorded(tmp_path / "store", "model") >= 1, proc)  # build recorded: now evaluating
    children = _descendants(proc.pid)
    assert children, "the CLI owns its Prefect API server"
    started = time.monotonic()
    os.killpg(proc.pid, sig)  # the whole group, as a terminal's Ctrl-C and `timeout` do
    code = proc.wait(timeout=60)
    elapsed = time.monotonic() - started
    text = log.read_text()
    assert code == 128 + sig, text[-3000:]
    assert f"interrupted ({sig.name})" in text and "Traceback" not in text, text[-3000:]
    assert not _gone(children), "a process outlived the interrupted CLI"
    assert [r.info.status for r in _runs(tmp_path / "home")] == ["KILLED"]
    print(f"{sig.name} stopped the CLI in {elapsed:.2f}s")

    states = _rerun(args, env, tmp_path, "resume")
    layer_tasks = {k: v for k, v in states.items() if "_layer[" in k or k == "build_model"}
    assert len(layer_tasks) == 2 * 8 + 1
    assert set(layer_tasks.values()) == {"Cached"}, layer_tasks  # zero finished layer tasks recomputed
    # computed again: the interrupted run stopped inside the evaluation instead of waiting for its end
    assert states["evaluate[compressed]"] == "Completed"
    assert [r.info.status for r in _runs(tmp_path / "home")] == ["KILLED", "FINISHED"]


def test_when_only_the_api_server_dies_the_run_fails_and_nothing_is_exported(tmp_path):
    args, env = _setup(tmp_path, LAYERS, evaluate=False)
    out = tmp_path / "out"
    log = tmp_path / "first.log"
    proc = _start([*args, "--out", str(out)], env, log)
    _wait_for(lambda: _count(tmp_path / "store" / "factors") >= 4, proc)
    [server] = _descendants(proc.pid)
    server.kill()
    code = proc.wait(timeout=60)
    text = log.read_text()
    assert code == 1 and "the Prefect API server exited unexpectedly" in text, text[-3000:]
    assert [r.info.status for r in _runs(tmp_path / "home")] == ["FAILED"]
    assert not out.exists()


def test_ctrl_c_before_the_flow_takes_its_signals_is_exit_130_in_one_line(monkeypatch, capsys):
    """A KeyboardInterrupt between the API's start and the flow's own signal handlers (the command importing
    its flow, say) ends the command as every other Ctrl-C does: one line and exit 130, not click's "Aborted!"
    and exit 1."""
    import typer

    from lrkv_flows.commands.common import prefect_api

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # a given API: nothing is started
    outcome: BaseException | None = None
    try:
        with prefect_api():
            raise KeyboardInterrupt
    except BaseException as err:  # noqa: BLE001  (a KeyboardInterrupt let through must fail this test only)
        outcome = err
    assert isinstance(outcome, typer.Exit) and outcome.exit_code == 130, repr(outcome)
    assert capsys.readouterr().out.strip() == "interrupted (SIGINT)"
