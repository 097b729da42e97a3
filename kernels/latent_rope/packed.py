"""Quantized latents as the decode kernel reads them: packed b-bit codes with float16 scales and zero-points.

A quantized cache keeps each token's latents (one row of R values, the layer's groups side by side) as
b-bit codes ``q`` packed along the row, and per quantization group a float16 scale ``s`` and zero-point
``z``: the latent is ``z + q·s``, computed in float32 and rounded to the model's dtype. The packing
(lrkv's quantized storage) cuts the row's codes into blocks of ``lcm(b, 8)`` bits, code j of a block in bits
``[b·j, b·j + b)`` of the little-endian block word, so code c of the row occupies bits ``[b·c, b·c + b)`` of
the row's little-endian bit stream: 2-, 4- and 8-bit codes lie in one byte, a 3-bit code in one byte or
across two neighbouring ones. A quantization group is a whole latent group's row (``group_width`` None) or
sub-groups of ``group_width`` latents that cut every group's rank evenly.

The newest tokens may be kept unquantized (a residual window): ``recent`` (B, S_r, R), after the packed
tokens.

:func:`dequantize_ref` is the spec of that layout (the bit stream cut into codes, then ``z + q·s``);
:func:`latent_decode_attention_packed_ref` is the decode attention over packed latents: dequantize, then
:func:`~lrkv_kernels.latent_rope.decode.latent_decode_attention_ref`. The Triton kernel
(:mod:`lrkv_kernels.latent_rope.flash`) unpacks the codes in registers instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .decode import LatentDecodeWeights, latent_decode_attention_ref

PACKED_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class PackedLatents:
    """One layer's key or value latents as a quantized cache holds them.

    ``codes`` (B, S_p, ⌈R·b/8⌉) uint8: each token's R codes of ``bits`` bits packed along the row;
    ``scale``, ``zero`` (B, S_p, G_q) float16: per token and quantization group; ``group_width``: the
    quantization groups' width, or None for one per latent group; ``recent`` (B, S_r, R) the newest tokens
    unquantized, or None; ``dtype``: the latents' dtype (what ``z + q·s`` is rounded to).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_width: int | None
    recent: torch.Tensor | None
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.bits not in PACKED_BITS:
            raise ValueError(f"packed codes have {PACKED_BITS} bits, got {self.bits}")
        if self.codes.dtype != torch.uint8 or self.scale.shape != self.zero.shape:
            raise ValueError(
                f"codes must be uint8 and scale/zero of one shape: {self.codes.dtype}, "
                f"{tuple(self.scale.shape)}, {tuple(self.zero.shape)}"
            )

    @property
    def packed_tokens(self) -> int:
        """S_p, the tokens held as codes (the first ones)."""
        return self.codes.shape[1]

    def __len__(self) -> int:
        """S, every token (packed, then recent)."""
        return self.packed_tokens + (0 if self.recent is None else self.recent.shape[1])


def unpack_ref(codes: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first ``n`` codes (..., n) int64 of packed rows (..., bytes): the rows' little-endian bit stream
    cut into ``bits``-bit fields."""
    stream = (codes.long().unsqueeze(-1) >> torch.arange(8, device=codes.device)) & 1  # (..., bytes, 8)
    stream = stream.flatten(-2)[..., : n * bits].unflatten(-1, (n, bits))  # (..., n, bits)
    return (stream << torch.arange(bits, device=codes.device)).sum(-1)


def quant_groups(ranks: Sequence[int], group_width: int | None) -> list[int]:
    """The quantization group of each of a row's R latents (groups of ``ranks``)."""
    if group_width is None:
        return [g for g, r in enumerate(ranks) for _ in range(r)]
    if any(r % group_width for r in ranks):
        raise ValueError(f"quantization groups of {group_width} do not cut ranks {tuple(ranks)}")
    return [c // group_width for c in range(sum(ranks))]


def dequantize_ref(latents: PackedLatents, ranks: Sequence[int]) -> torch.Tensor:
    """All S tokens' latents (B, S, R) in ``latents.dtype``: ``z + q·s`` (float32) of the packed ones, then
    the recent ones."""
    n = sum(ranks)
    q = unpack_ref(latents.codes, latents.bits, n).float()  # (B, S_p, R)
    which = torch.tensor(quant_groups(ranks, latents.group_width), device=q.device)
    scale, zero = latents.scale.float()[..., which], latents.zero.float()[..., which]  # (B, S_p, R)
    out = (q * scale + zero).to(latents.dtype)
    if latents.recent is None:
        return out
    return torch.cat([out, latents.recent.to(latents.dtype)], dim=1)


def weights_ranks(weights: LatentDecodeWeights) -> tuple[list[int], list[int]]:
    """The per-group key and value ranks of a layer's decode weights."""
    return [int(r) for r in weights.ranks_k], [int(r) for r in weights.ranks_v]


def latent_decode_attention_packed_ref(
    q: torch.Tensor,
    h_k: PackedLatents,
    h_v: PackedLatents,
    weights: LatentDecodeWeights,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    scaling: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~lrkv_kernels.latent_rope.decode.latent_decode_attention_ref` over packed key and value latents
    (same arguments, ``h_k``/``h_v`` as :class:`PackedLatents`): dequantized, then attended; (B, width) in
    the latents' dtype."""
    ranks_k, ranks_v = weights_ranks(weights)
    keys, values = dequantize_ref(h_k, ranks_k), dequantize_ref(h_v, ranks_v)
    return latent_decode_attention_ref(
        q, keys, values, weights, positions, inv_freq, attention_scaling, scaling, mask
    )
