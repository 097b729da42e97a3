"""The artifact store: content-addressed files under one root (a local directory for now).

Every artifact is written to a temporary path first and moved into ``<root>/<kind>/<sha256>[suffix]``
only when complete, so a killed run never leaves a half-written artifact behind, and equal content is
stored once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from lrkv_core.files import make_tree_readable
from lrkv_core.fingerprint import hash_dir, hash_file
from lrkv_core.paths import lrkv_home


def default_store_root() -> Path:
    return lrkv_home() / "store"


class LocalStore:
    """A local-directory artifact store."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root).expanduser().resolve() if root else default_store_root()

    @contextmanager
    def staging(self, suffix: str = ""):
        """A temporary path inside the store (same filesystem, so the final move is atomic)."""
        tmp_dir = self.root / ".staging"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(dir=tmp_dir)) / f"artifact{suffix}"
        try:
            yield path
        finally:
            shutil.rmtree(path.parent, ignore_errors=True)

    def put(self, staged: Path, kind: str) -> tuple[str, str]:
        """Move a staged file or directory into place; returns ``(path, sha256)``."""
        digest = hash_dir(staged) if staged.is_dir() else hash_file(staged)
        final = self.root / kind / f"{digest}{''.join(staged.suffixes)}"
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            return str(final), digest
        make_tree_readable(staged)  # staging uses private temp names (0600/0700): published ones are not
        try:
            os.replace(staged, final)
        except OSError:
            if not final.exists():
                raise
        return str(final), digest
