"""The ``lrkv`` command line, run as a user runs it (a subprocess with its own ephemeral Prefect API)."""

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from lrkv_core import load_compressed, load_model
from lrkv_core.data.datasets import read_token_rows
from tests.support.models import tiny_model_dir, token_parquet


def _lrkv(args, home, timeout=300, env=None):
    env = {**os.environ, "LRKV_HOME": str(home), **(env or {})}
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
            "--device",
            "auto",  # the GPU where torch sees one, else the CPU
        ],
        tmp_path / "home",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "KV bytes ratio (measured)" in res.stdout and "MLflow run" in res.stdout
    assert "KV bytes/token after the decode" in res.stdout
    assert "models compute on auto" in res.stdout
    assert (tmp_path / "home" / "mlflow.db").is_file()
    compressed = load_compressed(out)
    assert compressed.config.lrkv["achieved_ratio"] == 0.5

    report = tmp_path / "eval.json"
    res = _lrkv(
        ["eval", str(out), "--dataset", data, "--seq-len", "32", "--json-out", str(report)]
        + ["--base", str(model_dir), "--device", "cpu"],
        tmp_path / "home",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["kv"]["cache_class"] == "LatentCache"
    decode = result["decode"]  # the bytes held after the decode, said on the terminal and in the report
    assert (
        f"KV bytes/token after the decode (31 tokens a window): {decode['kv_bytes_per_token']:.1f}"
        in res.stdout
    )
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


@pytest.mark.parametrize(
    "device, message",
    [("tpu", "unknown device 'tpu'")]
    + ([] if torch.cuda.is_available() else [("cuda", "sees no CUDA device")]),
)
def test_a_device_this_machine_lacks_is_a_usage_error(tmp_path, device, message):
    """Before any work: from the flag and from LRKV_DEVICE, for convert and eval."""
    for args, env in (
        (["convert", "--device", device], {}),
        (["convert"], {"LRKV_DEVICE": device}),
        (["eval", str(tmp_path), "--dataset", "text:x.txt", "--device", device], {}),
    ):
        res = _lrkv(args, tmp_path / "home", timeout=120, env=env)
        assert res.returncode == 2 and message in res.stdout + res.stderr, res.stdout + res.stderr


def test_unsupported_architecture_is_named(tmp_path):
    gpt2 = tiny_model_dir(tmp_path, "gpt2", vocab_size=50)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=4, seq_len=16, vocab=50)}"
    res = _lrkv(
        ["convert", "--model", str(gpt2), "--dataset", data, "--n-samples", "2", "--seq-len", "16"],
        tmp_path / "home",
    )
    assert res.returncode == 1
    assert "gpt2" in res.stdout and "llama" in res.stdout and "mistral" in res.stdout


def _convert_args(model_dir, data, out, *extra):
    common = ["--n-samples", "8", "--seq-len", "32", "--set", "eval.max_windows=4"]
    common += ["--set", "eval.decode_windows=1"]
    return ["convert", "--model", str(model_dir), "--dataset", data, "--out", str(out), *common, *extra]


def test_without_eval_dataset_it_evaluates_on_held_out_calibration_rows(tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    data = token_parquet(tmp_path / "data.parquet", rows=20, seq_len=32)
    out = tmp_path / "out"
    res = _lrkv(_convert_args(model_dir, f"parquet:{data}", out, "--ratio", "0.5"), tmp_path / "home")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = " ".join(res.stdout.split())  # rich wraps long lines
    assert f"evaluating on parquet:{data}[90%:]" in text and "not used for calibration" in text
    assert f"parquet:{data}[:90%]" in text  # calibration draws from the other rows only
    assert "group size 2 (auto" in text
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) & 0o044 for p in out.iterdir()}
    assert set(modes.values()) == {0o044}, modes  # every exported file readable like config.json


