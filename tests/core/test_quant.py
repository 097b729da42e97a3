"""Bit packing and per-token asymmetric quantization (lrkv_core.quant), against their references."""

from __future__ import annotations

import pytest
import torch

from lrkv_core.quant import (
    INTEGER_BITS,
    PACKED_BITS,
    dequantize,
    fake_quantize,
    group_widths,
    pack_codes,
    pack_codes_ref,
    packed_width,
    quantize,
    unpack_codes,
    unpack_codes_ref,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# odd shapes: leading dims of every rank, rows shorter than a block, not a multiple of one, and long ones
SHAPES = [(1,), (3,), (7,), (2, 9), (3, 5, 24), (2, 1, 3, 31), (4, 0), (1, 2, 130)]


def _codes(shape: tuple[int, ...], bits: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 1 << bits, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("bits", PACKED_BITS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_pack_matches_the_bit_stream_reference_and_round_trips(bits: int, shape: tuple[int, ...]) -> None:
    codes = _codes(shape, bits)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], packed_width(shape[-1], bits))
    assert torch.equal(packed, pack_codes_ref(codes, bits))
    n = shape[-1]
    assert torch.equal(unpack_codes(packed, bits, n), codes)
    assert torch.equal(unpack_codes_ref(packed, bits, n), codes)


@pytest.mark.parametrize(
    ("bits", "n", "nbytes"),
    [(2, 4, 1), (2, 5, 2), (3, 8, 3), (3, 1, 3), (3, 64, 24), (4, 2, 1), (4, 3, 2), (8, 5, 5), (2, 64, 16)],
)
def test_packed_width_is_bits_per_code_in_whole_blocks(bits: int, n: int, nbytes: int) -> None:
    """2-bit: four per byte; 3-bit: eight per three bytes (no bit wasted); 4-bit: two per byte."""
    assert packed_width(n, bits) == nbytes


def test_every_code_value_survives_at_every_position() -> None:
    """All 2^b values in every slot of a block (a shift or mask error shows up at some position)."""
    for bits in PACKED_BITS:
        values = torch.arange(1 << bits, dtype=torch.uint8)
        per_block = 24 // bits if bits == 3 else 8 // bits
        for slot in range(per_block):
            codes = torch.zeros(len(values), per_block + 1, dtype=torch.uint8)
            codes[:, slot] = values
            assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, per_block + 1), codes)


def test_packing_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="exceeds 3 bits"):
        pack_codes(torch.tensor([8], dtype=torch.uint8), 3)
    with pytest.raises(TypeError, match="uint8"):
        pack_codes(torch.tensor([1]), 2)
    with pytest.raises(ValueError, match="cannot be packed"):
        pack_codes(torch.tensor([1], dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="cannot hold exactly 9 codes"):
        unpack_codes(torch.zeros(2, dtype=torch.uint8), 3, 9)


def _rows(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Latent-like rows: energy decaying along the last dim, plus an offset per row."""
    gen = torch.Generator().manual_seed(seed)
    decay = torch.linspace(8.0, 0.05, shape[-1])
    return torch.randn(shape, generator=gen) * decay + torch.randn(*shape[:-1], 1, generator=gen)


def _steps(q, widths: tuple[int, ...], shape: torch.Size) -> torch.Tensor:
    """Each value's quantization step s (broadcast from its group's scale)."""
    per_value = torch.repeat_interleave(q.scale.float(), torch.tensor(widths), dim=-1)
    assert per_value.shape == shape
    return per_value


@pytest.mark.parametrize("bits", INTEGER_BITS)
@pytest.mark.parametrize("widths", [(24,), (8, 8, 8), (16, 8), (5, 3, 1)], ids=str)
def test_quantization_error_is_at_most_half_a_step_and_codes_are_in_range(bits: int, widths) -> None:
    x = _rows((3, 7, sum(widths)))
    q = quantize(x, widths, bits)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape and int(q.codes.max()) < 1 << bits
    assert q.scale.dtype == q.zero.dtype == torch.float16 and q.scale.shape == (3, 7, len(widths))
    x_hat = dequantize(q, widths, torch.float32)
    step = _steps(q, widths, x.shape)
    assert ((x - x_hat).abs() <= step / 2 + 1e-6 * x.abs() + 1e-7).all()
    # the grid covers each group's range: zero-point ≤ min and zero + (2^b − 1)·s ≥ max
    for g, group in enumerate(torch.split(x, list(widths), dim=-1)):
        zero, scale = q.zero[..., g].float(), q.scale[..., g].float()
        assert (zero <= group.amin(-1)).all()
        top = group.amax(-1)
        assert (zero + ((1 << bits) - 1) * scale >= top - 1e-6 * top.abs()).all()


def test_error_halves_with_each_bit() -> None:
    x = _rows((4, 16, 32))
    errors = [(x - fake_quantize(x, (32,), b)).abs().max().item() for b in INTEGER_BITS]
    assert all(e1 > 1.7 * e2 for e1, e2 in zip(errors, errors[1:]))


def test_groups_of_different_widths_are_quantized_independently() -> None:
    x = _rows((2, 5, 24))
    whole = quantize(x, (16, 8), 3)
    parts = [quantize(xg, (xg.shape[-1],), 3) for xg in torch.split(x, [16, 8], dim=-1)]
    assert torch.equal(whole.codes, torch.cat([p.codes for p in parts], -1))
    assert torch.equal(whole.scale, torch.cat([p.scale for p in parts], -1))
    assert torch.equal(whole.zero, torch.cat([p.zero for p in parts], -1))


def test_constant_groups_come_back_exactly_and_fake_quantize_is_dequantize_of_quantize() -> None:
    x = torch.full((2, 3, 8), 0.25)  # representable in float16: the zero-point holds it exactly
    assert torch.equal(fake_quantize(x, (8,), 2), x)
    y = _rows((2, 3, 16)).double()
    q = quantize(y, (8, 8), 4)
    assert torch.equal(fake_quantize(y, (8, 8), 4), dequantize(q, (8, 8), torch.float64))


def test_values_beyond_float16_are_refused() -> None:
    with pytest.raises(ValueError, match="float16 range"):
        quantize(torch.tensor([[1e6, 0.0]]), (2,), 4)


def test_group_widths() -> None:
    assert group_widths([16, 8], None) == (16, 8)
    assert group_widths([16, 8], 8) == (8, 8, 8)
    with pytest.raises(ValueError, match=r"does not divide the latent group rank\(s\) \[12\]"):
        group_widths([16, 12], 8)
