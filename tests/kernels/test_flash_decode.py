"""The flash-decoding kernel over latents: a whole layer's decode attention (every group, keys rebuilt in
registers, online softmax over splits of the sequence, the value latents) equals its torch reference.

Without a GPU the Triton kernel runs in Triton's interpreter on CPU tensors (tests/conftest.py sets
``TRITON_INTERPRET=1`` when no CUDA device is present); with one, the tests run on the GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lrkv_kernels.latent_rope import (
    LatentDecodeWeights,
    additive_mask,
    latent_decode_attention,
    latent_decode_attention_ref,
    triton_runs_on,
)

pytest.importorskip("triton", reason="the kernel needs Triton (installed by scripts/setup.sh)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the GPU, or the interpreter on the CPU


def layer(B, S, s, D, n_rep, ranks_k, ranks_v, bias, dtype=torch.float32, offset=500, seed=0, norm_eps=None):
    """Random inputs of one layer: queries (B, H, D), latents (B, S, R), its weights (with a random key
    RMSNorm scale (D,) where ``norm_eps`` is given), positions (B, S) with row b starting at b·offset,
    Llama's inv_freq."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    G = len(ranks_k)
    q = rand(B, G * s * n_rep, D)
    h_k, h_v = rand(B, S, sum(ranks_k)), rand(B, S, sum(ranks_v))
    ups = [rand(s * D, r) / r**0.5 for r in ranks_k]
    biases = [rand(s * D) if bias else None for _ in ranks_k]
    norm = None if norm_eps is None else 1 + 0.3 * rand(D).float()
    weights = LatentDecodeWeights.build(ups, biases, list(ranks_v), s * n_rep, dtype, norm, norm_eps or 0.0)
    positions = (torch.arange(S) + offset * torch.arange(B)[:, None]).to(DEVICE, torch.int32)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)).to(DEVICE)
    return q, h_k, h_v, weights, positions, inv_freq


