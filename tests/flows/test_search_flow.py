"""The search flow on shakespeare-llama: its winner against a brute-force ablation of the same grid, its
registration and export, a rerun from the cache, and an impossible budget."""

import pytest
from mlflow.tracking import MlflowClient

from lrkv_flows.ablate import ablate_flow
from lrkv_flows.deploy import deploy, nightly_search_flow
from lrkv_flows.search import search_flow
from lrkv_tasks.recipes.convert_recipe import AblateRecipe
from lrkv_tasks.recipes.search_recipe import SearchRecipe
from tests.support.models import SHARED

MODEL = SHARED / "models" / "shakespeare-llama"
DATA = SHARED / "data" / "shakespeare"
RATIOS = [0.25, 0.5, 0.75]
CACHES = [{"name": "quantized", "bits": 4}, "dense"]
BUDGET = 0.01

pytestmark = pytest.mark.skipif(not MODEL.is_dir(), reason=f"{MODEL} is not there (../shared is absent)")


def _base(tmp_path, **update) -> dict:
    return {
        "model": str(MODEL),
        "calibration": {"dataset": f"text:{DATA / 'train.txt'}", "n_samples": 16, "seq_len": 64},
        "compression": {"group_size": 2, "allocator": "uniform"},
        "eval": {
            "dataset": f"text:{DATA / 'valid.txt'}",  # held out: disjoint from the calibration rows
            "seq_len": 64,
            "max_windows": 4,
            "decode_prefix": 32,
            "decode_windows": 2,
        },
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "search-test"},
        "store": str(tmp_path / "store"),
        "out": str(tmp_path / "found"),
    } | update


@pytest.fixture(scope="module")
def searched(prefect_api, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("search")
    recipe = SearchRecipe.model_validate(
        {
            "base": _base(tmp_path),
            "search": {"max_ppl_rise": BUDGET, "ratios": RATIOS, "caches": CACHES, "allocators": ["uniform"]},
        }
    )
    return tmp_path, recipe, search_flow(recipe, str(tmp_path / "summary"))


def test_the_winner_is_no_larger_than_any_grid_point_within_budget(searched):
    tmp_path, recipe, result = searched
    best = result["best"]
    assert best["ppl_rise_rel"] <= BUDGET and best.get("error") is None
    best_ratio = best["kv_bytes_per_token"] / best["base_kv_bytes_per_token"]
    within = 0
    for i, arm in enumerate(recipe.arms()):  # the brute force: every ratio of every arm, by the ablation flow
        base = recipe.base.model_copy(update={"compression": recipe.candidate(arm, 1.0), "out": None})
        grid = AblateRecipe(
            base=base, decompositions=["whitened"], group_sizes=[2], allocators=["uniform"], ratios=RATIOS
        )
        for row in ablate_flow(grid, str(tmp_path / f"ablation-{i}"))["rows"]:
            assert row.get("error") is None
            if row["prefill_ppl"] / row["base_prefill_ppl"] - 1 <= BUDGET:
                within += 1
                assert best_ratio <= row["kv_bytes_ratio"], (best, row)
    assert within >= 2  # the comparison is not vacuous
    cost = result["cost"]
    assert cost["conversions"] == len(result["rows"]) < cost["grid_points"] == len(CACHES) * len(RATIOS)
    assert {r["arm"] for r in result["front"]} <= {r["arm"] for r in result["rows"]}
    assert any(
        r["on_front"] and (r["arm"], r["ratio"]) == (best["arm"], best["ratio"]) for r in result["rows"]
    )


def test_the_winner_is_registered_exported_and_logged(searched):
    tmp_path, recipe, result = searched
    winner = result["winner"]
    reg = winner.registered
    assert reg["aliases"][0] == "candidate"
    assert ("champion" in reg["aliases"]) == reg["gate"]["passed"]
    comp = winner.recipe.compression
    assert (
        comp.ratio == result["best"]["ratio"]
        and comp.cache.to_dict()
        == recipe.candidate(result["best"]["arm"], result["best"]["ratio"]).cache.to_dict()
    )
    assert (tmp_path / "found" / "config.json").is_file()
    client = MlflowClient(tracking_uri=recipe.base.tracking.mlflow_uri)
    version = client.get_model_version_by_alias(reg["name"], "candidate")
    assert version.run_id == winner.mlflow["run_id"]
    arts = {a.path for a in client.list_artifacts(result["summary"]["mlflow"]["run_id"])}
    assert {"search.csv", "search.md", "search_pareto.png", "search_points.json", "pareto_front.json"} <= arts
    assert "Pareto front" in result["summary"]["markdown"]


def test_a_rerun_is_served_from_the_cache(searched):
    tmp_path, recipe, result = searched
    again = search_flow(recipe, str(tmp_path / "summary-again"))
    assert again["best"] == result["best"]
    assert again["cost"]["tasks_computed"] == 0 and again["cost"]["evaluations"] == 0
    assert again["cost"]["tasks_cached"] > 0
    assert {row["state"] for row in again["winner"].timings} == {"Cached"}


def test_an_impossible_budget_fails_clearly_and_registers_nothing(searched):
    tmp_path, recipe, _ = searched
    base = _base(tmp_path, registry={"name": "lrkv-search-impossible"})
    impossible = SearchRecipe.model_validate(
        {
            "base": base,
            "search": {"max_ppl_rise": 0.0, "ratios": [0.25], "caches": ["dense"], "allocators": ["uniform"]},
        }
    )
    with pytest.raises(ValueError, match="no candidate within the budget .* nothing registered"):
        search_flow(impossible, str(tmp_path / "summary-impossible"))
    client = MlflowClient(tracking_uri=recipe.base.tracking.mlflow_uri)
    assert client.search_model_versions("name='lrkv-search-impossible'") == []


def test_a_nightly_deployment_searches_instead_of_converting(searched):
    from prefect.client.orchestration import get_client

    _, recipe, _ = searched
    ids = deploy(recipe.base, [str(MODEL)], cron="15 3 * * *", pool="lrkv-search-pool", search=recipe)
    assert set(ids) == {
        "lrkv-convert/convert",
        "lrkv-evaluate/evaluate",
        "lrkv-bench/bench",
        "lrkv-nightly-search/nightly-search",
    }
    with get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name("lrkv-nightly-search/nightly-search")
    assert nightly.entrypoint == "lrkv_flows.deploy.nightly_search_flow"
    assert [s.schedule.cron for s in nightly.schedules] == ["15 3 * * *"]
    assert nightly.parameters["models"] == [str(MODEL)]
    assert SearchRecipe.model_validate(nightly.parameters["recipe"]) == recipe


def test_the_nightly_search_flow_registers_each_model_s_winner(searched):
    _, recipe, result = searched
    done = nightly_search_flow([str(MODEL)], recipe)  # every step served from the test's cache
    assert done[str(MODEL)]["registered"]["name"] == result["winner"].registered["name"]
    assert done[str(MODEL)]["mlflow"]["run_id"] == result["winner"].mlflow["run_id"]
