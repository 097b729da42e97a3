"""The S3 artifact store (``s3://bucket/prefix``), on boto3.

Settings come from the environment, as boto3 reads them: credentials (``AWS_ACCESS_KEY_ID``, ...), the
endpoint of an S3-compatible server (``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``; MLflow's
``MLFLOW_S3_ENDPOINT_URL`` is honoured too, so one variable serves both), and the number of attempts on
transient errors (``LRKV_S3_MAX_ATTEMPTS``, default 4; botocore's standard retry mode backs off
exponentially with jitter). An endpoint that stays unreachable raises :class:`StoreUnreachableError`, one
line naming it.

Layout: a file artifact is one object ``<prefix>/<kind>/<sha256><suffix>`` (a single PUT, or a multipart
upload that only becomes visible when completed); a directory artifact is ``<prefix>/<kind>/<sha256>/``
with its files, plus ``MANIFEST.json`` (each file's sha256) written last: the directory exists once the
manifest does. Downloads go to ``$LRKV_HOME/cache/s3/<bucket>/<key>`` through a temporary sibling that is
renamed into place only after every byte was verified against the content hash, so a partial download is
never used.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from lrkv_core.system.fingerprint import hash_dir, hash_file, hash_json
from lrkv_core.system.paths import lrkv_home

from .artifacts import RESULTS, digest_of, staging_path
from .integrity import StoreIntegrityError, intact

MANIFEST = "MANIFEST.json"
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL")


class StoreUnreachableError(OSError):
    """The S3 endpoint did not answer after every retry."""


def endpoint_url() -> str | None:
    """The S3 endpoint from the environment (None: AWS's own)."""
    return next((os.environ[v] for v in ENDPOINT_VARS if os.environ.get(v)), None)


def max_attempts() -> int:
    return int(os.environ.get("LRKV_S3_MAX_ATTEMPTS", "4"))


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``."""
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri}")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri}")
    return bucket, key.strip("/")


def make_client():
    """A boto3 S3 client with the environment's endpoint, bounded timeouts and standard retries."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"total_max_attempts": max_attempts(), "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
        s3={"addressing_style": "path"},
    )
    return boto3.client("s3", endpoint_url=endpoint_url(), config=config)


@contextmanager
def _reachable(what: str) -> Iterator[None]:
    """Turn botocore's connection failures (after its retries) into one clear line."""
    from botocore.exceptions import (
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        ReadTimeoutError,
    )

    try:
        yield
    except (EndpointConnectionError, ConnectTimeoutError, ConnectionClosedError, ReadTimeoutError) as err:
        where = endpoint_url() or "AWS S3"
        raise StoreUnreachableError(
            f"S3 endpoint {where} is unreachable ({what}; gave up after {max_attempts()} attempts): {err}"
        ) from None


def _missing(err) -> bool:
    return err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")


