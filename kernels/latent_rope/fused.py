"""Triton kernel: attention scores against keys rebuilt from latents, never writing the keys.

For one group of ``s`` KV heads, a program takes one batch row and a tile of ``BLOCK_S`` cached tokens. It
computes the tile's RoPE tables once (cos/sin from ``inv_freq`` at the tokens' positions, as HF's rotary
embedding does); then for each KV head it rebuilds the tile's keys from the latents in registers
(``h B_kᵀ + b_k``, accumulated over chunks of the rank), rotates them, and writes ``scaling · q · k`` for
each of the head's query heads and query tokens. The cache is read as latents (``r`` numbers per token
instead of ``s·D``); the keys exist only in registers.
Spec: :func:`lrkv_kernels.latent_rope.reference.latent_rope_scores_ref`.

Imported lazily by the dispatcher: ``TRITON_INTERPRET=1`` must be set before this module is first imported
for the kernel to run on CPU tensors (how the tests run it without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# The tiling (64 tokens, 64 latents per reconstruction step, 4 warps) was chosen from the 12 tilings
# benchmarks/fused_decode.py --tiles timed on an H100 (SmolLM2's and Llama-3.2-1B's shapes, bf16, batch 8,
# 1K to 16K tokens); docs/fused-decode.md has the table and how noisy those timings were.
BLOCK_S = 64  # cached tokens per program
BLOCK_R = 64  # latents per step of the reconstruction
NUM_WARPS = 4


@triton.jit
def _scores_kernel(
    q_ptr, h_ptr, up_ptr, bias_ptr, pos_ptr, inv_freq_ptr, out_ptr,
    S, T, n_rep, scaling, rope_scaling,
    sq_b, sq_h, sq_t, sq_d,
    sh_b, sh_s, sh_r,
    su_o, su_r,
    sp_b, sp_s,
    so_b, so_h, so_t, so_s,
    S_HEADS: tl.constexpr, R: tl.constexpr, N_Q: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
    ACCURATE_TRIG: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)  # b · stride can pass 2³¹ elements on long, wide batches
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)  # (BLOCK_S,) token slots
    offs_d = tl.arange(0, HALF_P)  # (HALF_P,) rotation pairs, padded to a power of two
    mask_s, mask_d = offs_s < S, offs_d < HALF

    # RoPE tables of the tile, shared by the group's KV heads
    pos = tl.load(pos_ptr + b * sp_b + offs_s * sp_s, mask=mask_s, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + offs_d, mask=mask_d, other=0.0)
    angle = pos[:, None] * inv_freq[None, :]  # (BLOCK_S, HALF_P), as HF: float32 product, then cos/sin
    if ACCURATE_TRIG:  # libdevice's cos/sin on a GPU (exact to an ulp at angles of thousands of radians)
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:  # the interpreter (numpy's cos/sin) has no libdevice
        cos, sin = tl.cos(angle), tl.sin(angle)
    cos, sin = cos * rope_scaling, sin * rope_scaling

    for kv in tl.static_range(S_HEADS):
        rows1 = kv * 2 * HALF + offs_d  # up rows of the KV head's first half (HF's half-split RoPE)
        rows2 = rows1 + HALF
        k1 = tl.zeros((BLOCK_S, HALF_P), dtype=tl.float32)
        k2 = tl.zeros((BLOCK_S, HALF_P), dtype=tl.float32)
        for r0 in tl.static_range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mask_r = offs_r < R
            h = tl.load(
                h_ptr + b * sh_b + offs_s[:, None] * sh_s + offs_r[None, :] * sh_r,
                mask=mask_s[:, None] & mask_r[None, :], other=0.0,
            )  # (BLOCK_S, BLOCK_R)  # fmt: skip
            up_mask = mask_r[:, None] & mask_d[None, :]
            up1 = tl.load(up_ptr + offs_r[:, None] * su_r + rows1[None, :] * su_o, mask=up_mask, other=0.0)
            up2 = tl.load(up_ptr + offs_r[:, None] * su_r + rows2[None, :] * su_o, mask=up_mask, other=0.0)
            k1 = tl.dot(h, up1, k1, input_precision=PRECISION)  # (BLOCK_S, HALF_P)
            k2 = tl.dot(h, up2, k2, input_precision=PRECISION)
        if HAS_BIAS:
            k1 += tl.load(bias_ptr + rows1, mask=mask_d, other=0.0).to(tl.float32)[None, :]
            k2 += tl.load(bias_ptr + rows2, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        r1 = k1 * cos - k2 * sin  # rope(k) = k·cos + rotate_half(k)·sin, rotate_half(k1, k2) = (−k2, k1)
        r2 = k2 * cos + k1 * sin

        for i in tl.static_range(N_Q):  # the KV head's query heads × query tokens
            head = kv * n_rep + i // T
            t = i % T
            q_row = q_ptr + b * sq_b + head * sq_h + t * sq_t
            q1 = tl.load(q_row + offs_d * sq_d, mask=mask_d, other=0.0).to(tl.float32)
            q2 = tl.load(q_row + (offs_d + HALF) * sq_d, mask=mask_d, other=0.0).to(tl.float32)
            score = tl.sum(r1 * q1[None, :] + r2 * q2[None, :], axis=1) * scaling  # (BLOCK_S,)
            tl.store(out_ptr + b * so_b + head * so_h + t * so_t + offs_s * so_s, score, mask=mask_s)


def latent_rope_scores_triton(
    q: torch.Tensor,
    h: torch.Tensor,
    up: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    scaling: float,
    *,
    block_s: int = BLOCK_S,
    block_r: int = BLOCK_R,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """:func:`~lrkv_kernels.latent_rope.reference.latent_rope_scores_ref` in one Triton launch (same
    arguments; (B, n_q, T, S) float32). float32 latents reconstruct in IEEE float32, not TF32. ``block_s``,
    ``block_r`` and ``num_warps`` are the launch's tiling (powers of two, at least 16)."""
    B, n_q, T, D = q.shape
    S, R = h.shape[1], h.shape[2]
    s = up.shape[0] // D
    if D % 2 or up.shape[0] != s * D or n_q % s or up.shape[1] != R:
        raise ValueError(f"shapes do not pair: q {tuple(q.shape)}, h {tuple(h.shape)}, up {tuple(up.shape)}")
    up = up.to(h.dtype)
    out = torch.empty(B, n_q, T, S, device=q.device, dtype=torch.float32)
    if S == 0:
        return out
    half = D // 2
    grid = (B, triton.cdiv(S, block_s))
    _scores_kernel[grid](
        q, h, up, up if bias is None else bias, positions, inv_freq.float().contiguous(), out,
        S, T, n_q // s, float(scaling), float(attention_scaling),
        *q.stride(), *h.stride(), *up.stride(), *positions.stride(), *out.stride(),
        S_HEADS=s, R=R, N_Q=n_q // s * T, HALF=half, HALF_P=max(16, triton.next_power_of_2(half)),
        HAS_BIAS=bias is not None,
        BLOCK_S=block_s, BLOCK_R=block_r, PRECISION="ieee" if h.dtype == torch.float32 else "tf32",
        ACCURATE_TRIG=q.is_cuda, num_warps=num_warps,
    )  # fmt: skip
    return out
