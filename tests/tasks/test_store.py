from pathlib import Path

import pytest

from lrkv_tasks.store.artifact_store import LocalStore, local_path, open_store
from lrkv_tasks.store.s3 import S3Store, StoreIntegrityError


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


def _flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_corrupt_artifact_is_refused_and_put_replaces_it(tmp_path):
    """A stored file whose content no longer hashes to its name is never used, and storing the same content
    again replaces it."""
    store = LocalStore(tmp_path / "store")
    with store.staging(".bin") as tmp:
        tmp.write_bytes(b"weights" * 100)
        path, digest = store.put(tmp, "models")
    assert store.local(path) == Path(path) and local_path(path) == Path(path)
    _flip_byte(Path(path))
    for read in (store.local, local_path):
        with pytest.raises(
            StoreIntegrityError, match=f"artifact {path} is corrupt: .* not the {digest[:12]}"
        ):
            read(path)
    with store.staging(".bin") as tmp:
        tmp.write_bytes(b"weights" * 100)
        again, _ = store.put(tmp, "models")
    assert again == path and Path(path).read_bytes() == b"weights" * 100
    assert store.local(path) == Path(path)


def test_a_corrupt_stored_directory_is_replaced_by_put(tmp_path):
    store = LocalStore(tmp_path / "store")

    def stage(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(bytes(range(256)))

    with store.staging() as tmp:
        stage(tmp)
        path, _ = store.put(tmp, "models")
    _flip_byte(Path(path) / "model.safetensors", 100)
    with pytest.raises(StoreIntegrityError, match="is corrupt"):
        local_path(path)
    with store.staging() as tmp:
        stage(tmp)
        assert store.put(tmp, "models")[0] == path
    assert (Path(path) / "model.safetensors").read_bytes() == bytes(range(256))
    assert local_path(path) == Path(path)
    assert not any((tmp_path / "store" / ".staging").iterdir())
