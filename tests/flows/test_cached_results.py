"""Cached task results under the real Prefect API: JSON only, checked before use, rebuilt when stale."""

import json
import shutil
import time
from pathlib import Path

from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter
from prefect.results import ResultRecord, ResultRecordMetadata
from prefect.serializers import PickleSerializer

from lrkv_flows.convert import convert_flow
from lrkv_tasks.recipes.convert_recipe import load_recipe
from lrkv_tasks.records import ALLOWED_CLASSES
from tests.support.models import tiny_model_dir, token_parquet

# the default decomposition's statistics, collected in one pass over the 8 calibration rows
PROGRESS_LINE = "collect attention_gram,gram,output_fisher (one pass): 8/8"


def _recipe(tmp_path: Path):
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    return load_recipe(
        None,
        {
            "model": str(model_dir),
            "calibration": {"dataset": data, "n_samples": 8, "seq_len": 32, "batch_size": 4},
            "compression": {"ratio": 0.5, "group_size": 2, "rank_multiple": 8},
            "eval": {"dataset": None},
            "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "cache-test"},
            "store": str(tmp_path / "store"),
        },
    )


def _states(result) -> dict[str, str]:
    return {row["task"]: row["state"] for row in result.timings}


def _records(store: Path) -> dict[Path, dict]:
    return {p: json.loads(p.read_bytes()) for p in (store / "prefect-results").iterdir() if p.is_file()}


class Planted:
    """Unpickling this creates ``path``: the proof that a pickle from the store was executed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_results_are_json_and_stale_or_unsafe_records_are_recomputed(prefect_api, tmp_path):
    recipe = _recipe(tmp_path)
    store = tmp_path / "store"
    first = convert_flow(recipe)
    assert set(_states(first).values()) == {"Completed"}

    # every cached result in the store is a JSON record naming only lrkv's reference class: no pickle
    records = _records(store)
    assert len(records) == len(first.timings)
    for record in records.values():
        assert record["metadata"]["serializer"]["type"] == "json"
        assert _classes(record["result"]) <= ALLOWED_CLASSES

    # the run's task progress reached its Prefect logs (the UI), and its summary is a Prefect artifact
    flow_run_id = (
        MlflowClient(recipe.tracking.mlflow_uri)
        .get_run(first.mlflow["run_id"])
        .data.tags["lrkv.prefect_flow_run"]
    )
    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + 30  # Prefect ships logs from a background thread: wait for them
        while True:
            logs = client.read_logs(LogFilter(flow_run_id={"any_": [flow_run_id]}), limit=200, offset=0)
            messages = [entry.message for entry in logs]
            if PROGRESS_LINE in messages or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert PROGRESS_LINE in messages, messages
        # the client's read_artifacts sends null filters, this server (fastapi pin) rejects: ask plainly
        body = {
            "artifacts": {"key": {"any_": ["lrkv-convert"]}},
            "limit": 10,
            "offset": 0,
            "sort": "CREATED_DESC",
        }
        artifacts = client._client.post("/artifacts/filter", json=body).json()
    summaries = [a for a in artifacts if a["flow_run_id"] == flow_run_id]
    assert len(summaries) == 1 and summaries[0]["type"] == "markdown"
    assert (
        "| plan_ranks | Completed |" in summaries[0]["data"]
        and first.mlflow["run_id"] in summaries[0]["data"]
    )

    # a deleted store file: the task that made it runs again and the file is back; nothing else reruns
    factors = sorted((store / "factors").iterdir())
    assert len(factors) == 2
    factors[1].unlink()
    second = convert_flow(recipe)
    states = _states(second)
    recomputed = {name for name, state in states.items() if state != "Cached"}
    assert len(recomputed) == 1 and recomputed <= {"decompose_layer[0]", "decompose_layer[1]"}, states
    assert factors[1].is_file()

    # a planted pickle record is never unpickled: the task is computed again and the record is JSON again
    plans = [(p, r["result"]) for p, r in _records(store).items() if '"kind": "plan"' in r["result"]]
    assert len(plans) == 2  # plan_ranks' and refine_plan's (kl refines by default; it names the objective)
    plan_record = next(p for p, result in plans if '"objective":' not in result)
    marker = tmp_path / "executed"
    pickle_record = ResultRecord(
        metadata=ResultRecordMetadata(serializer=PickleSerializer(), storage_key=str(plan_record)),
        result=Planted(marker),
    )
    plan_record.write_bytes(pickle_record.serialize())
    third = convert_flow(recipe)
    states = _states(third)
    assert not marker.exists()
    assert states["plan_ranks"] == "Completed" and states["build_model"] == "Cached", states
    assert json.loads(plan_record.read_bytes())["metadata"]["serializer"]["type"] == "json"
    assert third.plan == first.plan


def test_a_corrupt_stored_model_is_rebuilt_and_never_exported(prefect_api, tmp_path):
    """A changed byte in the stored model: the re-run builds it again, replacing the corrupt copy in the
    store, and exports the intact model."""
    out = tmp_path / "out"
    recipe = _recipe(tmp_path).model_copy(update={"out": str(out)})
    first = convert_flow(recipe)
    weights = Path(first.compressed.uri) / "model.safetensors"
    intact = weights.read_bytes()
    corrupt = bytearray(intact)
    corrupt[-3] ^= 0x10  # a byte of a tensor: the file still parses
    weights.write_bytes(bytes(corrupt))
    shutil.rmtree(out)
    second = convert_flow(recipe)
    states = _states(second)
    assert states["build_model"] == "Completed" and states["decompose_layer[0]"] == "Cached", states
    assert weights.read_bytes() == intact
    assert (out / "model.safetensors").read_bytes() == intact
    assert second.compressed == first.compressed


def _classes(result: str) -> set[str]:
    found: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            if "__class__" in node:
                found.add(node["__class__"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(result))
    return found
