"""The convert flow under Prefect's real API, logging to a real MLflow server."""

import pytest
import torch
from mlflow.tracking import MlflowClient

from lrkv_core import load_compressed, load_model
from lrkv_core.allocation import DEFAULT_ALLOCATOR, RankPlan
from lrkv_core.conversion.convert import plan_conversion
from lrkv_core.conversion.refine import RefineConfig
from lrkv_core.data.datasets import eval_windows, read_token_rows
from lrkv_flows.convert import convert_flow
from lrkv_tasks.recipes.convert_recipe import load_recipe
from lrkv_tasks.store.artifact_store import local_path
from tests.support.inputs import full_rank_kl_bound, max_diff
from tests.support.models import SHARED, tiny_model_dir, token_parquet

JOINT = "collect_statistics[attention_gram,gram,output_fisher]"


def _recipe(model, data, store, out, mlflow_uri, ratio=1.0, group_size=2, **extra):
    return load_recipe(
        None,
        {
            "model": str(model),
            "calibration": {"dataset": data, "n_samples": 8, "seq_len": 32, "batch_size": 4},
            "compression": {"ratio": ratio, "group_size": group_size, "rank_multiple": 8},
            "eval": {
                "dataset": data,
                "seq_len": 32,
                "max_windows": 6,
                "decode_prefix": 16,
                "decode_windows": 3,
            },
            "tracking": {"mlflow_uri": mlflow_uri, "experiment": "flow-test"},
            "store": str(store),
            "out": str(out),
            **extra,
        },
    )


