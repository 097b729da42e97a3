"""Content fingerprints: cache keys for tasks and provenance for MLflow params."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def hash_bytes(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def hash_json(obj: Any) -> str:
    """Fingerprint of a JSON-serialisable object (key order does not matter)."""
    return hash_bytes(json.dumps(obj, sort_keys=True, default=str).encode())


def hash_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_dir(
    path: str | Path, suffixes: tuple[str, ...] = (".json", ".safetensors", ".txt", ".model")
) -> str:
    """Fingerprint of the files in a model directory that decide its behaviour (names + contents)."""
    root = Path(path)
    parts = []
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix in suffixes:
            parts.append(f"{p.name}:{hash_file(p)}")
    return hash_json(parts)


def hash_sources(*roots: str | Path) -> str:
    """Fingerprint of the Python sources under each root (relative paths + contents): the code version."""
    parts = []
    for root in map(Path, roots):
        for p in sorted(root.rglob("*.py")):
            parts.append(f"{root.name}/{p.relative_to(root).as_posix()}:{hash_file(p)}")
    return hash_json(parts)
