"""The ablation flow on a tiny model: every grid point converted, one table, plot and MLflow run."""

import csv

import torch
from mlflow.tracking import MlflowClient

from lrkv_core import load_model
from lrkv_core.data.datasets import eval_windows
from lrkv_flows.ablate import ablate_flow
from lrkv_tasks.recipes.convert_recipe import AblateRecipe
from tests.support.inputs import full_rank_kl_bound
from tests.support.models import tiny_model_dir, token_parquet


def test_ablation_grid_table_plot_and_run(prefect_api, tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    recipe = AblateRecipe.model_validate(
        {
            "base": {
                "model": str(model_dir),
                "calibration": {"dataset": data, "n_samples": 8, "seq_len": 32},
                "compression": {"rank_multiple": 8},
                "eval": {
                    "dataset": data,
                    "seq_len": 32,
                    "max_windows": 4,
                    "decode_prefix": 16,
                    "decode_windows": 2,
                },
                "tracking": {"mlflow_uri": uri, "experiment": "ablate-test"},
                "store": str(tmp_path / "store"),
            },
            "decompositions": ["plain", "whitened"],
            "group_sizes": [2],
            "allocators": ["uniform"],
            "ratios": [1.0, 0.5],
        }
    )
    result = ablate_flow(recipe, str(tmp_path / "ablation"))
    base, _ = load_model(model_dir)
    with torch.no_grad():  # full rank: logits agree within 1e-4 (the exactness tests' tolerance)
        kl_bound = full_rank_kl_bound(base(eval_windows(data, None, seq_len=32, max_windows=4)).logits, 1e-4)
    rows = result["rows"]
    assert [(r["decomposition"], r["ratio"]) for r in rows] == [
        ("plain", 1.0),
        ("plain", 0.5),
        ("whitened", 1.0),
        ("whitened", 0.5),
    ]
    for r in rows:
        assert r.get("error") is None and r["achieved_ratio"] == r["ratio"]
        if r["ratio"] == 1.0:  # full rank: the original model's distributions
            assert r["kl"] <= kl_bound and r["top1_agreement"] == 1.0
            assert abs(r["prefill_ppl"] - r["base_prefill_ppl"]) < 1e-3
        else:
            assert r["kl"] > 0 and r["prefill_ppl"] != r["base_prefill_ppl"]
    table = list(csv.DictReader(open(tmp_path / "ablation" / "ablation.csv")))
    assert len(table) == 4 and table[1]["decomposition"] == "plain"
    markdown = (tmp_path / "ablation" / "ablation.md").read_text()
    assert "Best at ratio 1.0" in markdown and "Best at ratio 0.5" in markdown
    assert (tmp_path / "ablation" / "ablation_ppl_vs_ratio.png").stat().st_size > 10_000
    client = MlflowClient(tracking_uri=uri)
    arts = {a.path for a in client.list_artifacts(result["mlflow"]["run_id"])}
    assert {"ablation.csv", "ablation.md", "ablation_ppl_vs_ratio.png", "ablation_rows.json"} <= arts
