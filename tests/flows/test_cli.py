"""The ``lrkv`` command line, run as a user runs it (a subprocess with its own ephemeral Prefect API)."""

import json
import os
import subprocess
import sys

import torch

from lrkv_core import load_compressed, load_model
from lrkv_core.data import read_token_rows
from tests.support.models import tiny_model_dir, token_parquet


def _lrkv(args, home, timeout=300):
    env = {**os.environ, "LRKV_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_LOCAL_STORAGE_PATH", None)
    return subprocess.run(
        [sys.executable, "-m", "lrkv_flows.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_convert_then_eval(tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    out = tmp_path / "out"
    res = _lrkv(
        [
            "convert",
            "--model",
            str(model_dir),
            "--dataset",
            data,
            "--eval-dataset",
            data,
            "--ratio",
            "0.5",
            "--group-size",
            "2",
            "--n-samples",
            "8",
            "--seq-len",
            "32",
            "--out",
            str(out),
            "--set",
            "eval.max_windows=4",
            "--set",
            "eval.decode_windows=2",
        ],
        tmp_path / "home",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "KV bytes ratio (measured)" in res.stdout and "MLflow run" in res.stdout
    assert (tmp_path / "home" / "mlflow.db").is_file()
    compressed = load_compressed(out)
    assert compressed.config.lrkv["achieved_ratio"] == 0.5

    report = tmp_path / "eval.json"
    res = _lrkv(
        ["eval", str(out), "--dataset", data, "--seq-len", "32", "--json-out", str(report)]
        + ["--base", str(model_dir)],
        tmp_path / "home",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["kv"]["cache_class"] == "LatentCache"
    assert result["prefill"]["protocol"]["dataset"] == data and result["prefill"]["windows"] == 12
    assert 0 < result["kl"]["kl"] and 0 < result["kl"]["top1_agreement"] <= 1  # ratio 0.5: a real, small cost
    # the numbers in the report are the model's: recompute the prefill NLL directly
    base, _ = load_model(out)
    ids = read_token_rows(data.split(":", 1)[1])
    with torch.no_grad():
        loss = base(ids, labels=ids).loss.item()
    assert abs(loss - result["prefill"]["nll"]) < 1e-4


def test_bad_recipe_key_fails_with_a_message(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("compression:\n  ratoi: 0.5\n")
    res = _lrkv(["convert", "--recipe", str(recipe)], tmp_path / "home", timeout=120)
    assert res.returncode == 2 and "ratoi" in res.stdout


def test_unsupported_architecture_is_named(tmp_path):
    gpt2 = tiny_model_dir(tmp_path, "gpt2", vocab_size=50)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=4, seq_len=16, vocab=50)}"
    res = _lrkv(
        ["convert", "--model", str(gpt2), "--dataset", data, "--n-samples", "2", "--seq-len", "16"],
        tmp_path / "home",
    )
    assert res.returncode == 1
    assert "gpt2" in res.stdout and "llama" in res.stdout and "mistral" in res.stdout
