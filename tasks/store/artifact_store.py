"""The artifact store: content-addressed artifacts under one root, a local directory or ``s3://bucket/prefix``.

One interface (:class:`ArtifactStore`), two implementations: :class:`LocalStore` here and
:class:`lrkv_tasks.store.s3.S3Store`. :func:`open_store` picks one from the root. Every artifact is staged in
a local temporary path first and published at ``<root>/<kind>/<sha256>[suffix]`` only when complete (a rename
on a local disk; a completed upload, and for a directory a manifest written last, on S3), so a killed run
never leaves a half-written artifact, and equal content is stored once. Tasks read artifacts through
:meth:`ArtifactStore.local`, which for S3 downloads into a content-addressed local cache and verifies the
sha256 before anything uses it.

An artifact's name records its sha256 (:func:`recorded_digest`), and a local artifact is checked against it
whenever it is used (:func:`verify_artifact`: read through :func:`local_path`, exported, or found by
:meth:`LocalStore.put` already in place), so a byte changed on disk is never used: a cached result whose
artifact fails the check is computed again, and ``put`` replaces the corrupt file with the new one. A check
is hashed once per process while the artifact's files are unchanged (same inode, size and times; as git
does with its index, a file changed less than :data:`SETTLED_NS` before it was hashed is hashed again, since
a second change within the same timestamp tick would not show in its times).

The store also holds the tasks' cached results (Prefect result records, JSON) in ``<root>/prefect-results``;
:meth:`ArtifactStore.result_storage` is the Prefect storage block for them, and ``read_record`` /
``write_record`` let :mod:`lrkv_tasks.records` check a record before Prefect reads it.
"""

from __future__ import annotations

import os
import shutil
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from lrkv_core.system.files import make_tree_readable
from lrkv_core.system.paths import lrkv_home

from .artifacts import RESULTS, STORE_FORMS, digest_of, is_s3, local_dir, staging_path
from .integrity import StoreIntegrityError, intact, recorded_digest, verify_artifact

__all__ = [
    "RESULTS",
    "ArtifactStore",
    "LocalStore",
    "StoreIntegrityError",
    "artifact_exists",
    "artifact_problem",
    "intact",
    "is_s3",
    "local_path",
    "open_store",
    "recorded_digest",
    "verify_artifact",
]


def default_store_root() -> Path:
    return lrkv_home() / "store"


class ArtifactStore(Protocol):
    """What tasks need from a store; ``uri`` strings are what :class:`~lrkv_tasks.store.artifacts.ArtifactRef`
    holds."""

    root: str

    def staging(self, suffix: str = "") -> AbstractContextManager[Path]: ...
    def put(self, staged: Path, kind: str) -> tuple[str, str]: ...
    def local(self, uri: str) -> Path: ...
    def exists(self, uri: str) -> bool: ...
    def result_storage(self) -> Path | str: ...
    def read_record(self, key: str) -> bytes | None: ...
    def write_record(self, key: str, data: bytes) -> None: ...


class LocalStore:
    """A local-directory artifact store (the default: ``$LRKV_HOME/store``).

    A root that looks like a URI is refused (a ValueError): ``s3://`` roots go to :func:`open_store`, and a
    root such as ``s3:/bucket`` (what ``Path`` makes of ``s3://bucket``) must not become a local directory.
    """

    def __init__(self, root: str | Path | None = None) -> None:
        if root:
            local_dir(root, "store", STORE_FORMS)  # s3:// roots are S3Store's; other URI-like ones: mistakes
        self.path = Path(root).expanduser().resolve() if root else default_store_root()
        self.root = str(self.path)

    def staging(self, suffix: str = "") -> AbstractContextManager[Path]:
        """A temporary path inside the store (same filesystem, so the final move is atomic)."""
        return staging_path(self.path / ".staging", suffix)

    def put(self, staged: Path, kind: str) -> tuple[str, str]:
        """Move a staged file or directory into place; returns ``(path, sha256)``.

        An artifact already at that place is kept if its content still hashes to its name, and replaced by
        the staged one if it does not (a corrupt file is never kept)."""
        digest = digest_of(staged)
        final = self.path / kind / f"{digest}{''.join(staged.suffixes)}"
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists() and intact(final):
            return str(final), digest
        make_tree_readable(staged)  # staging uses private temp names (0600/0700): published ones are not
        if final.is_dir():  # a corrupt directory: os.replace cannot replace a non-empty one
            with self.staging() as aside:
                try:
                    os.replace(final, aside)
                except FileNotFoundError:
                    pass
                self._publish(staged, final)
                shutil.rmtree(aside, ignore_errors=True)
        else:
            self._publish(staged, final)
        return str(final), digest

    @staticmethod
    def _publish(staged: Path, final: Path) -> None:
        try:
            os.replace(staged, final)
        except OSError:
            if not (final.exists() and intact(final)):  # another writer published the same content
                raise

    def local(self, uri: str) -> Path:
        """The artifact's local path (it is already local), checked against its recorded sha256; a clear
        error if it is gone (FileNotFoundError) or corrupt (:class:`StoreIntegrityError`)."""
        path = Path(uri)
        if not path.exists():
            raise FileNotFoundError(f"artifact {uri} is missing from the store")
        verify_artifact(path)
        return path

    def exists(self, uri: str) -> bool:
        return Path(uri).exists()

    def result_storage(self) -> Path:
        """Where Prefect keeps task results: a directory inside the store."""
        return self.path / RESULTS

    def read_record(self, key: str) -> bytes | None:
        path = self.path / RESULTS / key
        return path.read_bytes() if path.is_file() else None

    def write_record(self, key: str, data: bytes) -> None:
        path = self.path / RESULTS / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)


def open_store(root: str | Path | None = None) -> ArtifactStore:
    """The store at ``root``: ``s3://bucket/prefix`` or a local directory (default ``$LRKV_HOME/store``)."""
    if is_s3(root):
        from .s3 import S3Store

        return S3Store(str(root))
    return LocalStore(root)


def local_path(uri: str) -> Path:
    """A local copy of any artifact URI (a store artifact on S3 is downloaded and verified)."""
    if is_s3(uri):
        from .s3 import S3Store

        return S3Store.for_uri(uri).local(uri)
    return LocalStore(Path(uri).parent).local(uri)


def artifact_problem(uri: str) -> str | None:
    """Why the artifact at ``uri`` cannot be used: ``"missing"``, ``"corrupt"`` (a local one whose content
    does not hash to its recorded sha256), or None. An S3 artifact is checked when it is downloaded."""
    if not artifact_exists(uri):
        return "missing"
    if not is_s3(uri) and not intact(Path(uri)):
        return "corrupt"
    return None


def artifact_exists(uri: str) -> bool:
    """Whether the artifact at ``uri`` is still there (an S3 directory counts once its manifest is)."""
    if is_s3(uri):
        from .s3 import S3Store

        return S3Store.for_uri(uri).exists(uri)
    return Path(uri).exists()
