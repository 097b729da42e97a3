"""The model-format section: what ``config.json``'s ``lrkv`` entry says about a compressed model.

One typed object, :class:`LrkvFormat`, is written by fusion, read by save/load, the transformers quantizer
hook, the latent cache (which storage to use) and the model card. ``format_version`` says which layout of
the section a model was written with: sections without one were written by lrkv 0.1 (format 1) and are
read through :func:`_migrate_v1`; format 2 (lrkv 0.2) had no ``rotation`` and reads as ``rotation: none``
(:func:`_migrate_v2`); a section from a newer lrkv than this one is refused with a clear error.

Format 3 added ``rotation`` and ``rotation_seed``: the orthogonal rotation of each group's rank dimension
fused into the factors (:mod:`lrkv_core.quant.rotation`). It is already in the weights, so loading needs
nothing from it; it is recorded to describe the model (and a format-2 reader, which refuses unknown keys, is
told to upgrade rather than that the section is broken).

Format 4 added ``weights_sha256``: the sha256 of ``model.safetensors``, written by
:func:`lrkv_core.save_compressed` and checked by :func:`lrkv_core.load_compressed`, so a corrupt or modified
weights file is refused rather than used. A format-3 section has none and reads as ``weights_sha256: None``
(:func:`_migrate_v3`): such models load unchecked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field
from typing import Any

from .quant.rotation import ROTATIONS

FORMAT_VERSION = 4
ROPE_HANDLING = ("reconstruct-then-rope", "keys-fused-into-q", "rotated-keys")


class FormatError(ValueError):
    """A compressed model's ``lrkv`` section cannot be read by this version of lrkv."""


@dataclass(frozen=True)
class LrkvFormat:
    """Everything needed to rebuild a compressed model's modules and cache, and to describe it.

    Ranks are per layer, per group of ``group_size`` KV heads: ``ranks_k[layer][g]``, ``ranks_v[layer][g]``.
    ``decomposition``, ``allocator`` and ``cache`` are the recipe forms (``{"name": ..., **options}``) of the
    registered methods that made the model and of the cache storage it decodes with. ``rotation`` is the
    policy (one of :data:`~lrkv_core.quant.rotation.ROTATIONS`) whose rotations were fused into every group's
    factors, seeded by ``rotation_seed`` where it drew random orthogonal matrices. ``weights_sha256`` is the
    sha256 of the saved ``model.safetensors`` (None in memory before saving, and for models saved before it
    was recorded).
    """

    decomposition: dict[str, Any]
    allocator: dict[str, Any]
    group_size: int
    ranks_k: list[list[int]]
    ranks_v: list[list[int]]
    rank_multiple: int
    target_ratio: float
    achieved_ratio: float
    rope: str  # one of ROPE_HANDLING
    qkv_bias: bool  # q_proj (and k_up, with RoPE) carry the original q/k biases
    o_bias: bool  # o_proj bias (original o bias + the folded v bias)
    cache: dict[str, Any] = field(default_factory=lambda: {"name": "dense"})
    rotation: str = "none"
    rotation_seed: int = 0
    method: str = "palu"
    lrkv_version: str = ""
    weights_sha256: str | None = None
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.rope not in ROPE_HANDLING:
            raise FormatError(f"unknown rope handling {self.rope!r}; known: {', '.join(ROPE_HANDLING)}")
        if self.rotation not in ROTATIONS:
            raise FormatError(f"unknown rotation {self.rotation!r}; known: {', '.join(ROTATIONS)}")
        if len(self.ranks_k) != len(self.ranks_v) or any(
            len(k) != len(v) for k, v in zip(self.ranks_k, self.ranks_v)
        ):
            raise FormatError("ranks_k and ranks_v must have the same layers and groups")
        for name in ("decomposition", "allocator", "cache"):
            if not isinstance(getattr(self, name), Mapping) or "name" not in getattr(self, name):
                raise FormatError(f"{name} must be a mapping with a 'name'")

    @property
    def n_layers(self) -> int:
        return len(self.ranks_k)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> LrkvFormat:
        """Read a section of any format version this lrkv knows (older ones are migrated)."""
        if not isinstance(section, Mapping):
            raise FormatError(f"the lrkv section must be a mapping, got {type(section).__name__}")
        data = dict(section)
        version = data.get("format_version", 1)
        if not isinstance(version, int) or version < 1:
            raise FormatError(f"bad lrkv format_version {version!r}")
        if version > FORMAT_VERSION:
            raise FormatError(
                f"this model was written in lrkv format {version}, newer than the format {FORMAT_VERSION} "
                "this lrkv reads: upgrade lrkv to load it"
            )
        if version == 1:
            data = _migrate_v1(data)
        elif version == 2:
            data = _migrate_v2(data)
        elif version == 3:
            data = _migrate_v3(data)
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise FormatError(f"unknown keys {unknown} in an lrkv format {version} section")
        missing = sorted(
            f for f, spec in cls.__dataclass_fields__.items() if f not in data and _required(spec)
        )
        if missing:
            raise FormatError(f"the lrkv section lacks {missing}")
        return cls(**data)

    @classmethod
    def of(cls, config: Any) -> LrkvFormat:
        """The section of a model config (``config.lrkv``)."""
        section = getattr(config, "lrkv", None)
        if not section:
            raise FormatError("the model config has no lrkv section: it is not an lrkv-compressed model")
        return section if isinstance(section, LrkvFormat) else cls.from_dict(section)


def _required(spec: Any) -> bool:
    return spec.default is MISSING and spec.default_factory is MISSING


def _migrate_v1(data: dict[str, Any]) -> dict[str, Any]:
    """lrkv 0.1's section: names instead of recipe forms, a plain ``version``, unused rotation/bits slots."""
    for slot in ("rotation", "bits"):
        if data.pop(slot, None) is not None:
            raise FormatError(f"format 1 section with {slot} set: not written by a released lrkv")
    out = {k: v for k, v in data.items() if k not in ("version", "decomposition", "allocator")}
    out["decomposition"] = {"name": data.get("decomposition", "whitened")}
    out["allocator"] = {"name": data.get("allocator", "uniform")}
    out["lrkv_version"] = data.get("version", "0.1.0")
    return _migrate_v2(out)


def _migrate_v2(data: dict[str, Any]) -> dict[str, Any]:
    """lrkv 0.2's section: no rotation (the fields' defaults, ``none``), otherwise the same layout."""
    if "rotation" in data or "rotation_seed" in data:
        raise FormatError("format 2 section with a rotation: not written by a released lrkv")
    return _migrate_v3({**data, "format_version": 3})


def _migrate_v3(data: dict[str, Any]) -> dict[str, Any]:
    """A format-3 section: no checksum of the weights (``weights_sha256: None``), else the same layout."""
    if "weights_sha256" in data:
        raise FormatError("format 3 section with weights_sha256: not written by a released lrkv")
    return {**data, "format_version": FORMAT_VERSION}


def forget_weights_checksum(config) -> None:
    """Drop the file checksum from a loaded model's ``lrkv`` section: it describes the file read, not the
    model in memory, which may change and is saved with its own (``save_pretrained`` included)."""
    section = getattr(config, "lrkv", None)
    if isinstance(section, dict) and section.get("weights_sha256"):
        config.lrkv = {**section, "weights_sha256": None}
