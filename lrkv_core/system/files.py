"""Writing files the way the rest of the system expects: readable by the user's umask, not private, and
directories replaced so that a complete one is always there.

safetensors writes every file with mode 0600 whatever the umask, and so do the temporary files and
directories (``mkstemp``, ``mkdtemp``) that atomic writes rename into place, so a shared artifact store or an
exported model directory would hold files only their writer can read. Such writes go through here.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
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
    """``safetensors.torch.save_file`` with the umask's file mode; tensors that share memory with one saved
    before them (one value given to several names) are saved as copies of their own."""
    stored, own = {}, set()
    for name, tensor in tensors.items():
        where = tensor.untyped_storage().data_ptr()
        stored[name] = tensor.clone() if where and where in own else tensor
        own.add(where)
    save_file(stored, str(path), metadata=metadata)
    make_readable(path)


def replace_dir(new: str | Path, out: str | Path, *, attempts: int = 8) -> Path:
    """Move the complete directory ``new`` to ``out`` (same filesystem), replacing what ``out`` held.

    The old ``out`` is renamed aside to a unique ``.NAME.old-XXXXXXXX`` sibling, ``new`` is renamed in, and
    only then is the old one deleted: a crash at any moment leaves the old directory complete, at ``out`` or
    (between the two renames) at its aside name. Every caller uses names of its own, so concurrent writers to
    the same ``out`` never delete each other's work; the last to rename its directory in wins. If ``new``
    cannot be renamed in for another reason, the old directory is put back and the error raised.
    """
    new, out = Path(new), Path(out)
    for _ in range(attempts):
        aside = None
        if os.path.lexists(out):
            aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            try:
                os.replace(out, aside)  # a directory may replace an empty one
            except FileNotFoundError:  # another writer moved it first
                aside.rmdir()
                aside = None
        try:
            os.rename(new, out)
        except OSError as err:
            if err.errno in (errno.EEXIST, errno.ENOTEMPTY) and os.path.isdir(out):
                if aside is not None:  # another writer's complete directory is in place: ours goes next
                    shutil.rmtree(aside, ignore_errors=True)
                continue
            if aside is not None and not os.path.lexists(out):
                os.replace(aside, out)
            raise
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        return out
    raise OSError(f"{out}: other writers kept replacing it; gave up after {attempts} attempts")