class S3Store:
    """Content-addressed artifacts in ``s3://bucket/prefix`` (see the module docstring)."""

    def __init__(self, root: str) -> None:
        self.bucket, self.prefix = split_uri(root)
        self.root = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.client = make_client()

    @classmethod
    def for_uri(cls, uri: str) -> S3Store:
        """A store on the bucket of ``uri`` (for reading an artifact by its URI alone)."""
        bucket, _ = split_uri(uri)
        return cls(f"s3://{bucket}")

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def staging(self, suffix: str = "") -> AbstractContextManager[Path]:
        """A local temporary path to write an artifact into before :meth:`put` uploads it."""
        return staging_path(lrkv_home() / "staging", suffix)

    def put(self, staged: Path, kind: str) -> tuple[str, str]:
        """Upload a staged file or directory under its content hash; returns ``(uri, sha256)``."""
        digest = digest_of(staged)
        name = f"{digest}{''.join(staged.suffixes)}"
        uri = f"{self.root}/{kind}/{name}"
        if self.exists(uri):
            return uri, digest
        with _reachable(f"uploading {uri}"):
            if staged.is_dir():
                files = sorted(p for p in staged.rglob("*") if p.is_file())
                manifest = {p.relative_to(staged).as_posix(): hash_file(p) for p in files}
                for p in files:
                    self.client.upload_file(
                        str(p), self.bucket, self._key(kind, name, manifest_name(p, staged))
                    )
                body = json.dumps({"sha256": digest, "files": manifest}, indent=1).encode()
                self.client.put_object(Bucket=self.bucket, Key=self._key(kind, name, MANIFEST), Body=body)
            else:
                self.client.upload_file(str(staged), self.bucket, self._key(kind, name))
        return uri, digest

    def exists(self, uri: str) -> bool:
        bucket, key = split_uri(uri)
        from botocore.exceptions import ClientError

        with _reachable(f"checking {uri}"):
            for candidate in (key, f"{key}/{MANIFEST}"):
                try:
                    self.client.head_object(Bucket=bucket, Key=candidate)
                    return True
                except ClientError as err:
                    if not _missing(err):
                        raise
        return False

    def local(self, uri: str) -> Path:
        """A verified local copy of the artifact (downloaded once into the content-addressed cache, and
        downloaded again if the cached copy no longer hashes to its name)."""
        bucket, key = split_uri(uri)
        dest = lrkv_home() / "cache" / "s3" / bucket / key
        if dest.exists():
            if intact(dest):
                return dest
            shutil.rmtree(dest) if dest.is_dir() else dest.unlink()  # changed since download: fetch it again
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
        try:
            manifest = self._manifest(bucket, key)
            with _reachable(f"downloading {uri}"):
                if manifest is None:
                    if not self.exists(uri):
                        raise FileNotFoundError(f"artifact {uri} is missing from the store")
                    got = tmp / "file"
                    self.client.download_file(bucket, key, str(got))
                    _verify(uri, hash_file(got), Path(key).name.split(".")[0])
                else:
                    got = tmp / "dir"
                    for rel, sha in manifest["files"].items():
                        (got / rel).parent.mkdir(parents=True, exist_ok=True)
                        self.client.download_file(bucket, f"{key}/{rel}", str(got / rel))
                        _verify(f"{uri}/{rel}", hash_file(got / rel), sha)
                    _verify(uri, hash_dir(got), manifest["sha256"])
            os.replace(got, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def _manifest(self, bucket: str, key: str) -> dict | None:
        from botocore.exceptions import ClientError

        with _reachable(f"reading s3://{bucket}/{key}/{MANIFEST}"):
            try:
                body = self.client.get_object(Bucket=bucket, Key=f"{key}/{MANIFEST}")["Body"].read()
            except ClientError as err:
                if _missing(err):
                    return None
                raise
        return json.loads(body)

    def result_storage(self) -> str:
        """Prefect's block for task results: a prefect-aws ``S3Bucket`` at ``<prefix>/prefect-results``.

        Prefect takes only saved blocks as result storage: it is saved (idempotently) under a name derived
        from the store root and the endpoint; credentials are not saved (boto3 reads them from the
        environment where the task runs).
        """
        from prefect_aws import AwsClientParameters, AwsCredentials, S3Bucket

        params = AwsClientParameters(
            endpoint_url=endpoint_url(),
            config={"retries": {"total_max_attempts": max_attempts(), "mode": "standard"}},
        )
        block = S3Bucket(
            bucket_name=self.bucket,
            bucket_folder=self._key(RESULTS),
            credentials=AwsCredentials(aws_client_parameters=params),
        )
        name = "lrkv-results-" + hash_json([self.root, endpoint_url()])[:16]
        block.save(name, overwrite=True)
        return f"s3-bucket/{name}"

    def read_record(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        with _reachable(f"reading result {key}"):
            try:
                return self.client.get_object(Bucket=self.bucket, Key=self._key(RESULTS, key))["Body"].read()
            except ClientError as err:
                if _missing(err):
                    return None
                raise

    def write_record(self, key: str, data: bytes) -> None:
        with _reachable(f"writing result {key}"):
            self.client.put_object(Bucket=self.bucket, Key=self._key(RESULTS, key), Body=data)


def manifest_name(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _verify(uri: str, got: str, expected: str) -> None:
    if got != expected:
        raise StoreIntegrityError(f"{uri}: content hash {got[:12]}… does not match {expected[:12]}…")
