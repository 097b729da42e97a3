"""The ``builtin`` scheme: model refs ``builtin:NAME`` and dataset specs ``builtin:NAME:SPLIT``.

Registered with lrkv_core's resolver through entry points (see ``pyproject.toml``), so lrkv_core reaches
this module only when a reference names ``builtin:``. Resolving one builds the model on first use (about
two minutes): only an explicit ``builtin:`` reference ever trains anything.
"""

from __future__ import annotations

from pathlib import Path

from lrkv_core.data.refs import DatasetScheme, DatasetSpec

from .builtin import BUILTIN_MODELS, ensure_builtin_model

SCHEME = "builtin"
SPLITS = ("train", "valid")  # the text files a build leaves beside the model


def resolve_builtin_model(name: str) -> Path:
    """Directory of built-in model ``name`` (``builtin:NAME``), built on first use."""
    return ensure_builtin_model(name)


def _name_split(rest: str) -> tuple[str, str]:
    """``NAME:SPLIT`` -> (name, split), checked against the known models and splits."""
    parts = rest.split(":")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"expected {SCHEME}:NAME:SPLIT, got {SCHEME}:{rest}")
    name, split = parts
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {name!r}; available: {', '.join(sorted(BUILTIN_MODELS))}")
    if split not in SPLITS:
        raise ValueError(f"builtin models have the splits {', '.join(SPLITS)}, not {split!r}")
    return name, split


def check_builtin_dataset(rest: str) -> None:
    """Check ``NAME:SPLIT`` without building anything."""
    _name_split(rest)


def resolve_builtin_dataset(rest: str) -> DatasetSpec:
    """``NAME:SPLIT`` -> ``text:<model dir>/<split>.txt``, building model NAME on first use."""
    name, split = _name_split(rest)
    return DatasetSpec(kind="text", name=str(ensure_builtin_model(name) / f"{split}.txt"))


def builtin_heldout(rest: str) -> tuple[str, str] | None:
    """The valid split for calibration on the train split (held out of training too); else None."""
    name, split = _name_split(rest)
    if split != "train":
        return None
    return f"{name}:valid", f"the valid split of {SCHEME}:{name} (held out of its training and calibration)"


BUILTIN_DATASETS = DatasetScheme(
    form=f"{SCHEME}:NAME:SPLIT",
    resolve=resolve_builtin_dataset,
    check=check_builtin_dataset,
    heldout=builtin_heldout,
)