def _task_runs(flow_run_id: str) -> list:
    """The task runs of a flow run, from the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC,
            limit=200,
        )


def test_convert_flow_runs_logs_and_resumes_from_cache(prefect_api, mlflow_server, tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    recipe = _recipe(model_dir, data, tmp_path / "store", tmp_path / "out", mlflow_server)

    first = convert_flow(recipe)
    states = {row["task"]: row["state"] for row in first.timings}
    assert set(states.values()) == {"Completed"}, states
    expected = {
        JOINT,  # the statistics the decomposition reads, in one pass
        "pick_statistic[gram]",
        "decompose_layer[1]",
        "summarize_layer[1]",
        "build_model",
        "log_run",
    }
    assert expected | {"export_model"} <= set(states)
    assert list(states)[-1] == "export_model"  # exported last: a failed step leaves no complete-looking --out
    seconds = {row["task"]: row["seconds"] for row in first.timings}
    assert all(s is not None and s > 0 for s in seconds.values()), seconds  # each task's own run time
    peaks = {row["task"]: row["peak_rss_bytes"] for row in first.timings}
    assert peaks[JOINT] > 50 * 2**20 and peaks["build_model"] > 50 * 2**20, peaks
    assert peaks["summarize_layer[1]"] is None  # a step that loads no model logs no peak
    # in one process the original's evaluation waits for the built model instead of delaying it
    flow_run = MlflowClient(mlflow_server).get_run(first.mlflow["run_id"]).data.tags["lrkv.prefect_flow_run"]
    runs = _task_runs(flow_run)
    built_at = max(r.end_time for r in runs if r.name.startswith("build_model"))
    evaluations = [r for r in runs if r.name.startswith("evaluate-")]
    assert len(evaluations) == 2 and all(r.start_time >= built_at for r in evaluations), runs

    # the exported model is exact at full rank
    base, _ = load_model(model_dir)
    compressed = load_compressed(tmp_path / "out")
    ids = read_token_rows(data.split(":", 1)[1])[:2]
    with torch.no_grad():
        assert (base(ids).logits - compressed(ids).logits).abs().max() < 1e-4
        windows = eval_windows(data, None, seq_len=32, max_windows=6)
        base_logits = base(windows).logits
        kl_bound = full_rank_kl_bound(base_logits, max_diff(base_logits, compressed(windows).logits))

    run = MlflowClient(tracking_uri=mlflow_server).get_run(first.mlflow["run_id"])
    m = run.data.metrics
    for key in (
        "base_prefill_ppl",
        "compressed_prefill_ppl",
        "base_decode_ppl",
        "compressed_decode_ppl",
        "target_ratio",
        "achieved_ratio",
        "base_kv_bytes_per_token",
        "compressed_kv_bytes_per_token",
    ):
        assert key in m, key
    assert m["achieved_ratio"] == 1.0 and abs(m["base_prefill_ppl"] - m["compressed_prefill_ppl"]) < 1e-3
    assert m["kl_base_compressed"] <= kl_bound and m["top1_agreement"] == 1.0  # full rank: same distributions
    assert run.data.params["fingerprint.model"] == first.model.sha256
    assert run.data.params["recipe.compression.allocator.name"] == DEFAULT_ALLOCATOR == "kl"
    assert "version.transformers" in run.data.params
    artifacts = {a.path for a in MlflowClient(tracking_uri=mlflow_server).list_artifacts(run.info.run_id)}
    assert {"rank_plan.json", "rank_plan_heatmap.png", "eval.json", "recipe.json"} <= artifacts

    # an identical re-run recomputes nothing
    second = convert_flow(recipe)
    assert {row["state"] for row in second.timings} == {"Cached"}, second.timings
    assert all(row["seconds"] is not None for row in second.timings)  # a cache hit's own lookup time
    assert all(row["peak_rss_bytes"] is None for row in second.timings)  # nothing was computed
    assert second.mlflow["run_id"] == first.mlflow["run_id"]

    # a deleted export is redone; everything upstream stays cached
    import shutil

    shutil.rmtree(tmp_path / "out")
    third = convert_flow(recipe)
    states = {row["task"]: row["state"] for row in third.timings}
    assert states.pop("export_model") == "Completed" and set(states.values()) == {"Cached"}
    assert (tmp_path / "out" / "model.safetensors").is_file()

    # another ratio and a Fisher-based allocator reuse calibration, stats and factors
    comp = load_recipe(None, {"compression.ratio": 0.5, "compression.allocator": "fisher-greedy"}).compression
    comp = comp.model_copy(update={"group_size": 2, "rank_multiple": 8})
    half = convert_flow(recipe.model_copy(update={"compression": comp}))
    states = {row["task"]: row["state"] for row in half.timings}
    assert states[JOINT] == "Cached" and states["decompose_layer[0]"] == "Cached"
    assert states["collect_statistic[fisher]"] == "Completed" and states["plan_ranks"] == "Completed"
    assert states["summarize_layer[0]"] == "Completed"  # the error curves are new features
    assert half.plan.meta["achieved_ratio"] == 0.5

    # kl's statistic reads the factors: collected after them, from the cached decomposition; kl's plan is then
    # refined on the measured KL by default, a task of its own, and the model is built from the refined plan
    comp = load_recipe(None, {"compression.ratio": 0.5, "compression.allocator": "kl"}).compression
    comp = comp.model_copy(update={"group_size": 2, "rank_multiple": 8})
    measured = convert_flow(recipe.model_copy(update={"compression": comp}))
    states = {row["task"]: row["state"] for row in measured.timings}
    assert states["decompose_layer[0]"] == "Cached"
    assert states["collect_statistic[kl_response]"] == "Completed"
    assert "collect_statistic[fisher]" not in states and states["plan_ranks"] == "Completed"
    assert states["refine_plan"] == "Completed" and states["build_model"] == "Completed"
    objective = measured.plan.meta["objective"]  # the default: the loss of the rows' own next tokens
    kept = measured.plan.meta[objective]  # its measured value for each kept plan, the allocator's first
    assert objective == "nll" and kept == sorted(kept, reverse=True) and kept[0] > 0
    assert measured.plan.meta["heatmap"]
    assert 0.5 - 8 / 64 < measured.plan.meta["achieved_ratio"] <= 0.5
    run = MlflowClient(mlflow_server).get_run(measured.mlflow["run_id"])
    metrics = run.data.metrics
    assert (metrics["refine_nll_before"], metrics["refine_nll_after"]) == (kept[0], kept[-1])

    # refine_steps 0: the allocator's plan, from cache
    unrefined = convert_flow(
        recipe.model_copy(update={"compression": comp.model_copy(update={"refine": RefineConfig(steps=0)})})
    )
    states = {row["task"]: row["state"] for row in unrefined.timings}
    assert states["plan_ranks"] == "Cached" and "refine_plan" not in states
    assert "kl" not in unrefined.plan.meta and unrefined.plan.meta["achieved_ratio"] == 0.5


def test_the_flow_and_the_in_memory_api_build_the_same_model(prefect_api, tmp_path):
    """One step graph, two executors: the flow's tasks (statistics in 3 shards, the default allocator's
    refinement) and plan_conversion in memory on the flow's calibration rows give the same plan and model."""
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    recipe = _recipe(
        model_dir, data, tmp_path / "store", tmp_path / "out", f"sqlite:///{tmp_path / 'm.db'}", 0.5
    )
    recipe = recipe.model_copy(update={"calibration": recipe.calibration.model_copy(update={"shards": 3})})
    result = convert_flow(recipe)
    assert "merge_statistic[gram]" in {row["task"] for row in result.timings}
    rows = read_token_rows(local_path(result.calibration.uri))
    model, _ = load_model(model_dir)
    config = recipe.compression.to_config()
    conversion = plan_conversion(model, rows, config, batch_size=recipe.calibration.batch_size)
    assert "refine" in conversion.graph.names
    assert conversion.plan.ranks == RankPlan.load(local_path(result.plan.uri)).ranks
    conversion.apply(model)
    ids = rows[:4]
    with torch.no_grad():
        assert max_diff(model(ids).logits, load_compressed(tmp_path / "out")(ids).logits) < 1e-4


