"""``lrkv up`` / ``down`` with real processes, the CLI using the running server, and ``lrkv runs``."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import psutil

from tests.support.models import tiny_model_dir, token_parquet
from tests.support.servers import free_port


def _lrkv(args, env, timeout=600):
    started = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "lrkv_flows.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, (args, res.stdout[-3000:], res.stderr[-3000:])
    return res.stdout, time.monotonic() - started


def _flow_runs(api: str) -> int:
    request = urllib.request.Request(
        f"{api}/flow_runs/count", data=b"{}", headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


def test_up_serves_the_cli_runs_inspects_and_down_stops_everything(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "LRKV_HOME": str(home), "COLUMNS": "250", "LRKV_WORK_POOL": "lrkv-up-test"}
    env |= {"LRKV_PREFECT_PORT": str(free_port()), "LRKV_MLFLOW_PORT": str(free_port())}
    for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_LOCAL_STORAGE_PATH"):
        env.pop(name, None)
    out, _ = _lrkv(["up"], env)
    services = json.loads((home / "services.json").read_text())
    pids = [psutil.Process(pid) for pid in services["pids"].values()]
    try:
        assert "Prefect UI" in out and services["mlflow"] in out
        env["MLFLOW_TRACKING_URI"] = services["mlflow"]
        model = tiny_model_dir(tmp_path)
        data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
        convert = [
            "convert",
            "--model",
            str(model),
            "--dataset",
            data,
            "--eval-dataset",
            data,
            "--n-samples",
            "8",
        ]
        convert += ["--seq-len", "32", "--group-size", "2", "--store", str(tmp_path / "store")]
        convert += ["--set", "eval.max_windows=2", "--set", "eval.decode_windows=1"]
        full, _ = _lrkv([*convert, "--ratio", "1.0"], env)
        _, cold = _lrkv([*convert, "--ratio", "0.5"], env)
        half, warm = _lrkv([*convert, "--ratio", "0.5"], env)  # every task cached, on the running server
        assert _flow_runs(services["prefect_api"]) == 3  # the CLI used lrkv up's server, not one of its own
        assert "Cached" in half and "Completed" not in half
        print(f"with lrkv up: a conversion {cold:.1f}s, its warm (all cached) re-run {warm:.1f}s")

        run_full, run_half = (text.split("MLflow run ")[1].split()[0] for text in (full, half))
        listing, _ = _lrkv(["runs", "list"], env)
        assert run_full in listing and run_half in listing and "FINISHED" in listing
        assert "original PPL" in listing and "…" not in listing  # a pipe gets the table whole, not 80 columns
        shown, _ = _lrkv(["runs", "show", run_half], env)
        for expected in (
            "compressed_prefill_ppl",
            "recipe.compression.ratio",
            "rank_plan.json",
            "eval_table.json",
        ):
            assert expected in shown, expected
        compared, _ = _lrkv(["runs", "compare", run_full, run_half], env)
        assert "achieved_ratio" in compared and "recipe.compression.ratio" in compared
        assert "-0.5000" in compared  # achieved ratio b − a

        # deployments on lrkv up's server, and the command it prints next finds them with Prefect's own CLI
        deployed, _ = _lrkv(["deploy"], env)
        assert "deployment lrkv-bench/bench" in deployed
        hint = deployed.split("run one now: ")[1].split(" (or")[0]
        api = services["prefect_api"]
        assert hint == f"PREFECT_API_URL={api} prefect deployment run lrkv-convert/convert"
        variable, value = hint.split()[0].split("=", 1)
        inspect = [sys.executable, "-m", "prefect", "deployment", "inspect", "lrkv-bench/bench"]
        found = subprocess.run(
            inspect, env=env | {variable: value}, capture_output=True, text=True, timeout=120
        )
        assert found.returncode == 0 and "'name': 'bench'" in found.stdout, found.stdout[-2000:]
    finally:
        _lrkv(["down"], env)
    _, alive = psutil.wait_procs(pids, timeout=30)
    assert not alive and not (home / "services.json").exists()

    # the same warm re-run without a server: the CLI starts (and stops) its own
    env.pop("MLFLOW_TRACKING_URI")
    local = [*convert, "--ratio", "0.5", "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"]
    _lrkv(local, env)  # logs and registers in the local MLflow; every other task cached
    again, owned = _lrkv(local, env)
    assert "Completed" not in again
    print(f"warm re-run with a server the CLI starts itself: {owned:.1f}s")
