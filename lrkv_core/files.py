"""Writing files the way the rest of the system expects: readable by the user's umask, not private.

safetensors writes every file with mode 0600 whatever the umask, and so do the temporary files and
directories (``mkstemp``, ``mkdtemp``) that atomic writes rename into place, so a shared artifact store or an
exported model directory would hold files only their writer can read. Such writes go through here.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_readable(path: str | Path) -> None:
    """Give a file the mode a plain ``open(path, "w")`` would have (0666 minus the umask)."""
    os.chmod(path, 0o666 & ~_umask())


def make_tree_readable(path: str | Path) -> None:
    """:func:`make_readable` for a file, or a directory and everything in it (directories 0777 − umask)."""
    root = Path(path)
    if root.is_file():
        make_readable(root)
        return
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for p in root.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def save_tensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file`` with the umask's file mode."""
    save_file(tensors, str(path), metadata=metadata)
    make_readable(path)