def test_bad_settings_fail_before_any_work(tmp_path):
    """Checks the recipe and the model's config decide run before Prefect starts: fast, one line, no --out."""
    model_dir = tiny_model_dir(tmp_path)  # Hkv = 2, D = 8, 2 layers
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    out = tmp_path / "out"
    cases = [
        (["--group-size", "3"], "group size 3 must divide the number of KV heads (2); valid: [1, 2]"),
        (["--ratio", "0.2", "--group-size", "1"], "leaves rank 0 for some groups"),
        (["--eval-dataset", f"parquet:{tmp_path / 'missing.parquet'}"], "missing.parquet"),
        (["--eval-dataset", f"text:{tmp_path / 'data.parquet'}"], "has no tokenizer"),
        (["--bits", "4", "--quant-group-size", "3"], "quantization group size 3 does not divide"),
    ]
    for extra, message in cases:
        res = _lrkv(_convert_args(model_dir, data, out, *extra), tmp_path / "home", timeout=120)
        assert res.returncode == 1, (extra, res.stdout[-2000:], res.stderr[-2000:])
        assert message in " ".join(res.stdout.split()), (extra, res.stdout[-2000:])
        assert "Traceback" not in res.stdout + res.stderr and "Prefect" not in res.stdout
        assert not out.exists()
    res = _lrkv(_convert_args(model_dir, f"parquet:{tmp_path / 'nope.parquet'}", out), tmp_path / "home")
    assert res.returncode == 1 and "nope.parquet" in res.stdout and not out.exists()


def test_a_failed_evaluation_leaves_no_exported_model(tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    short = f"parquet:{token_parquet(tmp_path / 'short.parquet', rows=2, seq_len=16)}"  # no 32-token window
    out = tmp_path / "out"
    res = _lrkv(_convert_args(model_dir, data, out, "--eval-dataset", short), tmp_path / "home")
    assert res.returncode == 1 and "too little data" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stdout + res.stderr
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_eval_reports_user_errors_in_one_line(tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=4, seq_len=32)}"
    compressed = tmp_path / "c"
    from lrkv_core import convert, save_compressed
    from lrkv_core.conversion.convert import CompressionConfig

    model, _ = load_model(model_dir)
    data_free = CompressionConfig(ratio=0.5, decomposition="plain", allocator="uniform")
    save_compressed(convert(model, None, data_free), compressed)
    weights = compressed / "model.safetensors"
    cases = [
        (tmp_path / "absent", "does not exist"),
        (compressed, "model.safetensors: unreadable safetensors file (truncated or corrupt"),
    ]
    weights.write_bytes(weights.read_bytes()[:2000])
    for path, message in cases:
        res = _lrkv(["eval", str(path), "--dataset", data, "--seq-len", "32"], tmp_path / "home", timeout=120)
        assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
        assert message in " ".join(res.stdout.split()) and "Traceback" not in res.stdout + res.stderr
    res = _lrkv(["eval", str(model_dir), "--dataset", f"{data}x", "--seq-len", "32"], tmp_path / "home")
    assert res.returncode == 1 and "dataset file not found" in res.stdout


def test_convert_with_quantized_latents_and_a_rotation(tmp_path):
    """--bits/--quant-group-size/--residual-length/--rotation reach the model-format section and the cache."""
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    out = tmp_path / "out"
    flags = ["--bits", "3", "--quant-group-size", "4", "--residual-length", "2", "--rotation", "auto"]
    res = _lrkv(
        _convert_args(model_dir, data, out, "--ratio", "0.5", "--group-size", "2", *flags), tmp_path / "h"
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "KV compression (measured)" in res.stdout
    section = load_compressed(out).config.lrkv
    assert section["cache"] == {"name": "quantized", "bits": 3, "quant_group_size": 4, "residual": 2}
    assert section["rotation"] == "auto" and section["format_version"] == 4
    res = _lrkv(["convert", "--quant-group-size", "4"], tmp_path / "h", timeout=120)
    assert res.returncode == 2 and "need --bits" in " ".join((res.stdout + res.stderr).split())


def test_eval_through_transformers_quantized_cache(tmp_path):
    pytest.importorskip("hqq", reason="the hqq backend is not installed (pip install 'lrkv[anchor]')")
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=4, seq_len=32)}"
    report = tmp_path / "eval.json"
    args = ["eval", str(model_dir), "--dataset", data, "--seq-len", "32", "--json-out", str(report)]
    res = _lrkv([*args, "--hf-quant-cache", "hqq:2"], tmp_path / "home")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["kv"]["cache_class"] == "QuantizedCache" and result["kv"]["kv_compression_ratio"] > 1
    assert result["decode"]["protocol"]["hf_quantized_cache"] == {
        "backend": "hqq", "bits": 2, "q_group_size": None, "residual_length": 0,
    }  # fmt: skip
    res = _lrkv([*args, "--hf-quant-cache", "quanto:3"], tmp_path / "home", timeout=120)
    assert res.returncode == 1 and "quanto backend takes (2, 4) bits" in " ".join(res.stdout.split())


