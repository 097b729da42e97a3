"""Artifact references: what tasks pass to each other instead of models, tensors or ad-hoc dicts."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from lrkv_core.system.fingerprint import hash_dir, hash_file

RESULTS = "prefect-results"  # where a store keeps the tasks' result records
STORE_FORMS = "a local directory or s3://bucket/prefix"
# SCHEME:/... : a URI (s3://b, models:/m, gs://b), or one that Path() folded ("s3://b" -> "s3:/b")
_URI_LIKE = re.compile(r"[a-z][a-z0-9+.-]+:/")


def is_s3(uri: str | Path | None) -> bool:
    """Whether a store root or artifact URI is on S3."""
    return isinstance(uri, str) and uri.startswith("s3://")


def looks_like_uri(path: str | Path) -> bool:
    """Whether ``path`` starts ``SCHEME:/`` (``s3://b``, ``models:/m``, or ``s3:/b`` that ``Path`` folded from
    ``s3://b``); such a string is never taken for a local path (``./s3:/b`` is one)."""
    return _URI_LIKE.match(str(path)) is not None


def local_dir(path: str | Path, what: str, accepts: str = "a local path") -> Path:
    """``path`` as a local path, or a ValueError if it looks like a URI (see :func:`looks_like_uri`), so a
    mistyped or mangled URI never becomes a directory named ``s3:``; ``accepts`` says what ``what`` takes."""
    if looks_like_uri(path):
        raise ValueError(
            f"{what} {str(path)!r} looks like a URI; {what} takes {accepts} (write ./{path} for a local path)"
        )
    return Path(path)


def digest_of(staged: Path) -> str:
    """The content hash a staged file or directory is stored under."""
    return hash_dir(staged) if staged.is_dir() else hash_file(staged)


class ArtifactRef(BaseModel):
    """One stored artifact: where it is, what it is, its content fingerprint and a few small facts.

    ``uri`` is a local path (a local store's artifact, a model directory, an export) or ``s3://...`` (an S3
    store's artifact; tasks read it through :func:`lrkv_tasks.store.artifact_store.local_path`); ``sha256`` is
    the content fingerprint cache keys are built from; ``meta`` holds small JSON facts (a layer index, a
    model's attention shape, a plan's achieved ratio), never tensors.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str  # "source-model" | "calibration" | "statistic" | "factors" | "summary" | "plan" | "model" | ...
    uri: str
    sha256: str
    meta: dict[str, Any] = {}

    @property
    def path(self) -> str:
        """The local path of the artifact (``uri`` of a local store)."""
        return self.uri


@contextmanager
def staging_path(parent: Path, suffix: str = "") -> Iterator[Path]:
    """A fresh path ``<parent>/<tmp>/artifact<suffix>`` to write an artifact into; removed on exit."""
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=parent)) / f"artifact{suffix}"
    try:
        yield path
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
