"""Result records are read as plain JSON before Prefect sees them: only safe, complete ones are served."""

import json
from pathlib import Path

import pytest
from prefect.results import ResultRecord, ResultRecordMetadata
from prefect.serializers import JSONSerializer, PickleSerializer

from lrkv_tasks.records import EXPIRED, UnsafeRecord, parse_record, stale_reason
from lrkv_tasks.store.artifact_store import LocalStore
from lrkv_tasks.store.artifacts import ArtifactRef


def _record(result, serializer=None) -> bytes:
    meta = ResultRecordMetadata(serializer=serializer or JSONSerializer(), storage_key="k")
    return ResultRecord(metadata=meta, result=result).serialize()


def test_a_json_record_of_refs_round_trips(tmp_path):
    ref = ArtifactRef(kind="plan", uri=str(tmp_path / "p.json"), sha256="a" * 64, meta={"layer": 1})
    raw = _record({"plan": ref, "ppl": 1.5})
    assert parse_record(raw) == [ref]
    assert ResultRecord.deserialize(raw).result == {"plan": ref, "ppl": 1.5}  # what Prefect itself reads


@pytest.mark.parametrize(
    "raw, reason",
    [
        (_record({"x": 1}, PickleSerializer()), "serializer 'pickle'"),
        (_record({"__class__": "os.system", "data": "true"}), "names class 'os.system'"),
        (_record({"__exc_type__": "builtins.ValueError", "message": "m"}), "exception"),
        (b"\x80\x04K\x01.", "not a JSON result record"),
    ],
)
def test_unsafe_records_are_refused_without_loading_them(raw, reason):
    with pytest.raises(UnsafeRecord, match=reason):
        parse_record(raw)


def test_a_record_whose_artifact_is_gone_is_stale(tmp_path):
    store = LocalStore(tmp_path / "store")
    kept, gone = tmp_path / "kept.bin", tmp_path / "gone.bin"
    kept.write_bytes(b"1")
    heatmap = tmp_path / "heat.png"
    ref = ArtifactRef(kind="plan", uri=str(kept), sha256="b" * 64, meta={"heatmap": str(heatmap)})
    store.write_record("k1", _record(ref))
    assert stale_reason(store, "k1") == f"artifacts missing: {heatmap}"  # meta-named artifacts count
    heatmap.write_bytes(b"png")
    assert stale_reason(store, "k1") is None
    store.write_record("k2", _record([ref, ref.model_copy(update={"uri": str(gone)})]))
    assert stale_reason(store, "k2") == f"artifacts missing: {gone}"
    store.write_record("k2", json.dumps(EXPIRED).encode())
    assert stale_reason(store, "k2") is None and stale_reason(store, "absent") is None
    assert ResultRecord.deserialize(store.read_record("k2")).metadata.expiration.year == 1970  # a miss


def test_a_record_whose_stored_artifact_is_corrupt_is_stale(tmp_path):
    """A store artifact whose bytes no longer hash to the sha256 in its name makes the record stale."""
    store = LocalStore(tmp_path / "store")
    with store.staging(".json") as tmp:
        tmp.write_text('{"ranks": [8, 8]}')
        path, digest = store.put(tmp, "plans")
    store.write_record("k", _record(ArtifactRef(kind="plan", uri=path, sha256=digest)))
    assert stale_reason(store, "k") is None
    Path(path).write_text('{"ranks": [8, 9]}')
    assert stale_reason(store, "k") == f"artifacts corrupt: {path}"