def test_options_taking_local_paths_refuse_uris_and_create_nothing(tmp_path, tmp_path_factory, monkeypatch):
    """A URI or a folded one (``s3:/b``) given for a local path: exit 2 naming the option, nothing created."""
    from typer.testing import CliRunner

    from lrkv_flows.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LRKV_HOME", str(tmp_path_factory.mktemp("home")))
    for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    convert = ["convert", "--model", "./missing"]  # were an option accepted, this fails fast
    cases = [
        [*convert, "--store", "s3:/lrkv/store"],
        [*convert, "--store", "gs://lrkv/store"],
        [*convert, "--out", "s3://lrkv/model"],
        [*convert, "--recipe", "s3://lrkv/recipe.yaml"],
        ["ablate", "--model", "./missing", "--out-dir", "s3://lrkv/ablation"],
        ["eval", "model", "--dataset", "text:x.txt", "--json-out", "s3://lrkv/eval.json"],
        ["pull", "lrkv-x@champion", "--out", "models:/lrkv-x"],
        ["deploy", "--recipe", "s3://lrkv/recipe.yaml"],
    ]
    for args in cases:
        res = CliRunner().invoke(app, args)
        text = " ".join(res.output.replace("│", " ").split())
        assert res.exit_code == 2, (args, res.output)
        assert f"Invalid value for '{args[-2]}'" in text and "looks like a URI" in text, (args, text)
    assert list(tmp_path.iterdir()) == []


def test_eval_takes_another_cache_storage(compress, tmp_path, monkeypatch):
    """``lrkv eval DIR --cache SPEC``: a saved model evaluated with another storage, recorded in the protocol;
    a bad storage or option is a usage error."""
    from typer.testing import CliRunner

    from lrkv_core import save_compressed
    from lrkv_flows.cli import app
    from tests.support.models import tiny_model

    monkeypatch.setenv("LRKV_HOME", str(tmp_path / "home"))
    out = save_compressed(compress(tiny_model("llama", 2), 1, 0.5)[0], tmp_path / "m")
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=4, seq_len=32, vocab=61)}"
    args = ["eval", str(out), "--dataset", data, "--seq-len", "32", "--decode-windows", "2"]
    results = {}
    for name, extra in (("dense", []), ("gear", ["--cache", "{name: gear, bits: 2, buffer: 4}"])):
        report = tmp_path / f"{name}.json"
        res = CliRunner().invoke(app, [*args, *extra, "--json-out", str(report)])
        assert res.exit_code == 0, res.output
        results[name] = json.loads(report.read_text())
    gear, dense = results["gear"], results["dense"]
    assert gear["decode"]["protocol"]["cache"] == {
        "name": "gear", "bits": 2, "quant_group_size": None, "outlier_share": 0.02, "outliers": None,
        "rank": 2, "rank_share": None, "solver": "power", "iterations": 3, "mode": "whole", "buffer": 4,
    }  # fmt: skip
    assert "cache" not in dense["decode"]["protocol"]
    assert gear["kv"]["kv_bytes_per_token"] != dense["kv"]["kv_bytes_per_token"]
    assert gear["decode"]["ppl"] != dense["decode"]["ppl"]
    for spec, message in (
        ("{name: gear, bits: 5}", "gear cache bits must be one of"),
        ("gzip", "unknown cache storage"),
        ("{name: gear", "is not valid YAML"),
        ("{name: tale, low: 2}", "tale cache low must be between 0 and 1"),
        ("{name: tale, recent: lots}", "'tale': recent: Input should be"),
    ):
        res = CliRunner().invoke(app, [*args, "--cache", spec])
        assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--cache", "gear", "--bits", "3"], "--cache names the whole storage"),
        (["--set", "compression.ratio={0.3"], "is not valid YAML"),
    ],
)
def test_convert_refuses_conflicting_or_broken_options_before_any_work(tmp_path, monkeypatch, extra, message):
    from typer.testing import CliRunner

    from lrkv_flows.cli import app

    monkeypatch.setenv("LRKV_HOME", str(tmp_path / "home"))
    res = CliRunner().invoke(app, ["convert", "--model", "builtin:pydoc-llama", *extra])
    assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output
    assert not (tmp_path / "home").exists()


