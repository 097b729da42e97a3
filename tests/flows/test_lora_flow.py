"""LoRA recovery as a step of the convert flow: cached, resumable, logged to MLflow, unchanged KV cache."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from lrkv_core import load_compressed
from lrkv_core.evaluation.metrics import kv_bytes_per_token
from lrkv_flows.convert import convert_flow
from lrkv_tasks import lora as lora_task
from lrkv_tasks.lora import checkpoint_dir, lora_recover
from lrkv_tasks.recipes.convert_recipe import load_recipe
from tests.support.inputs import ids_for, max_diff
from tests.support.models import tiny_model_dir, token_parquet

LORA = {"steps": 6, "r": 4, "alpha": 8, "lr": 2e-2, "batch_size": 2, "seq_len": 32, "eval_every": 3,
        "eval_rows": 2, "checkpoint_every": 2}  # fmt: skip


class Interrupted(Exception):
    pass


def _recipe(tmp_path, **lora):
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=16, seq_len=32)}"
    return load_recipe(
        None,
        {
            "model": str(model_dir),
            "calibration": {"dataset": data, "n_samples": 8, "seq_len": 32, "batch_size": 4},
            "compression": {"ratio": 0.5, "group_size": 2, "rank_multiple": 2},
            "eval": {"seq_len": 32, "max_windows": 2, "decode_prefix": 16, "decode_windows": 1},
            "lora": LORA | lora,
            "registry": {"enabled": False},
            "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "lora"},
            "store": str(tmp_path / "store"),
            "out": str(tmp_path / "out"),
        },
    )


def _states(result) -> dict[str, str]:
    return {row["task"]: row["state"] for row in result.timings}


def test_lora_step_trains_logs_and_is_cached(prefect_api, tmp_path):
    recipe = _recipe(tmp_path)
    first = convert_flow(recipe)
    states = _states(first)
    assert states["lora_recover"] == "Completed" and "evaluate[before-lora]" in states
    lora = first.lora
    assert lora.meta["steps"] == 6 and lora.meta["steps_run"] == 6 and lora.meta["resumed_from"] is None
    assert lora.meta["dataset"].endswith("[:90%]") and lora.meta["eval_dataset"].endswith(
        "[90%:]"
    )  # disjoint
    assert first.compressed.uri == lora.uri  # evaluated, logged and exported: the recovered model
    assert not any(checkpoint_dir(recipe.store, "x").parent.iterdir())  # checkpoints removed once stored

    before, after = first.eval.before_lora, first.eval.compressed
    assert before.kv_bytes_per_token == after.kv_bytes_per_token  # the cache is unchanged
    assert first.before_lora.sha256 == lora.meta["source"]
    assert load_compressed(tmp_path / "out").config.lrkv == load_compressed(first.before_lora.uri).config.lrkv

    client = MlflowClient(tracking_uri=recipe.tracking.mlflow_uri)
    run_id = first.mlflow["run_id"]
    losses = client.get_metric_history(run_id, "lora_train_loss")
    assert sorted(m.step for m in losses) == [1, 2, 3, 4, 5, 6]
    assert sorted(m.step for m in client.get_metric_history(run_id, "lora_eval_loss")) == [0, 3, 6]
    metrics = client.get_run(run_id).data.metrics
    assert metrics["lora_steps"] == 6 and "before_lora_decode_ppl" in metrics
    assert metrics["before_lora_kl_base_compressed"] == before.kl_to_base > 0
    assert metrics["before_lora_top1_agreement"] == before.top1_agreement
    assert metrics["before_lora_kv_bytes_per_token"] == metrics["compressed_kv_bytes_per_token"]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"lora_loss_curve.png", "lora_history.json"} <= artifacts

    second = convert_flow(recipe)
    assert set(_states(second).values()) == {"Cached"}, second.timings


def test_the_distill_objective_trains_on_the_original_models_predictions(prefect_api, tmp_path):
    """``lora.objective: distill``: the flow hands the task the original model, whose predictions the steps
    fit (their losses are KL divergences to it, far below the text's NLL of about log 64); the model card
    says what was fitted; without the original the task refuses."""
    recipe = _recipe(tmp_path, objective="distill")
    result = convert_flow(recipe)
    assert _states(result)["lora_recover"] == "Completed"
    client = MlflowClient(tracking_uri=recipe.tracking.mlflow_uri)
    run_id = result.mlflow["run_id"]
    train = [m.value for m in client.get_metric_history(run_id, "lora_train_loss")]
    held_out = [m.value for m in client.get_metric_history(run_id, "lora_eval_loss")]  # the NLL
    assert len(train) == 6 and max(train) < 1.0 and min(held_out) > 3.0, (train, held_out)
    assert result.eval.before_lora.kl["kl"] < 1.0  # the scale of the train losses: KL to the original
    card = (tmp_path / "out" / "README.md").read_text()
    assert "fitting the original model's predictions" in card
    lora = result.recipe.lora.model_dump(mode="json")  # its datasets resolved
    with pytest.raises(ValueError, match="'distill' needs the original model"):
        lora_recover.fn(result.before_lora, lora, recipe.dtype, str(tmp_path / "s2"))


def test_a_flow_killed_in_training_resumes_from_the_checkpoint(prefect_api, tmp_path, monkeypatch):
    recipe = _recipe(tmp_path)
    real = lora_task.recover_dir

    def interrupted(*args, on_step, **kwargs):  # the real training, stopped after step 5 (checkpoint at 4)
        def stop(record):
            on_step(record)
            if record["step"] == 5:
                raise Interrupted

        return real(*args, **kwargs, on_step=stop)

    monkeypatch.setattr(lora_task, "recover_dir", interrupted)
    with pytest.raises(Interrupted):
        convert_flow(recipe)
    monkeypatch.setattr(lora_task, "recover_dir", real)
    resumed = convert_flow(recipe)
    states = _states(resumed)
    assert states["lora_recover"] == "Completed" and states["build_model"] == "Cached"
    meta = resumed.lora.meta
    assert meta["resumed_from"] == 4 and meta["steps_run"] == 2 and meta["steps"] == 6

    # an uninterrupted run of the same task elsewhere gives the same model, bit for bit
    lora = resumed.recipe.lora.model_dump(mode="json")  # its datasets resolved
    again = lora_recover.fn(resumed.before_lora, lora, recipe.dtype, str(tmp_path / "s2"))
    assert again.sha256 == resumed.lora.sha256
    a, b = load_compressed(again.uri), load_compressed(resumed.lora.uri)
    ids = ids_for(2, 16, vocab=64)
    with torch.no_grad():
        assert max_diff(a(ids).logits, b(ids).logits) == 0
    assert kv_bytes_per_token(a, ids) == kv_bytes_per_token(b, ids)


def test_cli_lora_steps_runs_the_recovery_and_keeps_a_quantized_cache(tmp_path):
    from tests.flows.test_cli import _convert_args, _lrkv

    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=20, seq_len=32)}"
    out = tmp_path / "out"
    lora = [
        "--lora-steps",
        "3",
        "--set",
        "lora.r=4",
        "--set",
        "lora.batch_size=2",
        "--set",
        "lora.seq_len=32",
    ]
    res = _lrkv(
        _convert_args(model_dir, data, out, "--ratio", "0.5", "--bits", "4", *lora), tmp_path / "home"
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = " ".join(res.stdout.split())
    assert "lora_recover" in text and "decode ppl before LoRA" in text and "LoRA steps (this run)" in text
    assert "KL before LoRA" in text and "top-1 agreement before LoRA" in text
    assert "LoRA trains on" in text and "steps: 3" in text  # the note and the recipe echoed
    assert "## LoRA recovery" in (out / "README.md").read_text()  # the model card says what was merged
    section = load_compressed(out).config.lrkv
    assert section["achieved_ratio"] == 0.5 and section["cache"] == {
        "name": "quantized",
        "bits": 4,
        "quant_group_size": None,
        "residual": 0,
    }
