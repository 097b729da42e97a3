import pytest

from lrkv_tasks.store import LocalStore


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
