"""Bit packing of integer codes: b-bit codes (b ∈ {2, 3, 4, 8}) stored densely in bytes, along the last dim.

Codes are packed in blocks of ``lcm(b, 8)`` bits: a block holds ``c = lcm(b, 8) / b`` codes in
``lcm(b, 8) / 8`` bytes, code j of a block in bits ``[b·j, b·j + b)`` of the little-endian block word:

| bits | codes per block | bytes per block | bits per code stored |
|---|---|---|---|
| 2 | 4 | 1 | 2 |
| 3 | 8 | 3 | 3 |
| 4 | 2 | 1 | 4 |
| 8 | 1 | 1 | 8 |

3-bit codes go eight to three bytes, so nothing is wasted: "ten per int32" would leave 2 of every 32 bits
empty (6.25 %), and more when a row is not a multiple of ten. A row of n codes is padded with zero codes
to a whole number of blocks, so it takes :func:`packed_width` ``= ⌈n / c⌉ · bytes per block`` bytes; ranks
are multiples of 8 in practice, and then no row is padded.

:func:`pack_codes` / :func:`unpack_codes` are the vectorised forms used by the cache; :func:`pack_codes_ref` /
:func:`unpack_codes_ref` are the spec: the codes written out as one little-endian bit stream, bit by bit.
"""

from __future__ import annotations

import math

import torch

PACKED_BITS = (2, 3, 4, 8)


def _block(bits: int) -> tuple[int, int]:
    """``(codes, bytes)`` per block of ``lcm(bits, 8)`` bits."""
    if bits not in PACKED_BITS:
        raise ValueError(f"codes of {bits} bits cannot be packed; supported: {PACKED_BITS}")
    block_bits = math.lcm(bits, 8)
    return block_bits // bits, block_bits // 8


def packed_width(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits take once packed (whole blocks)."""
    codes, nbytes = _block(bits)
    return -(-n // codes) * nbytes


def _padded(codes: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero codes appended along the last dim to a multiple of ``multiple``."""
    pad = -codes.shape[-1] % multiple
    return torch.nn.functional.pad(codes, (0, pad)) if pad else codes


def _check_codes(codes: torch.Tensor, bits: int) -> None:
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if bits < 8 and codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"a code exceeds {bits} bits (max {int(codes.max())})")


def pack_codes(codes: torch.Tensor, bits: int, *, check: bool = True) -> torch.Tensor:
    """Pack b-bit codes along the last dim.

    Parameters
    ----------
    codes : (..., n) uint8, every value < 2**bits.
    bits : 2, 3, 4 or 8.
    check : refuse codes of more than ``bits`` bits. The check reads the codes' maximum back to the host (a
        device sync per call on a GPU, which a CUDA graph cannot capture): callers whose codes are in range
        by construction (a quantizer's clamped output, as the caches write) pass False.

    Returns
    -------
    (..., packed_width(n, bits)) uint8.
    """
    per_block, nbytes = _block(bits)
    if check:
        _check_codes(codes, bits)
    if bits == 8:
        return codes.clone()
    blocks = _padded(codes, per_block).unflatten(-1, (-1, per_block)).to(torch.int32)  # (..., nb, c)
    shifts = torch.arange(per_block, dtype=torch.int32, device=codes.device) * bits  # (c,)
    word = (blocks << shifts).sum(-1, dtype=torch.int32)  # (..., nb): fields do not overlap, so sum = or
    byte_shifts = torch.arange(nbytes, dtype=torch.int32, device=codes.device) * 8  # (nbytes,)
    packed = (word.unsqueeze(-1) >> byte_shifts) & 0xFF  # (..., nb, nbytes)
    return packed.flatten(-2).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: (..., packed_width(n, bits)) uint8 → (..., n) uint8 codes."""
    per_block, nbytes = _block(bits)
    if packed.shape[-1] != packed_width(n, bits):
        raise ValueError(f"{packed.shape[-1]} bytes cannot hold exactly {n} codes of {bits} bits")
    if bits == 8:
        return packed.clone()
    if nbytes == 1:  # 2 and 4 bits: a byte's codes cut with byte-wide shifts, no wider word
        mask = (1 << bits) - 1
        fields = [(packed >> (bits * j)) & mask for j in range(per_block)]
        return torch.stack(fields, dim=-1).flatten(-2)[..., :n]
    blocks = packed.unflatten(-1, (-1, nbytes)).to(torch.int32)  # (..., nb, nbytes)
    byte_shifts = torch.arange(nbytes, dtype=torch.int32, device=packed.device) * 8
    word = (blocks << byte_shifts).sum(-1, dtype=torch.int32)  # (..., nb)
    shifts = torch.arange(per_block, dtype=torch.int32, device=packed.device) * bits  # (c,)
    codes = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., nb, c)
    return codes.flatten(-2)[..., :n].to(torch.uint8)


def pack_codes_ref(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Reference packing: every code's bits, least significant first, as one stream; 8 bits per byte."""
    per_block, _ = _block(bits)
    _check_codes(codes, bits)
    padded = _padded(codes, per_block).to(torch.int64)  # (..., n')
    bit_idx = torch.arange(bits)
    stream = ((padded.unsqueeze(-1) >> bit_idx) & 1).flatten(-2)  # (..., n'·bits): code i bit k at i·bits + k
    weights = 2 ** torch.arange(8)  # stream bit 8m + k is bit k of byte m
    return (stream.unflatten(-1, (-1, 8)) * weights).sum(-1).to(torch.uint8)


def unpack_codes_ref(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Reference unpacking: the bit stream of the bytes, cut into ``bits``-bit codes, the first ``n`` kept."""
    stream = ((packed.to(torch.int64).unsqueeze(-1) >> torch.arange(8)) & 1).flatten(-2)  # (..., 8·bytes)
    usable = stream.shape[-1] // bits * bits
    codes = (stream[..., :usable].unflatten(-1, (-1, bits)) * 2 ** torch.arange(bits)).sum(-1)
    return codes[..., :n].to(torch.uint8)
