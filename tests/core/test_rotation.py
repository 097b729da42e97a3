"""Rotations of the latent rank dimension (lrkv_core.quant.rotation): the matrices, and fusing them into a
model.

Fused offline, a rotation leaves every product ``B A`` unchanged, so without quantization the compressed
model's logits do not move (to float rounding) on every architecture kind (RoPE keys rebuilt; keys folded
into q_proj for OPT; biases for Qwen2), while the cached latents really are rotated.
"""

from __future__ import annotations

import pytest
import torch

from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from lrkv_core.format import LrkvFormat
from lrkv_core.quant import fake_quantize
from lrkv_core.quant.rotation import (
    check_rotation,
    hadamard,
    random_orthogonal,
    rotate_factors,
    rotation_matrix,
)
from tests.support.inputs import ids_for, max_diff
from tests.support.models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

EYE = torch.eye


@pytest.mark.parametrize(
    "n",
    [1, 2, 4, 8, 64, 256, 12, 24, 44, 28, 56, 36, 40, 72, 120, 144],
    ids=lambda n: f"H{n}",
)
def test_hadamard_matrices_are_orthogonal_with_equal_magnitude_entries(n: int) -> None:
    """Sylvester (powers of 2), Paley I (12, 24, 44, 72), Paley II (28, 36), Kronecker (40, 56, 144)."""
    h = hadamard(n)
    assert h is not None and h.shape == (n, n) and h.dtype == torch.float64
    assert torch.allclose(h @ h.T, EYE(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64))
    assert (h[0] > 0).all()  # the leading latent goes to every coordinate alike


@pytest.mark.parametrize("n", [3, 6, 10, 184])
def test_orders_without_a_hadamard_matrix_here(n: int) -> None:
    assert hadamard(n) is None


def test_every_multiple_of_8_up_to_256_but_184_and_232_has_a_hadamard_matrix() -> None:
    """What docs/methods.md and docs/quantized-cache.md promise for ranks on the default rank multiple."""
    missing = set()
    for n in range(8, 257, 8):
        h = hadamard(n)
        if h is None:
            missing.add(n)
        else:
            assert torch.allclose(h @ h.T, EYE(n, dtype=torch.float64), atol=1e-10), n
    assert missing == {184, 232}


