"""A model evaluated on its own calibration data is registered as a candidate, never as champion."""

from mlflow.tracking import MlflowClient

from lrkv_flows.convert import convert_flow
from lrkv_tasks.recipes.convert_recipe import load_recipe
from tests.support.models import tiny_model_dir, token_parquet


def test_evaluation_on_the_calibration_data_is_warned_about_and_never_champion(prefect_api, tmp_path):
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    recipe = load_recipe(
        None,
        {
            "model": str(tiny_model_dir(tmp_path)),
            "calibration": {"dataset": data, "n_samples": 8, "seq_len": 32, "batch_size": 4},
            # full rank: the perplexity does not rise, so only the overlap can keep the gate shut
            "compression": {"ratio": 1.0, "group_size": 2, "rank_multiple": 8},
            "eval": {
                "dataset": data,
                "seq_len": 32,
                "max_windows": 4,
                "decode_prefix": 16,
                "decode_windows": 1,
            },
            "tracking": {"mlflow_uri": mlflow_uri, "experiment": "overlap-test"},
            "store": str(tmp_path / "store"),
        },
    )
    result = convert_flow(recipe)
    warning = f"warning: the evaluation data {data} overlaps the calibration data {data}"
    assert any(note.startswith(warning) for note in result.notes), result.notes
    base, compressed = result.eval.base.prefill_ppl, result.eval.compressed.prefill_ppl
    assert abs(compressed / base - 1) < 1e-3  # within the default 5% gate
    registered = result.registered
    assert registered["aliases"] == ["candidate"] and not registered["gate"]["passed"]
    assert "overlaps the calibration data" in registered["gate"]["reason"]
    client = MlflowClient(mlflow_uri)
    assert "champion" not in client.get_registered_model(registered["name"]).aliases