def relative_error(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize(
    "B, S, s, D, n_rep, ranks_k, ranks_v, bias",
    [
        (2, 37, 2, 8, 3, (5,), (7,), True),  # stories260k's head_dim 8: pairs padded to 16
        (2, 150, 1, 32, 2, (24, 40), (16, 33), True),  # two groups of different ranks, several splits
        (1, 70, 1, 64, 3, (96, 80, 100), (96, 64, 20), False),  # SmolLM2's head_dim, three groups
        (3, 9, 3, 80, 1, (16,), (16,), False),  # head_dim 80: 40 pairs padded to 64
        (1, 1, 1, 64, 1, (1,), (1,), True),  # one cached token of rank 1
        (1, 300, 2, 32, 1, (130,), (140,), False),  # ranks over two reconstruction steps; values over 128
    ],
)
def test_kernel_equals_reference_float32(B, S, s, D, n_rep, ranks_k, ranks_v, bias):
    assert triton_runs_on(torch.device(DEVICE))
    args = layer(B, S, s, D, n_rep, ranks_k, ranks_v, bias)
    got = latent_decode_attention(*args, attention_scaling=1.1, scaling=D**-0.5)
    ref = latent_decode_attention_ref(*args, attention_scaling=1.1, scaling=D**-0.5)
    assert got.shape == (B, sum(s * n_rep * r for r in ranks_v)) and got.dtype == torch.float32
    assert relative_error(got, ref) < 1e-5


@pytest.mark.parametrize(
    "B, S, s, D, n_rep, ranks_k, ranks_v, bias",
    [
        (2, 37, 2, 8, 3, (5,), (7,), True),  # head_dim 8: the norm's pairs padded to 16 (zeros add nothing)
        (2, 150, 2, 32, 2, (24, 40), (16, 33), False),  # two groups of two KV heads, several splits
        (3, 9, 3, 80, 1, (16,), (16,), True),  # head_dim 80: 40 pairs padded to 64
        (1, 70, 1, 128, 2, (96, 80), (64, 20), False),  # Qwen3's head_dim
    ],
)
def test_key_norm_kernel_equals_reference(B, S, s, D, n_rep, ranks_k, ranks_v, bias):
    """QK-norm (Qwen3): each KV head's rebuilt keys RMS-normed over their D dims and scaled before RoPE."""
    args = layer(B, S, s, D, n_rep, ranks_k, ranks_v, bias, norm_eps=1e-6)
    got = latent_decode_attention(*args, attention_scaling=1.0, scaling=D**-0.5)
    ref = latent_decode_attention_ref(*args, attention_scaling=1.0, scaling=D**-0.5)
    assert relative_error(got, ref) < 1e-5
    # the norm is really applied: the same layer without it attends differently
    weights = args[3]
    plain = dataclasses.replace(weights, norm_weight=None, norm_eps=0.0)
    unnormed = latent_decode_attention_ref(
        *args[:3], plain, *args[4:], attention_scaling=1.0, scaling=D**-0.5
    )
    assert relative_error(unnormed, ref) > 1e-2


def test_key_norm_reference_is_the_per_head_rms_norm():
    """The reference's key norm is transformers' Qwen3 k_norm (per KV head, over D, before RoPE)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from lrkv_kernels.latent_rope import reconstruct_rope_keys_ref, rope_tables

    gen = torch.Generator().manual_seed(3)
    B, S, s, D, r = 2, 5, 2, 16, 12
    h, up, bias = torch.randn(B, S, r, generator=gen), torch.randn(s * D, r, generator=gen), None
    norm = Qwen3RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
    cos, sin = rope_tables(torch.arange(S).expand(B, S), 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
    got = reconstruct_rope_keys_ref(h, up, bias, cos, sin, D, key_norm=(norm.weight.detach(), 1e-6))
    with torch.no_grad():
        keys = norm((h @ up.T).view(B, S, s, D)).transpose(1, 2)  # (B, s, S, D)
    expected = keys * cos[:, None] + torch.cat((-keys[..., D // 2 :], keys[..., : D // 2]), -1) * sin[:, None]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_partial_rotary_frequencies_are_refused():
    """The kernel rotates all D dims: fewer frequencies (partial RoPE, Phi-4-mini) fail loudly."""
    from lrkv_kernels.latent_rope.flash import latent_decode_attention_triton

    q, h_k, h_v, weights, positions, inv_freq = layer(1, 20, 1, 16, 2, (8,), (8,), False)
    with pytest.raises(ValueError, match="rotates all D = 16 dims, got 4 frequencies"):
        latent_decode_attention_triton(q, h_k, h_v, weights, positions, inv_freq[:4], 1.0, 0.25)


@pytest.mark.parametrize(
    "s, D, n_rep, norm, bias",
    [
        (3, 64, 3, False, True),  # SmolLM2's group: three KV heads of 64, padded to four in a block
        (4, 32, 2, True, False),  # four KV heads with QK-norm
        (2, 80, 1, True, True),  # head_dim 80: 40 pairs padded to 64 per head
        (1, 16, 4, False, False),  # one KV head, GQA 4
    ],
)
@pytest.mark.parametrize("layout", [(1, False), (2, False), (4, False), (4, True)])
def test_every_head_layout_gives_the_same_attention(s, D, n_rep, norm, bias, layout):
    """KV heads rebuilt one at a time, in blocks (the last one padded), or all at once with ``B_k`` read
    once per program: the same attention, with the key norm and bias applied per head."""
    from lrkv_kernels.latent_rope.flash import latent_decode_attention_triton

    heads, hoist = layout
    args = layer(2, 100, s, D, n_rep, (24, 17), (12, 9), bias, norm_eps=1e-6 if norm else None)
    ref = latent_decode_attention_ref(*args, attention_scaling=1.0, scaling=D**-0.5)
    got = latent_decode_attention_triton(
        *args, 1.0, D**-0.5, block_s=16, heads_per_block=heads, hoist=hoist
    )  # fmt: skip
    assert relative_error(got, ref) < 1e-5


def test_head_layout_defaults_and_refusals():
    from lrkv_kernels.latent_rope.flash import heads_per_block, hoists, latent_decode_attention_triton

    assert heads_per_block(3, 32, 128, 2) == 4  # SmolLM2 at half width: 3 heads of 32 pairs, 64 KiB of B_k
    assert heads_per_block(3, 32, 256, 4) == 1  # SmolLM2 at full rank in float32: 64 KiB per head
    assert heads_per_block(4, 64, 256, 2) == 1  # Llama-8B's groups at half width
    assert heads_per_block(4, 64, 64, 2) == 2  # ... at an eighth: two heads of 64 pairs fill 128 columns
    assert heads_per_block(1, 64, 512, 2) == 1
    assert hoists(3, 4, 128, 32, 2)  # 2 × 128 × 128 bfloat16 values: 64 KiB
    assert not hoists(3, 4, 256, 32, 2) and not hoists(4, 2, 64, 64, 2)
    args = layer(1, 20, 3, 16, 1, (8,), (8,), False)
    with pytest.raises(ValueError, match="power of two, got 3"):
        latent_decode_attention_triton(*args, 1.0, 0.25, heads_per_block=3)
    with pytest.raises(ValueError, match="3 KV heads in one block, got 2"):
        latent_decode_attention_triton(*args, 1.0, 0.25, heads_per_block=2, hoist=True)


@pytest.mark.parametrize("n_splits", [1, 2, 5])
def test_splits_merge_to_the_same_attention(n_splits):
    """However the sequence is split, the merged partial softmaxes give the one-pass result."""
    from lrkv_kernels.latent_rope.flash import latent_decode_attention_triton

    args = layer(2, 200, 1, 32, 2, (24, 16), (8, 24), True)
    ref = latent_decode_attention_ref(*args, attention_scaling=1.0, scaling=0.2)
    got = latent_decode_attention_triton(*args, 1.0, 0.2, n_splits=n_splits, block_s=16)
    assert relative_error(got, ref) < 1e-5


def test_mask_and_fully_masked_splits():
    """An additive mask (padding, a sliding window) reaches every score; a split whose tokens are all masked
    adds nothing, and a row with no token left is NaN, as torch's softmax over nothing."""
    from lrkv_kernels.latent_rope.flash import latent_decode_attention_triton

    q, h_k, h_v, weights, positions, inv_freq = layer(3, 120, 2, 16, 2, (12,), (10,), False)
    keep = torch.ones(3, 1, 1, 120, dtype=torch.bool, device=DEVICE)
    keep[0, ..., :70] = False  # left padding over the first splits
    keep[1, ..., 100:] = False  # a window that ended before the last tokens
    keep[2] = False
    mask = additive_mask(keep, 120)
    got = latent_decode_attention_triton(
        q, h_k, h_v, weights, positions, inv_freq, 1.0, 0.25, mask, n_splits=4, block_s=16
    )
    ref = latent_decode_attention_ref(q, h_k, h_v, weights, positions, inv_freq, 1.0, 0.25, mask)
    assert relative_error(got[:2], ref[:2]) < 1e-5
    assert got[2].isnan().all() and ref[2].isnan().all()
    # the masked tokens do not count: dropping them gives the same rows
    alone = latent_decode_attention_ref(
        q[:1], h_k[:1, 70:], h_v[:1, 70:], weights, positions[:1, 70:], inv_freq, 1.0, 0.25
    )
    assert relative_error(got[:1], alone) < 1e-5


def test_additive_mask_reads_boolean_and_float_masks():
    keep = torch.tensor([[True, False, True]]).view(1, 1, 1, 3)
    assert additive_mask(keep, 2).tolist() == [[0.0, float("-inf")]]
    added = torch.tensor([[0.0, -3.0, -float("inf")]]).view(1, 1, 1, 3)
    assert additive_mask(added, 3).tolist() == [[0.0, -3.0, float("-inf")]]
    assert additive_mask(None, 3) is None


def test_positions_far_out_keep_float32_accuracy():
    """Angles of tens of thousands of radians: the kernel's cos/sin follow torch's on the same float32
    angle (an approximate cos would drift there)."""
    q, h_k, h_v, weights, _, inv_freq = layer(1, 64, 1, 64, 2, (32,), (32,), False)
    positions = torch.arange(60_000, 60_064, device=DEVICE, dtype=torch.int32)[None]
    args = (q, h_k, h_v, weights, positions, inv_freq)
    got = latent_decode_attention(*args, attention_scaling=1.0, scaling=0.125)
    ref = latent_decode_attention_ref(*args, attention_scaling=1.0, scaling=0.125)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="half-precision tl.dot needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("S", [3000, 40_000])
@pytest.mark.parametrize("latent_scores", [False, True])
def test_kernel_half_precision_on_cuda(dtype, S, latent_scores):
    from lrkv_kernels.latent_rope.flash import latent_decode_attention_triton

    args = layer(4, S, 3, 64, 3, (96,), (96,), True, dtype=dtype)
    got = latent_decode_attention_triton(*args, 1.0, 0.125, latent_scores=latent_scores)
    ref = latent_decode_attention_ref(*args, attention_scaling=1.0, scaling=0.125)
    assert relative_error(got, ref) < (3e-3 if dtype == torch.float16 else 2e-2)
