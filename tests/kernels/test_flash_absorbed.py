"""Decode attention over latents of rotated keys (projected after RoPE, queries absorbed): the Triton kernel
equals its torch reference over dense latents and a quantized cache's packed codes, and at full rank the
reference is the original attention.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (tests/conftest.py sets
``TRITON_INTERPRET=1`` when no CUDA device is present); with one, the tests run on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from lrkv_kernels.latent_rope import (
    LatentDecodeWeights,
    absorbed_decode_attention,
    absorbed_decode_attention_ref,
    apply_rope,
    rope_tables,
    triton_runs_on,
)
from tests.kernels.test_flash_decode import DEVICE, relative_error
from tests.kernels.test_flash_decode_packed import packed

pytest.importorskip("triton", reason="the kernel needs Triton (installed by scripts/setup.sh)")


def absorbed_layer(B, S, nq, ranks_k, ranks_v, dtype=torch.float32, seed=0):
    """Random absorbed queries (B, G·nq, max r_k), key and value latents (B, S, R) and the layout."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    q = rand(B, len(ranks_k) * nq, max(ranks_k))
    h_k, h_v = rand(B, S, sum(ranks_k)), rand(B, S, sum(ranks_v))
    return q, h_k, h_v, LatentDecodeWeights.layout(list(ranks_k), list(ranks_v), nq, DEVICE)


CASES = [  # B, S, nq, ranks_k, ranks_v
    (2, 37, 6, (5,), (7,)),  # odd ranks (3-bit codes cross bytes), queries padded to 16 rows
    (2, 150, 4, (24, 40), (16, 33)),  # two groups of different ranks, several splits
    (1, 70, 9, (96, 80, 16), (96, 64, 24)),  # SmolLM2's 9 query heads per group, three groups
    (1, 1, 1, (1,), (1,)),  # one cached token of rank 1
    (1, 300, 2, (130,), (140,)),  # ranks over 128
]


