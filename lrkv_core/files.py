"""Writing files the way the rest of the system expects: readable by the user's umask, not private.

safetensors writes every file with mode 0600 whatever the umask, so a shared artifact store or an exported
model directory would hold files only their writer can read. Every safetensors write goes through here.
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


def save_tensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file`` with the umask's file mode."""
    save_file(tensors, str(path), metadata=metadata)
    make_readable(path)
