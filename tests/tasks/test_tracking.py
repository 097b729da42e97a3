import json

from mlflow.tracking import MlflowClient

from lrkv_tasks.tracking.mlflow_runs import log_conversion


def _log(uri):
    return log_conversion(
        tracking_uri=uri,
        experiment="lrkv-test",
        run_name="t",
        params={"recipe.compression.ratio": 0.5},
        metrics={"achieved_ratio": 0.5, "compressed_prefill_ppl": 12.5},
        json_artifacts={"rank_plan.json": {"ranks": {"k": [[8]], "v": [[8]]}}},
        file_artifacts={},
        tags={"lrkv.method": "palu"},
    )


def test_log_to_real_mlflow_server(mlflow_server):
    ids = _log(mlflow_server)
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(ids["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["compressed_prefill_ppl"] == 12.5
    assert run.data.params["recipe.compression.ratio"] == "0.5"
    assert [a.path for a in client.list_artifacts(ids["run_id"])] == ["rank_plan.json"]
    local = client.download_artifacts(ids["run_id"], "rank_plan.json")
    assert json.loads(open(local).read())["ranks"]["k"] == [[8]]


def test_embedded_default_is_sqlite_under_lrkv_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LRKV_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    ids = _log(None)
    assert ids["tracking_uri"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=ids["tracking_uri"])
    assert client.get_run(ids["run_id"]).data.metrics["achieved_ratio"] == 0.5
    assert (tmp_path / "mlartifacts").is_dir() and not (tmp_path / "mlruns").exists()
