"""Content checks of stored artifacts: a local store artifact's name records its sha256, and every use and
export checks the content against it (a verified artifact is not hashed again until one of its files
changes)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

from .artifacts import digest_of


class StoreIntegrityError(OSError):
    """An artifact does not match its content hash."""


_DIGEST = re.compile(r"[0-9a-f]{64}")
_verified: dict[str, tuple] = {}  # path -> the files' signature when their hash last matched
_verified_lock = threading.Lock()
SETTLED_NS = 2_000_000_000  # files last changed this long before a check keep its result (timestamps tick)


def recorded_digest(path: str | Path) -> str | None:
    """The sha256 a store artifact's name records (``<sha256>[suffixes]``); None for other paths."""
    head = Path(path).name.split(".", 1)[0]
    return head if _DIGEST.fullmatch(head) else None


def _signature(path: Path) -> tuple[tuple, int]:
    """What changes when any file of the artifact is written or replaced (inode, size, mtime, ctime), and
    the time of the latest change."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stats = [(str(p), p.stat()) for p in files]
    latest = max((max(st.st_mtime_ns, st.st_ctime_ns) for _, st in stats), default=0)
    return tuple((name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for name, st in stats), latest


def verify_artifact(path: str | Path) -> None:
    """Check a local store artifact against the sha256 its name records (other paths pass unchecked).

    Raises
    ------
    StoreIntegrityError
        The content does not hash to the recorded sha256 (one line naming the artifact).
    """
    path = Path(path)
    expected = recorded_digest(path)
    if expected is None:
        return
    signature, changed = _signature(path)
    with _verified_lock:
        if _verified.get(str(path)) == signature:
            return
    settled = time.time_ns() - changed > SETTLED_NS
    actual = digest_of(path)
    if actual != expected:
        raise StoreIntegrityError(
            f"artifact {path} is corrupt: its content hashes to sha256 {actual[:12]}…, not the "
            f"{expected[:12]}… it was stored under (a re-run computes it again)"
        )
    if settled:
        with _verified_lock:
            _verified[str(path)] = signature


def intact(path: Path) -> bool:
    """Whether :func:`verify_artifact` passes."""
    try:
        verify_artifact(path)
    except StoreIntegrityError:
        return False
    return True
