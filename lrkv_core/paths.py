"""Where lrkv keeps what it builds: one root, chosen by the user, never a fixed hidden path."""

from __future__ import annotations

import os
from pathlib import Path


def lrkv_home() -> Path:
    """Root for lrkv's own files (built-in models, the local artifact store, local MLflow).

    ``$LRKV_HOME`` if set, else ``$XDG_CACHE_HOME/lrkv``, else ``~/.cache/lrkv``. Nothing is created here:
    callers make the sub-directories they write.
    """
    if os.environ.get("LRKV_HOME"):
        return Path(os.environ["LRKV_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "lrkv"
