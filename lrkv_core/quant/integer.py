"""Per-token asymmetric integer quantization of latent rows, group by group (Palu §3.3; KIVI per token).

A row (one token's latents of one layer, n values) is cut into quantization groups of given widths (a whole
latent group's rank r_g, or sub-groups of it). Each group gets a float16 zero-point ``z`` and scale ``s``, and
each value a b-bit code ``q ∈ [0, 2^b − 1]``:

    z = fp16_down(min x),   s = fp16_up((max x − z) / (2^b − 1)),   q = round((x − z) / s),   x̂ = z + q·s.

Rounding ``z`` down and ``s`` up (to the neighbouring float16) keeps the group's whole range ``[min, max]``
inside the grid, so no code is ever clipped and ``|x − x̂| ≤ s / 2`` (plus float32 rounding). The stored
form is what the cache holds and what :func:`dequantize` reads back; :func:`fake_quantize` is exactly
``dequantize(quantize(x))``, the reference that attention over a quantized cache must reproduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

INTEGER_BITS = (2, 3, 4, 8)
_HALF = torch.float16


@dataclass(frozen=True)
class QuantizedRows:
    """Codes (..., n) uint8 (unpacked), and per group the float16 scale (..., G) and zero-point (..., G)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def _fp16_toward(t: torch.Tensor, direction: float) -> torch.Tensor:
    """``t`` (float32) as float16, rounded toward ``direction`` (−inf: down, +inf: up) when not exact."""
    h = t.to(_HALF)
    off = h.float() > t if direction < 0 else h.float() < t
    return torch.where(off, torch.nextafter(h, torch.full_like(h, direction)), h)


def _uniform(widths: Sequence[int]) -> bool:
    return len(set(widths)) == 1


OUT_OF_RANGE = "latents outside the float16 range cannot be quantized with float16 scales"


def _quantize_equal(x: torch.Tensor, width: int, bits: int) -> QuantizedRows:
    """Groups of one width: x (..., G·w) → codes (..., G·w), scale and zero (..., G)."""
    qmax = (1 << bits) - 1
    xg = x.float().unflatten(-1, (-1, width))  # (..., G, w)
    zero = _fp16_toward(xg.amin(-1), float("-inf"))  # (..., G)
    scale = _fp16_toward((xg.amax(-1) - zero.float()) / qmax, float("inf"))  # (..., G)
    finite = torch.isfinite(zero).all() & torch.isfinite(scale).all()
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        if not finite:
            raise ValueError(OUT_OF_RANGE)
    else:  # checked on the device (reading the flag back would stall every cache write for the GPU) or in
        torch._assert_async(finite, OUT_OF_RANGE)  # a compiled graph, which cannot branch on a tensor
    s = scale.float().unsqueeze(-1)  # (..., G, 1)
    q = torch.where(s > 0, (xg - zero.float().unsqueeze(-1)) / s.clamp_min(1e-30), 0.0)
    codes = q.round().clamp_(0, qmax).to(torch.uint8)  # (..., G, w)
    return QuantizedRows(codes.flatten(-2), scale, zero)


def quantize(x: torch.Tensor, widths: Sequence[int], bits: int) -> QuantizedRows:
    """Quantize rows group by group.

    Parameters
    ----------
    x : (..., n) latents, any float dtype; n = Σ widths.
    widths : the quantization groups' widths, in order along the last dim.
    bits : 2, 3, 4 or 8.

    Returns
    -------
    :class:`QuantizedRows`: codes (..., n) uint8, scale and zero (..., G) float16 with G = len(widths).
    """
    if bits not in INTEGER_BITS:
        raise ValueError(f"integer quantization takes {INTEGER_BITS} bits, got {bits}")
    if x.shape[-1] != sum(widths):
        raise ValueError(f"rows of width {x.shape[-1]} cannot hold quantization groups {tuple(widths)}")
    if _uniform(widths):
        return _quantize_equal(x, widths[0], bits)
    parts = [_quantize_equal(xg, xg.shape[-1], bits) for xg in torch.split(x, list(widths), dim=-1)]
    return QuantizedRows(
        torch.cat([p.codes for p in parts], dim=-1),
        torch.cat([p.scale for p in parts], dim=-1),
        torch.cat([p.zero for p in parts], dim=-1),
    )


def dequantize(q: QuantizedRows, widths: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``x̂ = z + q·s`` (computed in float32), (..., n) in ``dtype``."""
    if _uniform(widths):
        codes = q.codes.unflatten(-1, (-1, widths[0])).float()  # (..., G, w)
        x = codes * q.scale.float().unsqueeze(-1) + q.zero.float().unsqueeze(-1)
        return x.flatten(-2).to(dtype)
    scale, zero = q.scale.float(), q.zero.float()  # (..., G)
    groups = torch.split(q.codes, list(widths), dim=-1)  # (..., w_g) each
    out = [c.float() * scale[..., g : g + 1] + zero[..., g : g + 1] for g, c in enumerate(groups)]
    return torch.cat(out, dim=-1).to(dtype)


def fake_quantize(x: torch.Tensor, widths: Sequence[int], bits: int) -> torch.Tensor:
    """``dequantize(quantize(x))`` in x's dtype: the values a quantized cache gives back for ``x``."""
    return dequantize(quantize(x, widths, bits), widths, x.dtype)


def group_widths(ranks: Sequence[int], quant_group_size: int | None) -> tuple[int, ...]:
    """Quantization group widths of a row of latent groups with ``ranks``: each rank whole (None), or cut
    into sub-groups of ``quant_group_size``, which must divide every rank."""
    if quant_group_size is None:
        return tuple(int(r) for r in ranks)
    bad = [r for r in ranks if r % quant_group_size]
    if bad:
        raise ValueError(
            f"quantization group size {quant_group_size} does not divide the latent group rank(s) "
            f"{sorted(set(bad))}"
        )
    return tuple(quant_group_size for r in ranks for _ in range(r // quant_group_size))
