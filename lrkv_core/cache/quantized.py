"""The ``quantized`` cache storage: latents as packed b-bit integer codes with float16 scales and zero-points.

Palu's quantized latent cache (§3.3): each new token's latents are quantized as they enter the cache, per
token and per quantization group (a whole latent group's row of r_g values, or sub-groups of
``quant_group_size``), asymmetrically at 2, 3, 4 or 8 bits (:mod:`lrkv_core.quant.integer`), and the codes are
packed (:mod:`lrkv_core.quant.packing`: 2-bit four per byte, 3-bit eight per three bytes, 4-bit two per
byte). ``bits=16`` keeps the latents as float16 instead: the 16-bit row of the tables.

Parts, per token (all (B, S, ...)): ``k_codes`` (B, S, ⌈R_k·b/8⌉) uint8, ``k_scale`` and ``k_zero``
(B, S, G_k) float16, and the same for ``v`` (at 16 bits: ``k`` (B, S, R_k) and ``v`` (B, S, R_v)
float16). With ``residual > 0`` the newest ``residual`` tokens stay as given (KIVI's full-precision
window; see :class:`~lrkv_core.cache.storage.LatentStore`). Attention reads the dequantized latents
``z + q·s``, the very tensors :func:`lrkv_core.quant.fake_quantize` gives, and the bytes the cache reports
are these tensors'.
A decode step's flash-decoding kernel reads the packed parts themselves (:attr:`LatentView.packed`,
:class:`~lrkv_kernels.latent_rope.PackedLatents`): the view :class:`QuantizedStore` gives dequantizes only
when its ``keys`` or ``values`` are read (prefill, the unfused path), so the kernel's path never writes a
dequantized copy of the cache.
Rotating each group's rank dimension first (``--rotation``, fused into the weights) spreads the whitened
latents' energy before quantization.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from lrkv_kernels.latent_rope import PackedLatents

from ..quant import INTEGER_BITS, QuantizedRows, dequantize, group_widths, pack_codes, quantize, unpack_codes
from .storage import (
    CACHE_STORAGES,
    CacheStorage,
    LatentStore,
    LatentView,
    split_groups,
    unrotated_codes_warning,
)

STORED_BITS = (*INTEGER_BITS, 16)


class QuantizedStore(LatentStore):
    """Keeps latents as packed codes + float16 scales and zero-points (or as float16 at 16 bits).

    Parameters
    ----------
    ranks_k, ranks_v : per-group ranks of the layer.
    bits : 2, 3, 4, 8 (integer codes) or 16 (float16 latents).
    quant_group_size : width of a quantization group; None: each latent group's whole row.
    residual : newest tokens kept as given (full precision).
    """

    def __init__(
        self,
        ranks_k: Sequence[int],
        ranks_v: Sequence[int],
        bits: int,
        quant_group_size: int | None = None,
        residual: int = 0,
    ) -> None:
        super().__init__(ranks_k, ranks_v, residual=residual)
        self.bits = bits
        group = None if bits == 16 else quant_group_size  # float16 latents have no quantization groups
        self.widths = {  # quantization group widths along each row
            "k": group_widths(self.ranks_k, group),
            "v": group_widths(self.ranks_v, group),
        }

    def encode(self, h_k: torch.Tensor, h_v: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.bits == 16:
            return {"k": h_k.to(torch.float16), "v": h_v.to(torch.float16)}
        parts = {}
        for kind, h in (("k", h_k), ("v", h_v)):
            parts |= self._packed(kind, quantize(h, self.widths[kind], self.bits))
        return parts

    def _packed(self, kind: str, q: QuantizedRows) -> dict[str, torch.Tensor]:
        """Quantized rows as ``kind``'s parts: packed codes (B, T, ⌈R·b/8⌉), scales, zero-points (B, T, G)."""
        return {
            f"{kind}_codes": pack_codes(q.codes, self.bits, check=False),
            f"{kind}_scale": q.scale,
            f"{kind}_zero": q.zero,
        }

    def _dequantized(self, parts: Mapping[str, torch.Tensor], kind: str, dtype: torch.dtype) -> torch.Tensor:
        """``kind``'s packed parts dequantized: (B, S, R) in ``dtype``."""
        codes = unpack_codes(parts[f"{kind}_codes"], self.bits, sum(self.widths[kind]))  # (B, S, R)
        rows = QuantizedRows(codes, parts[f"{kind}_scale"], parts[f"{kind}_zero"])
        return dequantize(rows, self.widths[kind], dtype)

    def _latents(self, parts: Mapping[str, torch.Tensor], kind: str) -> torch.Tensor:
        """The dequantized latents (B, S, R) of ``kind``, in the model's dtype."""
        if self.bits == 16:
            return parts[kind].to(self.dtype)
        return self._dequantized(parts, kind, self.dtype)

    def decode(self, parts: Mapping[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], ...]:
        return (
            split_groups(self._latents(parts, "k"), self.ranks_k),
            split_groups(self._latents(parts, "v"), self.ranks_v),
        )

    def view(self) -> LatentView:
        """Every stored token; with integer codes, a view that also hands out the packed parts and
        dequantizes only when its latents are read. A subclass that decodes otherwise (GEAR adds its
        residual) and a store with nothing encoded yet give the plain view."""
        plain = type(self).decode is QuantizedStore.decode and type(self)._latents is QuantizedStore._latents
        if self.bits == 16 or not plain or not self._encoded():
            return super().view()
        snapshot = copy.copy(self)  # parts, window and positions as they are now (the store reassigns them)
        packed = (self._packed_latents("k"), self._packed_latents("v"))
        return PackedLatentView(lambda: LatentStore.view(snapshot), self.positions, packed)

    def _packed_latents(self, kind: str) -> PackedLatents:
        """``kind``'s packed parts and residual window as the decode kernel reads them."""
        ranks = self.ranks_k if kind == "k" else self.ranks_v
        widths = self.widths[kind]
        recent = self.recent[kind] if self.recent and self.recent[kind].shape[1] else None
        return PackedLatents(
            self.parts[f"{kind}_codes"], self.parts[f"{kind}_scale"], self.parts[f"{kind}_zero"], self.bits,
            None if widths == ranks else widths[0], recent, self.dtype,
        )  # fmt: skip


