"""The flows' tasks on a real Dask cluster (a LocalCluster of worker processes), chosen by configuration."""

import os
import subprocess
import sys

import pytest
import torch
from distributed import Client
from prefect.task_runners import ThreadPoolTaskRunner
from prefect_dask import DaskTaskRunner
from typer.testing import CliRunner

from lrkv_core import load_compressed
from lrkv_core.allocation.plan import RankPlan
from lrkv_core.data.datasets import read_token_rows
from lrkv_flows.cli import app
from lrkv_flows.cluster import ENV, MAX_LOCAL_WORKERS, dask_cluster, parse_dask
from lrkv_flows.convert import convert_flow
from lrkv_flows.runner import configured_task_runner
from lrkv_tasks.store.artifact_store import local_path
from tests.flows.test_convert_flow import _recipe
from tests.support.models import tiny_model_dir, token_parquet


def test_dask_values_are_parsed_and_a_bad_one_names_the_forms(monkeypatch):
    assert parse_dask("local").workers == min(os.cpu_count(), MAX_LOCAL_WORKERS)
    assert parse_dask("local:3").workers == 3 and parse_dask("local:3").address is None
    assert parse_dask("tcp://10.0.0.5:8786").address == "tcp://10.0.0.5:8786"
    assert parse_dask("tls://scheduler:8786").workers is None
    for bad in ("local:0", "local:x", "locl", "tcp://scheduler", "http://scheduler:8786", ""):
        with pytest.raises(ValueError, match="local:N"):
            parse_dask(bad)

    # the flows' runner is chosen from LRKV_DASK when a flow run starts
    monkeypatch.delenv(ENV, raising=False)
    assert type(configured_task_runner()) is ThreadPoolTaskRunner
    monkeypatch.setenv(ENV, "tcp://127.0.0.1:8786")
    runner = configured_task_runner()
    assert isinstance(runner, DaskTaskRunner) and runner.address == "tcp://127.0.0.1:8786"
    monkeypatch.setenv(ENV, "local:2")
    assert configured_task_runner().cluster_kwargs["n_workers"] == 2
    assert type(convert_flow.task_runner.duplicate()) is DaskTaskRunner


def _tasks_run_by(address: str) -> dict[str, int]:
    """How many tasks of each name the cluster's workers ran (the scheduler's count of results held)."""
    with Client(address) as client:
        return client.run_on_scheduler(
            lambda dask_scheduler: {
                name: prefix.state_counts["memory"] for name, prefix in dask_scheduler.task_prefixes.items()
            }
        )


def test_convert_on_a_dask_cluster_matches_threads_and_shares_their_cached_results(prefect_api, tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    on_dask = _recipe(model_dir, data, tmp_path / "store-dask", tmp_path / "out-dask", mlflow_uri, ratio=0.5)
    on_threads = _recipe(model_dir, data, tmp_path / "store", tmp_path / "out", mlflow_uri, ratio=0.5)

    with dask_cluster("local:2") as spec:
        assert os.environ[ENV] == spec.address and spec.workers == 2
        dask = convert_flow(on_dask)
        ran = _tasks_run_by(spec.address)
        with Client(spec.address) as client:  # each worker exits quickly (lrkv_flows.exiting)
            assert set(client.run(_freezes_at_exit).values()) == {True}
    assert ENV not in os.environ  # restored (unset) after the block
    states = {row["task"]: row["state"] for row in dask.timings}
    assert set(states.values()) == {"Completed"}, states
    assert all(row["seconds"] is not None for row in dask.timings)  # read back from the API
    # every task ran on the cluster's workers, none in this process (the default kl: refine_plan too)
    assert ran["decompose_layer"] == ran["summarize_layer"] == 2  # the tiny model's 2 layers
    # gram, attention_gram, output_fisher (the default decomposition's), kl_response (the allocator's):
    # each whole-model pass split between the 2 workers (its rows halved), then merged
    assert ran["collect_statistic_shard"] == 2 * 4 and ran["merge_statistic"] == 4
    assert "collect_statistic" not in ran and ran["evaluate"] == 2 and ran["refine_plan"] == 1
    assert dask.recipe.calibration.shards == 2  # one per worker, recorded with the run
    assert sum(ran.values()) == len(dask.timings)

    threads = convert_flow(on_threads)
    assert {row["state"] for row in threads.timings} == {"Completed"}
    plans = [RankPlan.load(local_path(result.plan.uri)) for result in (dask, threads)]
    assert plans[0].ranks == plans[1].ranks
    assert dask.eval.compressed.prefill["nll"] == pytest.approx(
        threads.eval.compressed.prefill["nll"], abs=1e-5
    )
    ids = read_token_rows(data.split(":", 1)[1])[:4]
    with torch.no_grad():
        logits = [load_compressed(tmp_path / out)(ids).logits for out in ("out-dask", "out")]
    assert (logits[0] - logits[1]).abs().max() < 1e-4

    # the results the cluster computed are the threads' cache: the same recipe (and shards) on threads
    # recomputes nothing
    cal = on_dask.calibration.model_copy(update={"shards": 2})
    again = convert_flow(on_dask.model_copy(update={"calibration": cal}))
    assert {row["state"] for row in again.timings} == {"Cached"}, again.timings
    assert again.mlflow["run_id"] == dask.mlflow["run_id"]


def _freezes_at_exit() -> bool:
    import sys

    exiting = sys.modules.get("lrkv_flows.exiting")
    return exiting is not None and exiting._registered


def _lrkv(args, home, env_extra=None):
    env = {**os.environ, "LRKV_HOME": str(home)}
    for name in ("PREFECT_API_URL", "PREFECT_LOCAL_STORAGE_PATH", ENV):
        env.pop(name, None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "lrkv_flows.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli_dask_starts_a_local_cluster_for_the_command_and_refuses_bad_values(tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    common = ["convert", "--model", str(model_dir), "--dataset", data, "--n-samples", "8", "--seq-len", "32"]
    common += ["--group-size", "2", "--allocator", "uniform", "--set", "eval.max_windows=2"]
    common += ["--set", "eval.decode_windows=1"]

    res = _lrkv([*common, "--dask", "local:1", "--out", str(tmp_path / "out")], tmp_path / "home")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "tasks run on a local Dask cluster of 1 worker process at tcp://127.0.0.1:" in res.stdout
    assert "KV compression (measured)" in res.stdout
    assert load_compressed(tmp_path / "out").config.lrkv["achieved_ratio"] == 0.5

    for args in (common, ["ablate", "--model", str(model_dir)], ["deploy"]):  # refused before any work
        res = CliRunner().invoke(app, [*args, "--dask", "local:0"])
        text = " ".join(res.output.replace("│", " ").split())
        assert res.exit_code == 2 and "--dask / LRKV_DASK takes local, local:N" in text, (args, text)
    # a running scheduler needs a Prefect server its workers reach, not the one this command would own
    res = _lrkv([*common, "--dask", "tcp://127.0.0.1:9"], tmp_path / "home")
    assert res.returncode == 1 and "needs a Prefect server its workers can reach" in res.stdout, res.stdout
    api = {"PREFECT_API_URL": "http://127.0.0.1:9/api"}  # checked after the scheduler: never reached here
    res = _lrkv([*common, "--dask", "tcp://127.0.0.1:9"], tmp_path / "home", api)  # nothing listens on 9
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "no Dask scheduler answers at tcp://127.0.0.1:9" in lines[0], res.stdout
    assert "Traceback" not in res.stdout + res.stderr
