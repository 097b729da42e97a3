"""Deployments on Prefect's real API, and a run triggered through the API (the UI's Run button) completed
by a real process worker."""

import os
import signal
import subprocess
import sys
import time

from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL

from lrkv_flows.deploy import deploy, nightly_flow
from lrkv_tasks.recipes.convert_recipe import ConvertRecipe, load_recipe
from tests.support.models import tiny_model_dir, token_parquet


def _recipe(tmp_path, model_dir, mlflow_uri: str, experiment: str) -> ConvertRecipe:
    """A fast recipe for the tiny model: 8 calibration rows, 2 evaluation windows, a store in tmp_path."""
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    return load_recipe(
        None,
        {
            "model": str(model_dir),
            "calibration": {"dataset": data, "n_samples": 8, "seq_len": 32, "batch_size": 4},
            "compression": {"ratio": 0.5, "group_size": 2, "rank_multiple": 8},
            "eval": {
                "dataset": data,
                "seq_len": 32,
                "max_windows": 2,
                "decode_prefix": 16,
                "decode_windows": 1,
            },
            "tracking": {"mlflow_uri": mlflow_uri, "experiment": experiment},
            "store": str(tmp_path / "store"),
        },
    )


def test_deployments_with_a_nightly_schedule_and_a_run_completed_by_a_worker(prefect_api, tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    recipe = _recipe(tmp_path, model_dir, mlflow_uri, "deploy-test")
    pool = "lrkv-test-pool"
    # the runs' tasks on Dask, by configuration alone: each run starts a local cluster of one worker process
    models = [str(model_dir), "builtin:pydoc-llama"]
    ids = deploy(recipe, models, cron="30 1 * * *", pool=pool, dask="local:1", device="cpu")
    assert set(ids) == {
        "lrkv-convert/convert", "lrkv-evaluate/evaluate", "lrkv-bench/bench", "lrkv-nightly/nightly"
    }  # fmt: skip

    with get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name("lrkv-nightly/nightly")
        assert [s.schedule.cron for s in nightly.schedules] == ["30 1 * * *"] and nightly.schedules[0].active
        assert nightly.parameters["models"] == [str(model_dir), "builtin:pydoc-llama"]
        assert nightly.work_pool_name == pool and nightly.entrypoint == "lrkv_flows.deploy.nightly_flow"
        convert = client.read_deployment_by_name("lrkv-convert/convert")
        assert convert.parameters["recipe"]["model"] == str(model_dir)
        env = {"LRKV_DASK": "local:1", "LRKV_DEVICE": "cpu"}  # the runs' tasks read both
        assert convert.job_variables == nightly.job_variables == {"env": env}
        bench = client.read_deployment_by_name("lrkv-bench/bench")
        assert bench.entrypoint == "lrkv_flows.bench.bench_flow" and bench.job_variables == {"env": env}
        assert {k: bench.parameters[k] for k in ("model", "ratios", "store")} == {
            "model": str(model_dir), "ratios": [0.5], "store": str(tmp_path / "store")
        }  # fmt: skip
        assert bench.parameters["tracking"]["experiment"] == "deploy-test"

    # what the UI's Run button does: create a flow run of the deployment through the API
    flow_run = run_deployment("lrkv-convert/convert", timeout=0)
    small = {"contexts": [16], "batch": 2, "steps": 2, "warmup": 1}  # the Run button's form, edited
    bench_run = run_deployment("lrkv-bench/bench", parameters=small, timeout=0)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "LRKV_HOME": str(tmp_path / "home")}
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect",
            "worker",
            "start",
            "--pool",
            pool,
            "--type",
            "process",
            "--run-once",
        ],
        env=env,
        stdout=open(tmp_path / "worker.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its group: the worker and the flow-run process it starts
    )
    try:
        deadline = time.monotonic() + 600
        with get_client(sync_client=True) as client:
            while True:
                state, bench_state = (client.read_flow_run(r.id).state for r in (flow_run, bench_run))
                if (state.is_final() and bench_state.is_final()) or time.monotonic() > deadline:
                    break
                time.sleep(1)
        worker.wait(timeout=120)
    finally:  # a timeout above must not leave the worker (or its flow run) polling the API
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
    log = (tmp_path / "worker.log").read_text()
    assert state.is_completed(), f"{state.name}: {state.message}\n{log[-3000:]}"
    assert bench_state.is_completed(), f"{bench_state.name}: {bench_state.message}\n{log[-3000:]}"
    assert "Creating a new Dask cluster with `distributed.deploy.local.LocalCluster`" in log, log[-3000:]
    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("deploy-test").experiment_id])
    assert sorted(r.data.tags["lrkv.kind"] for r in runs) == ["bench", "convert"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    converted = next(r for r in runs if r.data.tags["lrkv.kind"] == "convert")
    assert converted.data.tags["lrkv.prefect_flow_run"] == str(flow_run.id)
    measured = next(r for r in runs if r.data.tags["lrkv.kind"] == "bench")
    assert measured.data.tags["lrkv.prefect_flow_run"] == str(bench_run.id)
    assert measured.data.metrics["lrkv_r0.5.decode_ms.ctx16"] > 0


def test_the_evaluate_flow_logs_a_run(prefect_api, tmp_path):
    from lrkv_flows.evaluate import evaluate_flow
    from lrkv_tasks.recipes.convert_recipe import EvalRecipe, TrackingRecipe

    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=8, seq_len=32)}"
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ev = EvalRecipe(dataset=data, seq_len=32, max_windows=2, decode_prefix=16, decode_windows=1)
    result = evaluate_flow(
        str(model_dir),
        ev,
        tracking=TrackingRecipe(mlflow_uri=mlflow_uri, experiment="eval-test"),
        store=str(tmp_path / "store"),
    )
    run = MlflowClient(mlflow_uri).get_run(result["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["lrkv.kind"] == "evaluate"
    assert run.data.metrics["prefill_ppl"] == result["eval"].prefill_ppl > 1


def test_the_nightly_flow_converts_every_model_then_fails_naming_the_bad_one(prefect_api, tmp_path):
    """A missing model does not stop the next one (its MLflow run FINISHED); the flow run fails naming it."""
    model_dir = tiny_model_dir(tmp_path)
    missing = str(tmp_path / "no-such-model")
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    recipe = _recipe(tmp_path, model_dir, mlflow_uri, "nightly-test")
    state = nightly_flow([missing, str(model_dir)], recipe, return_state=True)
    assert state.is_failed(), state
    err = state.result(raise_on_failure=False)
    assert isinstance(err, RuntimeError) and "1 of 2 nightly conversions failed" in str(err), err
    assert f"{missing}': 'FileNotFoundError: model directory {missing} does not exist" in str(err), err
    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("nightly-test").experiment_id])
    assert [(r.info.status, r.data.tags["lrkv.model"]) for r in runs] == [("FINISHED", str(model_dir))]