class PackedLatentView(LatentView):
    """A :class:`LatentView` of a quantized store: ``packed`` (keys, values) as
    :class:`~lrkv_kernels.latent_rope.PackedLatents`, and the per-group latents decoded (once) only when
    ``keys`` or ``values`` are read."""

    def __init__(
        self,
        decoded: Callable[[], LatentView],
        positions: torch.Tensor | None,
        packed: tuple[PackedLatents, PackedLatents],
    ) -> None:
        object.__setattr__(self, "positions", positions)
        object.__setattr__(self, "_decoded", decoded)
        object.__setattr__(self, "_view", None)
        object.__setattr__(self, "_packed", packed)

    def _latent_view(self) -> LatentView:
        if self._view is None:
            object.__setattr__(self, "_view", self._decoded())
        return self._view

    @property
    def keys(self) -> tuple[torch.Tensor, ...]:
        return self._latent_view().keys

    @property
    def values(self) -> tuple[torch.Tensor, ...]:
        return self._latent_view().values

    @property
    def packed(self) -> tuple[PackedLatents, PackedLatents]:
        return self._packed


def check_options(storage: CacheStorage, allowed_bits: Sequence[int], *counts: str) -> None:
    """The options every quantizing storage shares: ``bits`` among ``allowed_bits``, a quantization group
    size ≥ 1 or None, and the named ``counts`` (tokens, entries, ranks) ≥ 0."""
    if storage.bits not in allowed_bits:
        raise ValueError(
            f"{storage.name} cache bits must be one of {tuple(allowed_bits)}, got {storage.bits}"
        )
    if storage.quant_group_size is not None and storage.quant_group_size < 1:
        raise ValueError(f"quant_group_size must be ≥ 1 or null, got {storage.quant_group_size}")
    for field in counts:
        if getattr(storage, field) < 0:
            raise ValueError(f"{storage.name} cache {field} must be ≥ 0, got {getattr(storage, field)}")


@CACHE_STORAGES.register
@dataclass(frozen=True)
class QuantizedStorage(CacheStorage):
    """Latents as packed 2/3/4/8-bit codes, fp16 per-token scales and zero-points (Palu), or fp16 (16)."""

    name: ClassVar[str] = "quantized"
    bits: int = 4
    quant_group_size: int | None = None  # None: one quantization group per latent group row
    residual: int = 0  # newest tokens kept in full precision (KIVI's residual length)

    def __post_init__(self) -> None:
        check_options(self, STORED_BITS, "residual")

    def check_ranks(self, ranks: Sequence[int]) -> None:
        """A quantization group size must divide every latent group's rank (integer bits only)."""
        if self.bits != 16:
            group_widths(ranks, self.quant_group_size)

    def create_store(self, ranks_k: tuple[int, ...], ranks_v: tuple[int, ...]) -> QuantizedStore:
        return QuantizedStore(ranks_k, ranks_v, self.bits, self.quant_group_size, self.residual)

    def rotation_warning(self, rotation: str) -> str | None:
        return unrotated_codes_warning(self.name, self.bits, rotation)

    def check_static(self) -> None:
        """Tokens are quantized one by one as they enter: preallocatable, unless a residual window holds
        the newest tokens back (they are encoded later, when the window pushes them out)."""
        if self.residual:
            raise ValueError(
                f"a quantized cache with a residual window ({self.residual} tokens) encodes tokens after "
                "they enter, so it cannot be preallocated (static); use residual 0 or a LatentCache"
            )
