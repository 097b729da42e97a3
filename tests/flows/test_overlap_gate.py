"""The registry's quality gate inside a conversion: a model evaluated on its own calibration data is
registered as a candidate, never as champion; so is one further from the original than ``registry.max_kl``."""

from mlflow.tracking import MlflowClient

from lrkv_flows.convert import convert_flow
from lrkv_tasks.recipes.convert_recipe import load_recipe
from tests.support.models import tiny_model_dir, token_parquet


def _convert(tmp_path, calibration: str, evaluation: str, ratio: float, registry: dict | None = None):
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    recipe = load_recipe(
        None,
        {
            "model": str(tiny_model_dir(tmp_path)),
            "calibration": {"dataset": calibration, "n_samples": 8, "seq_len": 32, "batch_size": 4},
            "compression": {"ratio": ratio, "group_size": 2, "rank_multiple": 8},
            "eval": {
                "dataset": evaluation,
                "seq_len": 32,
                "max_windows": 4,
                "decode_prefix": 16,
                "decode_windows": 1,
            },
            "tracking": {"mlflow_uri": mlflow_uri, "experiment": "gate-test"},
            "registry": registry or {},
            "store": str(tmp_path / "store"),
        },
    )
    result = convert_flow(recipe)
    registered = result.registered
    assert registered["aliases"] == ["candidate"] and not registered["gate"]["passed"]
    assert "champion" not in MlflowClient(mlflow_uri).get_registered_model(registered["name"]).aliases
    return result


def test_evaluation_on_the_calibration_data_is_warned_about_and_never_champion(prefect_api, tmp_path):
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    # full rank: the perplexity does not rise, so only the overlap can keep the gate shut
    result = _convert(tmp_path, data, data, ratio=1.0)
    warning = f"warning: the evaluation data {data} overlaps the calibration data {data}"
    assert any(note.startswith(warning) for note in result.notes), result.notes
    base, compressed = result.eval.base.prefill_ppl, result.eval.compressed.prefill_ppl
    assert abs(compressed / base - 1) < 1e-3  # within the default 5% gate
    assert "overlaps the calibration data" in result.registered["gate"]["reason"]


def test_a_bound_on_the_kl_to_the_original_keeps_a_compressed_model_from_champion(prefect_api, tmp_path):
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=16, seq_len=32)}"
    # the perplexity bound is wide open: only the KL bound can keep the gate shut
    result = _convert(tmp_path, data + "[:50%]", data + "[50%:]", 0.5, {"max_ppl_rise": 10.0, "max_kl": 1e-6})
    kl = result.eval.compressed.kl_to_base
    assert kl > 1e-6
    assert (
        result.registered["gate"]["reason"]
        == f"KL to the original {kl:.5f} nats/token exceeds the gate's 1e-06"
    )