@pytest.mark.parametrize("B, S, nq, ranks_k, ranks_v", CASES)
def test_kernel_equals_reference_float32(B, S, nq, ranks_k, ranks_v):
    assert triton_runs_on(torch.device(DEVICE))
    args = absorbed_layer(B, S, nq, ranks_k, ranks_v)
    got = absorbed_decode_attention(*args, scaling=0.125)
    ref = absorbed_decode_attention_ref(*args, scaling=0.125)
    assert got.shape == (B, sum(nq * r for r in ranks_v)) and got.dtype == torch.float32
    assert relative_error(got, ref) < 1e-5


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize(
    "ranks_k, ranks_v, group_width, recent",
    [((5,), (7,), None, 0), ((24, 16), (8, 24), 8, 27), ((13, 11), (6, 10), None, 3)],
)
def test_packed_kernel_equals_reference(bits, ranks_k, ranks_v, group_width, recent):
    """Packed codes unpacked in registers (quantization sub-groups, a residual window) give the attention of
    the dequantized latents."""
    q, h_k, h_v, weights = absorbed_layer(2, 120, 3, ranks_k, ranks_v)
    k = packed(h_k, ranks_k, bits, group_width, recent)
    v = packed(h_v, ranks_v, bits, group_width, recent)
    ref = absorbed_decode_attention_ref(q, k, v, weights, scaling=0.2)
    got = absorbed_decode_attention(q, k, v, weights, scaling=0.2)
    assert relative_error(got, ref) < 1e-5
    assert relative_error(ref, absorbed_decode_attention_ref(q, h_k, h_v, weights, scaling=0.2)) > 1e-3


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codes_read_by_words_equal_codes_read_one_by_one(bits):
    """Ranks that start every group at a whole word: codes cut from whole words give the attention that
    codes read one by one give, and the reference's."""
    from lrkv_kernels.latent_rope.flash_absorbed import absorbed_decode_attention_triton

    q, h_k, h_v, weights = absorbed_layer(2, 90, 3, (24, 16), (8, 32))
    k, v = packed(h_k, (24, 16), bits, 8, 7), packed(h_v, (8, 32), bits, None, 7)
    ref = absorbed_decode_attention_ref(q, k, v, weights, scaling=0.2)
    words = absorbed_decode_attention_triton(q, k, v, weights, 0.2, block_s=16)
    codes = absorbed_decode_attention_triton(q, k, v, weights, 0.2, block_s=16, unpack_words=False)
    assert weights.k_align == weights.v_align == 8 and relative_error(words, ref) < 1e-5
    torch.testing.assert_close(words, codes, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n_splits", [1, 3, 7])
def test_splits_and_masks_merge_to_the_same_attention(n_splits):
    """However the sequence is split, with masks that empty whole splits or all but one token of a row."""
    from lrkv_kernels.latent_rope.flash_absorbed import absorbed_decode_attention_triton

    q, h_k, h_v, weights = absorbed_layer(3, 200, 4, (24, 16), (8, 24))
    mask = torch.zeros(3, 200, device=DEVICE)
    mask[0, :150] = float("-inf")  # the first splits of row 0 see nothing
    mask[1, 1:] = float("-inf")  # row 1 attends to its first token only
    mask[2] = torch.linspace(-3, 0, 200)
    ref = absorbed_decode_attention_ref(q, h_k, h_v, weights, 0.2, mask)
    got = absorbed_decode_attention_triton(q, h_k, h_v, weights, 0.2, mask, n_splits=n_splits, block_s=16)
    assert relative_error(got, ref) < 1e-5
    assert torch.allclose(got[1, :8].float(), h_v[1, 0, :8].float(), atol=1e-6)  # one token: its values


def test_full_rank_is_the_original_attention():
    """Keys projected after RoPE on an orthogonal basis per group, queries absorbed (U_jᵀ rope(q)) and the
    values kept whole (B_v = I): each query head's slice of the output is the original GQA attention; a
    basis cut to half the width is not."""
    gen = torch.Generator().manual_seed(3)
    B, S, Hkv, D, s, n_rep = 2, 50, 4, 16, 2, 3
    G, nq = Hkv // s, s * n_rep
    q = torch.randn(B, Hkv * n_rep, D, generator=gen)
    k, v = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    positions = torch.arange(S)[None].expand(B, -1)
    cos, sin = rope_tables(positions, inv_freq, 1.0)  # (B, S, D)
    k_rot = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)  # (B, S, Hkv, D)
    q_rot = apply_rope(q[:, :, None], cos[:, -1:], sin[:, -1:])[:, :, 0]  # the query at the last position
    scores = torch.einsum("bhd,bshd->bhs", q_rot, k_rot.repeat_interleave(n_rep, dim=2)) * D**-0.5
    original = torch.einsum("bhs,bshd->bhd", scores.softmax(-1), v.repeat_interleave(n_rep, dim=2))

    def rotated(rank):
        bases = [torch.linalg.qr(torch.randn(s * D, s * D, generator=gen))[0][:, :rank] for _ in range(G)]
        h_k = torch.cat([k_rot[:, :, g * s : (g + 1) * s].flatten(2) @ U for g, U in enumerate(bases)], -1)
        q_abs = torch.stack(
            [q_rot[:, h] @ bases[h // nq][(h % nq) // n_rep * D :][:D] for h in range(G * nq)], dim=1
        )
        h_v = v.flatten(2)  # every group's values whole: rank s·D
        weights = LatentDecodeWeights.layout([rank] * G, [s * D] * G, nq, "cpu")
        out = absorbed_decode_attention_ref(q_abs, h_k, h_v, weights, D**-0.5).view(B, G, nq, s, D)
        return torch.stack([out[:, h // nq, h % nq, (h % nq) // n_rep] for h in range(G * nq)], dim=1)

    assert relative_error(rotated(s * D), original) < 1e-5
    assert relative_error(rotated(s * D // 2), original) > 1e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="half precision runs on the GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_half_precision_on_cuda(dtype):
    args = absorbed_layer(4, 3000, 9, (96,), (96,), dtype)
    got = absorbed_decode_attention(*args, scaling=0.125)
    ref = absorbed_decode_attention_ref(*args, scaling=0.125)
    assert got.dtype == dtype and relative_error(got, ref) < 2e-2