def test_bench_refuses_a_compiled_step_without_a_static_cache_or_a_warmup(tmp_path, monkeypatch):
    """``--compile`` needs ``--static`` and an eager warmup step, ``--keys`` rebuilt and/or rotated once
    each: exit 2 with the reason, before any work."""
    from typer.testing import CliRunner

    from lrkv_flows.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LRKV_HOME", str(tmp_path / "home"))
    bench = ["bench", "--model", "./missing", "--compile"]
    for args, why in [
        (bench, "--compile needs --static"),
        ([*bench, "--static", "--warmup", "0"], "--compile needs --warmup ≥ 1"),
        ([*bench[:3], "--keys", "rotated,post-rope"], "--keys takes rebuilt and/or rotated"),
        ([*bench[:3], "--keys", "rotated,rotated"], "each once (got 'rotated,rotated')"),
    ]:
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and why in " ".join(res.output.split()), (args, res.output)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def command_settings():
    """The process's environment and MLflow's log level restored after a command that ran in-process got as
    far as setting Prefect's settings for its run (they would reach later tests' subprocesses)."""
    import logging

    environ, mlflow_level = dict(os.environ), logging.getLogger("mlflow").level
    yield
    os.environ.clear()
    os.environ.update(environ)
    logging.getLogger("mlflow").setLevel(mlflow_level)


def test_bench_refuses_models_it_cannot_measure_before_prefect_starts(
    tmp_path, monkeypatch, command_settings
):
    """A compressed model given as the original, a directory that is not an lrkv model given as
    ``--compressed``, rotated keys of a QK-norm model, a context past the model's positions: one line and exit
    1, before any Prefect server."""
    from typer.testing import CliRunner

    from lrkv_core.conversion.pipeline import convert_data_free_dir
    from lrkv_flows.cli import app

    home = tmp_path / "home"
    monkeypatch.setenv("LRKV_HOME", str(home))
    llama, qwen3 = tiny_model_dir(tmp_path), tiny_model_dir(tmp_path, "qwen3")
    half = tmp_path / "half"
    convert_data_free_dir(str(llama), str(half), ratio=0.5)
    for args, why in [
        (["--model", str(half)], f"--model {half} is already an lrkv compressed model; --model takes the"),
        (["--model", str(llama), "--compressed", str(qwen3)], f"--compressed {qwen3} is not an lrkv"),
        (
            ["--model", str(qwen3), "--keys", "rotated"],
            "(its keys are normed per head before RoPE); --keys rebuilt",
        ),
        (["--model", str(llama), "--contexts", "16,120"], "passes " + str(llama) + "'s 128 positions: give"),
    ]:
        res = CliRunner().invoke(app, ["bench", "--contexts", "16", *args, "--batch", "1"])
        assert res.exit_code == 1 and why in " ".join(res.output.split()), (args, res.output)
    assert not (home / "prefect.db").exists() and not list(home.glob("logs/prefect-api-*"))


def test_ablate_and_search_refuse_a_missing_model_or_dataset_before_prefect_starts(
    tmp_path, monkeypatch, command_settings
):
    """What fails every conversion (no model, no data, a ratio that leaves every grid point at rank 0) ends
    ablate and search with one line before any Prefect server starts; a grid with one good point passes."""
    from typer.testing import CliRunner

    from lrkv_flows.cli import app
    from lrkv_tasks.recipes.convert_recipe import AblateRecipe
    from lrkv_tasks.recipes.preflight import check_ablation

    home = tmp_path / "home"
    monkeypatch.setenv("LRKV_HOME", str(home))
    model = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    missing = tmp_path / "missing"
    for args, why in [
        (["ablate", "--model", str(missing), "--dataset", data], f"model directory {missing} does not exist"),
        (["search", "--model", str(missing), "--dataset", data], f"model directory {missing} does not exist"),
        (["ablate", "--model", str(model), "--dataset", f"parquet:{missing}", "--ratios", "1"], "not found"),
        (["ablate", "--model", str(model), "--dataset", data, "--ratios", "0.001"], "leaves rank 0"),
    ]:
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 1 and why in " ".join(res.output.split()), (args, res.output)
    assert not (home / "prefect.db").exists() and not list(home.glob("logs/prefect-api-*"))
    grid = {"base": {"model": str(model), "calibration": {"dataset": data}}, "ratios": [0.001, 1.0]}
    check_ablation(AblateRecipe.model_validate(grid))  # the point at full rank passes: no error