def test_random_orthogonal_is_orthogonal_seeded_and_has_a_constant_first_row() -> None:
    q = random_orthogonal(24, seed=5)
    assert torch.allclose(q @ q.T, EYE(24, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(q[0], torch.full((24,), 24**-0.5, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, random_orthogonal(24, seed=5)) and not torch.equal(q, random_orthogonal(24, seed=6))


@pytest.mark.parametrize("n", [56, 57], ids=["Hadamard", "random"])
def test_a_dominant_leading_latent_goes_into_the_zero_point(n: int) -> None:
    """Key latents are often one large leading coordinate and small others. With the rotation's first row
    constant, the leading latent shifts every rotated coordinate alike, which the per-token zero-point
    absorbs; the grid spans the other latents only. A Haar-random rotation, or the same matrix with its
    columns' signs alternating, spreads it over the grid's range instead."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(512, n, generator=gen, dtype=torch.float64) * torch.logspace(
        0, -1, n, dtype=torch.float64
    )
    h[:, 0] = h[:, 0] * 0.5 + 8.0
    haar, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    ours, _ = rotation_matrix(n, "auto", 0)
    alternating = ours * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).double()

    def error(r: torch.Tensor) -> float:
        return ((fake_quantize(h @ r, (n,), 3) @ r.T - h).norm() / h.norm()).item()

    assert error(ours) < 0.6 * error(alternating) and error(ours) < 0.5 * error(haar)


def test_policies_pick_their_matrices() -> None:
    assert rotation_matrix(16, "none", 0) == (None, "none")
    assert rotation_matrix(16, "hadamard", 0)[1] == rotation_matrix(16, "auto", 0)[1] == "hadamard"
    assert rotation_matrix(6, "auto", 0)[1] == "orthogonal"
    with pytest.raises(ValueError, match="no Hadamard matrix of order 6"):
        rotation_matrix(6, "hadamard", 0)
    with pytest.raises(ValueError, match=r"order \[6\]"):
        check_rotation("hadamard", [[8, 6], [8, 8]])
    check_rotation("auto", [[8, 6]])
    with pytest.raises(ValueError, match="unknown rotation 'spin'"):
        CompressionConfig(rotation="spin")


def test_rotated_factors_keep_the_product() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(8, 20, generator=gen, dtype=torch.float64),
        torch.randn(16, 8, generator=gen, dtype=torch.float64),
    )
    ra, rb = rotate_factors(a, b, hadamard(8))
    assert torch.allclose(rb @ ra, b @ a, atol=1e-12) and not torch.allclose(ra, a)


def test_a_hadamard_rotation_spreads_decaying_latents_and_cuts_quantization_error() -> None:
    """Whitened latents carry most energy in their first coordinates; rotated, every coordinate carries the
    average, and per-token 2/3-bit quantization loses much less (measured after rotating back)."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(512, 32, generator=gen, dtype=torch.float64) * torch.logspace(
        1, -2, 32, dtype=torch.float64
    )
    r = hadamard(32)
    for bits in (2, 3):
        plain = (fake_quantize(h, (32,), bits) - h).pow(2).mean()
        rotated = (fake_quantize(h @ r, (32,), bits) @ r.T - h).pow(2).mean()
        assert rotated < 0.5 * plain


def _compressed(arch: str, rotation: str, ratio: float = 0.5, rank_multiple: int = 4):
    model = tiny_model(arch, 4 if arch == "opt" else 2)
    rows = torch.randint(3, 61, (8, 24), generator=torch.Generator().manual_seed(1))
    config = CompressionConfig(
        ratio=ratio, group_size=1, rank_multiple=rank_multiple, allocator="uniform", rotation=rotation
    )
    return plan_conversion(model, rows, config).apply(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
@pytest.mark.parametrize("rotation", ["hadamard", "auto"])
def test_a_fused_rotation_leaves_the_unquantized_model_unchanged(arch: str, rotation: str) -> None:
    plain, rotated = _compressed(arch, "none"), _compressed(arch, rotation)
    ids = ids_for(2, 12)
    with torch.no_grad():
        ref, got = plain(ids, use_cache=True), rotated(ids, use_cache=True)
    assert max_diff(got.logits, ref.logits) <= 1e-4
    # ... while the cache holds other latents: h' = Rᵀ h, of the same norm per group
    h_ref, h_rot = (c.past_key_values.layers[0].store.parts["k"] for c in (ref, got))
    assert max_diff(h_rot, h_ref) > 1e-2
    assert torch.allclose(h_rot.norm(dim=-1), h_ref.norm(dim=-1), rtol=1e-4)
    fmt = LrkvFormat.of(rotated.config)
    assert (fmt.rotation, fmt.rotation_seed) == (rotation, 0) and LrkvFormat.of(
        plain.config
    ).rotation == "none"


def test_auto_rotates_ranks_without_a_hadamard_matrix_and_hadamard_refuses_them_before_any_edit() -> None:
    """Ranks of 6 (ratio 0.75 of a group of 8, multiple 2): auto draws random orthogonal matrices."""
    plain, auto = _compressed("llama", "none", 0.75, 2), _compressed("llama", "auto", 0.75, 2)
    assert LrkvFormat.of(auto.config).ranks_k == [[6, 6], [6, 6]]
    ids = ids_for(2, 12)
    with torch.no_grad():
        assert max_diff(auto(ids).logits, plain(ids).logits) <= 1e-4
    model = tiny_model("llama", 2)
    rows = torch.randint(3, 61, (8, 24), generator=torch.Generator().manual_seed(1))
    config = CompressionConfig(
        ratio=0.75, group_size=1, rank_multiple=2, allocator="uniform", rotation="hadamard"
    )
    conversion = plan_conversion(model, rows, config)
    with pytest.raises(ValueError, match=r"--rotation hadamard: no Hadamard matrix of order \[6\]"):
        conversion.apply(model)
    assert not hasattr(model.config, "lrkv")  # refused before the model was touched
