"""The bench flow under Prefect's real API: serving figures measured on this machine for an original model
and its compressed versions, logged to a real MLflow server, and served from the cache on a re-run."""

from __future__ import annotations

import logging
import math

import pytest
from mlflow.tracking import MlflowClient

from lrkv_core.evaluation import serving
from lrkv_flows.bench import bench_flow
from lrkv_tasks.recipes.convert_recipe import TrackingRecipe
from tests.support.models import tiny_model_dir


def test_bench_flow_measures_logs_and_resumes_from_cache(prefect_api, mlflow_server, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lrkv")
    model_dir = tiny_model_dir(tmp_path)
    tracking = TrackingRecipe(mlflow_uri=mlflow_server, experiment="bench-test")
    kwargs = dict(
        ratios=[0.5], bits=[4], contexts=[48, 16], batch=2, steps=3, warmup=1, tracking=tracking,
        store=str(tmp_path / "store"),
    )  # fmt: skip
    first = bench_flow(str(model_dir), **kwargs)
    assert {row["state"] for row in first["timings"]} == {"Completed"}, first["timings"]
    assert first["device"].startswith("cpu: ") and first["contexts"] == [16, 48]
    rows = {(r["model"], r["context"]): r for r in first["rows"]}
    assert set(rows) == {(m, c) for m in ("original", "lrkv r0.5", "lrkv r0.5 4-bit") for c in (16, 48)}
    for r in rows.values():  # measured, not constants
        assert r["decode_ms"] > 0 and r["prefill_tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert r["tokens_per_s"] == r["batch"] / r["decode_ms"] * 1e3
    assert len({r["decode_ms"] for r in rows.values()}) > 1
    assert all(rows["original", c]["decode_over_original"] == 1.0 for c in (16, 48))
    # the cache bytes come from the cache's tensors: half width holds about half, 4-bit latents far less
    dense = rows["original", 48]["kv_bytes_per_token"]
    half, quant = (
        rows["lrkv r0.5", 48]["kv_bytes_per_token"],
        rows["lrkv r0.5 4-bit", 48]["kv_bytes_per_token"],
    )
    assert half < 0.6 * dense and quant < 0.5 * half
    # the serving trade: the compressed models fit larger batches in the original's cache at 48 tokens
    trade = {r["model"]: r for r in first["serving"]["rows"]}
    assert first["serving"]["context"] == 48 and trade["original"]["batch"] == 2
    assert trade["lrkv r0.5"]["batch"] == serving.batch_within_budget(
        first["serving"]["cache_budget_bytes"], half, 48
    )
    assert 2 < trade["lrkv r0.5"]["batch"] < trade["lrkv r0.5 4-bit"]["batch"]
    assert any(row["task"].startswith("bench_model[lrkv r0.5 4-bit, batch ") for row in first["timings"])
    # the attention alone: every model at every context, measured against one copy bandwidth per model
    kernel = {(r["model"], r["context"]): r for r in first["kernel"]}
    assert set(kernel) == set(rows)
    assert {r["path"] for r in kernel.values()} == {"torch sdpa", "torch unfused"}  # what runs on the CPU
    for r in kernel.values():
        assert r["time_ms"] > 0 and r["copy_gb_per_s"] > 0 and r["gflop_per_s"] > 0
        assert math.isclose(r["fraction_of_copy"], r["achieved_gb_per_s"] / r["copy_gb_per_s"])
        assert r["matmul_gflop_per_s"] > 0
        assert math.isclose(r["fraction_of_matmul"], r["gflop_per_s"] / r["matmul_gflop_per_s"])
    assert len({r["time_ms"] for r in kernel.values()}) > 1
    # each point is in the log as soon as it is measured (a run cut short keeps the figures it reached)
    lines = [r.getMessage() for r in caplog.records if r.name == "lrkv"]
    half48 = rows["lrkv r0.5", 48]
    assert any(
        line.startswith(f"bench lrkv r0.5: context 48 × batch 2: decode {half48['decode_ms']:.3f} ms/step")
        for line in lines
    ), lines
    ratio = half48["decode_over_original"]
    assert f"decode step of lrkv r0.5 at 48 tokens, batch 2: {ratio:.2f}× the original's" in lines, lines
    q = trade["lrkv r0.5 4-bit"]
    serving_line = (
        f"serving lrkv r0.5 4-bit within the original's cache at 48 tokens: batch {q['batch']}, "
        f"{q['tokens_per_s']:.1f} tokens/s ({q['tokens_per_s_over_original']:.2f}× the original's)"
    )
    assert serving_line in lines, lines
    # one model whole (its decode grid, then its batch at the budget) before the next is measured
    order = [row["task"] for row in first["timings"] if row["task"].startswith("bench_model[")]
    assert order[1:3] == [
        "bench_model[lrkv r0.5, batch 2]",
        f"bench_model[lrkv r0.5, batch {trade['lrkv r0.5']['batch']}]",
    ]
    k48 = kernel["original", 48]
    assert f"kernel original: context 48 × batch 2, torch sdpa: {k48['time_ms'] * 1e3:.1f} µs" in "\n".join(
        lines
    )
    assert (
        kernel["lrkv r0.5 4-bit", 48]["bytes"]
        < kernel["lrkv r0.5", 48]["bytes"]
        < kernel["original", 48]["bytes"]
    )

    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(first["mlflow"]["run_id"])
    assert run.data.tags["lrkv.kind"] == "bench" and run.data.tags["lrkv.device"] == first["device"]
    assert run.data.metrics["lrkv_r0.5.decode_ms.ctx48"] == rows["lrkv r0.5", 48]["decode_ms"]
    assert "lrkv_r0.5_4-bit.serving_tokens_per_s_over_original" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"bench.json", "bench_decode.json", "bench_serving.json", "bench_kernel.json"} <= artifacts
    assert "| lrkv r0.5 4-bit | 48 |" in first["markdown"]
    assert "| lrkv r0.5 4-bit | 48 | torch unfused |" in first["markdown"]
    assert "lrkv_r0.5.kernel_fraction_of_copy.ctx48" in run.data.metrics
    assert "lrkv_r0.5.kernel_fraction_of_matmul.ctx48" in run.data.metrics

    second = bench_flow(str(model_dir), **kwargs)  # the same machine: every measurement from the store
    assert {row["state"] for row in second["timings"]} == {"Cached"}, second["timings"]
    assert second["rows"] == first["rows"] and second["serving"] == first["serving"]
    assert second["kernel"] == first["kernel"]

    # over static caches: the decode points are measured again (their own cache keys), the conversions reused
    static = bench_flow(str(model_dir), **kwargs | {"contexts": [16], "static": True})
    states = {row["task"]: row["state"] for row in static["timings"]}
    assert {s for task, s in states.items() if task.startswith("bench_model[")} == {"Completed"}, states
    assert {s for task, s in states.items() if task.startswith("bench_convert[")} == {"Cached"}, states
    assert static["static"] and not static["compiled"] and "static caches" in static["markdown"]
    for r in static["rows"]:  # preallocated for 16 tokens + 4 decode steps: more than 16 tokens. worth
        assert r["decode_ms"] > 0 and r["kv_bytes_per_token"] > rows[r["model"], 16]["kv_bytes_per_token"]


def test_batch_within_budget() -> None:
    assert serving.batch_within_budget(1000, 10.0, 10) == 10
    assert serving.batch_within_budget(999, 10.0, 10) == 9
    assert serving.batch_within_budget(5, 10.0, 10) == 1  # never below one row
    # static caches of SmolLM2 at 4,096 tokens (float32; the original and 0.5 width): two rows of the latents
    # take the original's bytes exactly, but the 240 bytes of counters each cache holds once count per row
    original, half = 189_204_720, 94_602_480
    assert 2 * half > original and 2 * (half - 240) + 240 == original
    assert serving.batch_within_budget(original, half / 4096, 4096) == 2
    assert serving.batch_within_budget(0.999 * original, half / 4096, 4096) == 1


def test_bench_flow_measures_data_free_versions_with_rotated_keys(prefect_api, mlflow_server, tmp_path):
    """``keys``: beside the rebuilt-keys version, one caching latents of the keys after RoPE, which holds no
    positions and whose step rebuilds no key (fewer FLOPs for the same ranks)."""
    model_dir = tiny_model_dir(tmp_path)
    tracking = TrackingRecipe(mlflow_uri=mlflow_server, experiment="bench-test")
    result = bench_flow(
        str(model_dir), ratios=[0.5], keys=["rebuilt", "rotated"], contexts=[24], batch=2, steps=2, warmup=1,
        tracking=tracking, store=str(tmp_path / "store"),
    )  # fmt: skip
    assert result["keys"] == ["rebuilt", "rotated"]
    rows = {r["model"]: r for r in result["rows"]}
    assert set(rows) == {"original", "lrkv r0.5", "lrkv r0.5 rotated keys"}
    assert rows["lrkv r0.5 rotated keys"]["decode_ms"] > 0
    assert rows["lrkv r0.5 rotated keys"]["kv_bytes_per_token"] < rows["lrkv r0.5"]["kv_bytes_per_token"]
    kernel = {r["model"]: r for r in result["kernel"]}
    assert kernel["lrkv r0.5 rotated keys"]["flops"] < kernel["lrkv r0.5"]["flops"]
    assert kernel["lrkv r0.5 rotated keys"]["path"] == "torch unfused"
    assert "| lrkv r0.5 rotated keys | 24 |" in result["markdown"]
    with pytest.raises(ValueError, match="keys must be distinct among rebuilt, rotated"):
        bench_flow(str(model_dir), keys=["after-rope"], tracking=tracking, store=str(tmp_path / "store"))