def test_the_flow_calibrates_in_bfloat16_as_the_in_memory_api_does(prefect_api, tmp_path):
    """``calibration.precision: bfloat16`` reaches every pass of the flow (the joint statistics, the KL
    response, the refinement): its model is the in-memory conversion's in bfloat16, not the float32 one."""
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    recipe = _recipe(
        model_dir, data, tmp_path / "store", tmp_path / "out", f"sqlite:///{tmp_path / 'm.db'}", 0.5
    )
    cal = recipe.calibration.model_copy(update={"precision": "bfloat16"})
    result = convert_flow(recipe.model_copy(update={"calibration": cal}))
    assert {JOINT, "collect_statistic[kl_response]", "refine_plan"} <= {row["task"] for row in result.timings}
    rows = read_token_rows(local_path(result.calibration.uri))
    built = load_compressed(tmp_path / "out")
    ids = rows[:4]
    gaps = {}
    for precision in ("bfloat16", "float32"):
        model, _ = load_model(model_dir)
        conversion = plan_conversion(
            model, rows, recipe.compression.to_config(), batch_size=cal.batch_size, precision=precision
        )
        if precision == "bfloat16":
            assert conversion.plan.ranks == RankPlan.load(local_path(result.plan.uri)).ranks
        conversion.apply(model)
        with torch.no_grad():
            gaps[precision] = max_diff(model(ids).logits, built(ids).logits)
    assert gaps["bfloat16"] < 1e-4 < gaps["float32"], gaps


def test_the_flow_builds_latents_of_rotated_keys_as_the_in_memory_api_does(prefect_api, tmp_path):
    """``compression.key_latents: rotated`` from a recipe, through Prefect: the flow's model reads rotated
    keys and equals the in-memory conversion's on the same rows."""
    from lrkv_core.model.attention_rotated import RotatedKeyAttention

    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    recipe = _recipe(
        model_dir, data, tmp_path / "store", tmp_path / "out", f"sqlite:///{tmp_path / 'm.db'}", 0.5
    )
    options = {"ratio": 0.5, "allocator": "uniform", "key_latents": "rotated"}
    options = {f"compression.{name}": value for name, value in options.items()}
    comp = load_recipe(None, options).compression.model_copy(update={"group_size": 2, "rank_multiple": 8})
    result = convert_flow(recipe.model_copy(update={"compression": comp}))
    built = load_compressed(tmp_path / "out")
    assert built.config.lrkv["rope"] == "rotated-keys"
    assert isinstance(built.model.layers[0].self_attn, RotatedKeyAttention)
    rows = read_token_rows(local_path(result.calibration.uri))
    model, _ = load_model(model_dir)
    conversion = plan_conversion(model, rows, comp.to_config(), batch_size=recipe.calibration.batch_size)
    conversion.apply(model)
    with torch.no_grad():
        assert max_diff(model(rows[:4]).logits, built(rows[:4]).logits) < 1e-4


def test_convert_flow_on_stories260k_is_exact_at_full_rank(prefect_api, tmp_path):
    model_dir = SHARED / "models" / "stories260k"
    if not model_dir.is_dir():
        pytest.skip(f"shared assets not found at {SHARED}")
    calib = f"parquet:{SHARED / 'data' / 'stories260k' / 'calib.parquet'}"
    valid = f"parquet:{SHARED / 'data' / 'stories260k' / 'valid.parquet'}"
    recipe = load_recipe(
        None,
        {
            "model": str(model_dir),
            "calibration": {"dataset": calib, "n_samples": 32, "seq_len": 256},
            "compression": {"ratio": 1.0, "group_size": 2, "rank_multiple": 8},
            "eval": {
                "dataset": valid,
                "seq_len": 256,
                "max_windows": 8,
                "decode_prefix": 128,
                "decode_windows": 2,
            },
            "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
            "store": str(tmp_path / "store"),
            "out": str(tmp_path / "out"),
        },
    )
    result = convert_flow(recipe)
    base, comp = result.eval.base, result.eval.compressed
    assert abs(base.prefill["nll"] - comp.prefill["nll"]) < 1e-5
    assert abs(base.decode["nll"] - comp.decode["nll"]) < 1e-5
    original, _ = load_model(model_dir)
    compressed = load_compressed(tmp_path / "out")
    bos = torch.tensor([[1]])
    assert torch.equal(
        original.generate(bos, max_new_tokens=40, do_sample=False),
        compressed.generate(bos, max_new_tokens=40, do_sample=False),
    )
