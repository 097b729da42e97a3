"""The S3 artifact store against a real S3 HTTP server on loopback (moto's server mode)."""

import time
import uuid

import boto3
import pytest

from lrkv_core.system.fingerprint import hash_file
from lrkv_tasks.store.artifact_store import artifact_exists, local_path, open_store
from lrkv_tasks.store.s3 import S3Store, StoreIntegrityError, StoreUnreachableError
from tests.support.servers import free_port


def _store(s3) -> S3Store:
    store = open_store(f"s3://lrkv/t-{uuid.uuid4().hex[:8]}")
    assert isinstance(store, S3Store)
    return store


def _keys(store: S3Store) -> list[str]:
    listing = store.client.list_objects_v2(Bucket="lrkv", Prefix=store.prefix + "/")
    return sorted(o["Key"][len(store.prefix) + 1 :] for o in listing.get("Contents", []))


def test_files_and_directories_are_content_addressed_and_verified_on_download(s3, tmp_path):
    store = _store(s3)
    with store.staging(".txt") as tmp:
        tmp.write_text("hello")
        uri, digest = store.put(tmp, "notes")
    assert uri == f"{store.root}/notes/{digest}.txt" and digest == hash_file(_write(tmp_path / "h", "hello"))
    with store.staging() as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"weights")
        dir_uri, dir_digest = store.put(tmp, "models")
    assert _keys(store) == sorted(
        [f"notes/{digest}.txt"]
        + [f"models/{dir_digest}/{n}" for n in ("MANIFEST.json", "config.json", "model.safetensors")]
    )
    assert artifact_exists(uri) and artifact_exists(dir_uri) and not artifact_exists(f"{store.root}/notes/x")

    local = local_path(uri)
    assert local.read_text() == "hello" and local.is_relative_to(tmp_path / "home")
    model = local_path(dir_uri)
    assert (model / "model.safetensors").read_bytes() == b"weights" and (model / "config.json").is_file()
    assert local_path(dir_uri) == model  # served from the local cache the second time

    # a corrupted object fails verification and leaves nothing in the local cache
    with store.staging(".bin") as tmp:
        tmp.write_bytes(b"original")
        bad_uri, bad_digest = store.put(tmp, "blobs")
    store.client.put_object(Bucket="lrkv", Key=f"{store.prefix}/blobs/{bad_digest}.bin", Body=b"tampered")
    with pytest.raises(StoreIntegrityError, match="does not match"):
        local_path(bad_uri)
    cached = tmp_path / "home" / "cache" / "s3" / "lrkv" / store.prefix / "blobs"
    assert not any(p.name.startswith(bad_digest) for p in cached.iterdir())  # no partial or temp copy left
    with pytest.raises(FileNotFoundError, match="missing from the store"):
        local_path(f"{store.root}/blobs/{'0' * 64}.bin")


def test_an_unreachable_endpoint_is_retried_then_named(s3, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)
    monkeypatch.setenv("LRKV_S3_MAX_ATTEMPTS", "3")
    store = open_store("s3://lrkv/down")
    attempts = []
    store.client.meta.events.register("before-send.s3", lambda **kw: attempts.append(time.monotonic()))
    with store.staging(".txt") as tmp:
        tmp.write_text("x")
        with pytest.raises(StoreUnreachableError, match=f"S3 endpoint {dead} is unreachable.*3 attempts"):
            store.put(tmp, "notes")
    assert len(attempts) == 3  # botocore's standard mode: retried with backoff, then given up
    assert store.client.meta.config.retries == {"mode": "standard", "total_max_attempts": 3}  # with backoff


def test_the_store_lists_nothing_partial(s3):
    """A directory's manifest is written last: until it is, the directory does not exist."""
    store = _store(s3)
    client = boto3.client("s3")
    client.put_object(Bucket="lrkv", Key=f"{store.prefix}/models/{'1' * 64}/config.json", Body=b"{}")
    assert not store.exists(f"{store.root}/models/{'1' * 64}")


def _write(path, text):
    path.write_text(text)
    return path


def test_a_cached_download_that_changed_is_downloaded_again(s3, tmp_path):
    store = _store(s3)
    with store.staging() as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"weights" * 10)
        uri, _ = store.put(tmp, "models")
    model = local_path(uri)
    (model / "model.safetensors").write_bytes(b"weightz" * 10)  # the local copy, changed on disk
    assert local_path(uri) == model and (model / "model.safetensors").read_bytes() == b"weights" * 10
