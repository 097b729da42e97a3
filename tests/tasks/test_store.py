from pathlib import Path

import pytest

from lrkv_tasks.s3 import S3Store
from lrkv_tasks.store import LocalStore, open_store


def test_put_is_content_addressed_and_atomic(tmp_path):
    store = LocalStore(tmp_path / "store")
    with store.staging(".txt") as tmp:
        tmp.write_text("hello")
        path, digest = store.put(tmp, "notes")
    assert path.endswith(f"notes/{digest}.txt") and open(path).read() == "hello"
    with store.staging(".txt") as tmp:
        tmp.write_text("hello")
        again, _ = store.put(tmp, "notes")
    assert again == path
    assert not any((tmp_path / "store" / ".staging").iterdir())  # staging cleaned up


def test_failed_step_leaves_nothing(tmp_path):
    store = LocalStore(tmp_path / "store")
    with pytest.raises(RuntimeError), store.staging(".bin") as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError("killed")
    assert not (tmp_path / "store" / "bin").exists()
    assert not any((tmp_path / "store" / ".staging").iterdir())


def test_a_root_that_looks_like_a_uri_is_refused_and_nothing_is_created(tmp_path, monkeypatch):
    """``s3:/b`` (``Path("s3://b")``) or another scheme is refused, nothing created; ``./s3:/b`` is local."""
    monkeypatch.chdir(tmp_path)
    for root in ("s3:/lrkv/store", Path("s3://lrkv/store"), "gs://lrkv/store", "models:/x"):
        with pytest.raises(ValueError, match="looks like a URI; store takes a local directory or s3://"):
            open_store(root)
    assert list(tmp_path.iterdir()) == []
    assert isinstance(open_store("s3://lrkv/store"), S3Store)
    assert LocalStore("./s3:/lrkv/store").path == tmp_path / "s3:" / "lrkv" / "store"
