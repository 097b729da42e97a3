"""Where lrkv keeps what it builds: one root, chosen by the user, never a fixed hidden path."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class HomeNotWritableError(OSError):
    """``$LRKV_HOME`` cannot be created or written (one line naming it and why)."""


def lrkv_home() -> Path:
    """Root for lrkv's own files (built-in models, the local artifact store, local MLflow).

    ``$LRKV_HOME`` if set, else ``$XDG_CACHE_HOME/lrkv``, else ``~/.cache/lrkv``. Nothing is created here:
    callers make the sub-directories they write (:func:`writable_home` first, for one clear error).
    """
    if os.environ.get("LRKV_HOME"):
        return Path(os.environ["LRKV_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "lrkv"


def writable_home() -> Path:
    """:func:`lrkv_home`, created if missing and checked by writing a file in it.

    Raises :class:`HomeNotWritableError` (one line) when it is read-only, not a directory, or cannot be made.
    """
    home = lrkv_home()
    try:
        home.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=home, prefix=".write-check."):
            pass
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise HomeNotWritableError(
            f"the lrkv home {home} is not writable ({why}): set LRKV_HOME to a writable directory"
        ) from None
    return home


@contextmanager
def setup_lock(directory: Path, name: str = ".lrkv-setup.lock") -> Iterator[None]:
    """Hold ``directory``'s set-up lock (the file ``name``, an ``flock``) for the block.

    Serializes first-time set-up (creating a database, starting a server on it) between the processes, and
    the threads, that share ``directory``: each holder opens the file anew, and ``flock`` locks of separate
    opens exclude each other even within one process (so the block must not take the lock again). The
    kernel releases the lock when its holder ends, however it ends, so a killed holder blocks no one.
    """
    fd = os.open(Path(directory) / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
