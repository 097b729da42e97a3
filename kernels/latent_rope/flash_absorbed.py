"""Triton kernel: a layer's decode attention over rotated-key latents
(:func:`lrkv_kernels.latent_rope.absorbed.absorbed_decode_attention_ref`) in one flash-decoding launch: one
program per batch row, latent group and split of the cached tokens; per tile of tokens the absorbed queries'
scores against the key latents (one product: no key is rebuilt), the mask, an online softmax and the
attention-weighted value latents; a second launch merges the splits (:mod:`.flash`'s). Dense latents or a
quantized cache's packed codes are read as :mod:`.flash` reads them (unpacked in registers). Imported lazily
by the dispatcher, like :mod:`.flash`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import LatentDecodeWeights
from .flash import (
    _TL_DTYPES,
    NUM_STAGES,
    NUM_WARPS,
    Splits,
    _group_columns,
    _latent_tile,
    _online_softmax,
    _pow2,
    sources,
    words_of,
)
from .packed import PackedLatents


@triton.jit(do_not_specialize=["k_qw", "v_qw"])
def _absorbed_decode_kernel(
    q_ptr, hk_ptr, hv_ptr, mask_ptr, rk_ptr, rv_ptr, koff_ptr, voff_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    acc_ptr, m_ptr, l_ptr,
    S, S_packed, k_qw, v_qw, split_len, n_splits, scaling,
    sq_b, sq_h, sq_r,
    shk_b, shk_s, shk_r,
    shv_b, shv_s, shv_r,
    sm_b, sm_s,
    skc_b, skc_s, sks_b, sks_s, sks_g,
    svc_b, svc_s, svs_b, svs_s, svs_g,
    G: tl.constexpr, NQ: tl.constexpr, NQ_P: tl.constexpr, RK_P: tl.constexpr, RV_P: tl.constexpr,
    HAS_MASK: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr, DTYPE: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_WORDS: tl.constexpr, V_WORDS: tl.constexpr,
    K_SUB: tl.constexpr, K_RECENT: tl.constexpr, V_SUB: tl.constexpr, V_RECENT: tl.constexpr,
    K_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // G).to(tl.int64)
    g = pid % G
    rk, koff = _group_columns(rk_ptr, koff_ptr, g, K_ALIGN)
    rv, voff = _group_columns(rv_ptr, voff_ptr, g, V_ALIGN)
    offs_h = tl.arange(0, NQ_P)
    mask_h = offs_h < NQ
    offs_r = tl.arange(0, RK_P)
    mask_r = offs_r < rk
    offs_rv = tl.arange(0, RV_P)
    q = tl.load(
        q_ptr + b * sq_b + (g * NQ + offs_h)[:, None] * sq_h + offs_r[None, :] * sq_r,
        mask=mask_h[:, None] & mask_r[None, :], other=0.0,
    ).to(tl.float32)  # fmt: skip
    q = (q * scaling).to(DTYPE)  # (NQ_P, RK_P): the scores' product in the latents' dtype

    m_i = tl.full((NQ_P,), float("-inf"), tl.float32)
    l_i = tl.zeros((NQ_P,), tl.float32)
    acc = tl.zeros((NQ_P, RV_P), tl.float32)
    start = split * split_len
    for t in range(0, split_len // BLOCK_S):
        offs_s = start + t * BLOCK_S + tl.arange(0, BLOCK_S)
        mask_s = offs_s < S
        h = _latent_tile(
            hk_ptr, shk_b, shk_s, shk_r, kc_ptr, skc_b, skc_s, ks_ptr, kz_ptr, sks_b, sks_s, sks_g,
            b, offs_s, mask_s, koff, rk, g, k_qw, S_packed, RK_P, K_BITS, K_WORDS, K_SUB, K_RECENT, DTYPE,
        )  # (BLOCK_S, RK_P)  # fmt: skip
        scores = tl.dot(q, tl.trans(h), input_precision=PRECISION)  # (NQ_P, BLOCK_S) float32
        if HAS_MASK:
            scores += tl.load(mask_ptr + b * sm_b + offs_s * sm_s, mask=mask_s, other=0.0)[None, :]
        p, alpha, m_i, l_i = _online_softmax(scores, mask_s, m_i, l_i)
        v = _latent_tile(
            hv_ptr, shv_b, shv_s, shv_r, vc_ptr, svc_b, svc_s, vs_ptr, vz_ptr, svs_b, svs_s, svs_g,
            b, offs_s, mask_s, voff, rv, g, v_qw, S_packed, RV_P, V_BITS, V_WORDS, V_SUB, V_RECENT, DTYPE,
        )  # (BLOCK_S, RV_P)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)

    row = (pid * NQ_P + offs_h) * n_splits + split
    tl.store(m_ptr + row, m_i)
    tl.store(l_ptr + row, l_i)
    tl.store(acc_ptr + row[:, None] * RV_P + offs_rv[None, :], acc)


def absorbed_decode_attention_triton(
    q: torch.Tensor,
    h_k: torch.Tensor | PackedLatents,
    h_v: torch.Tensor | PackedLatents,
    weights: LatentDecodeWeights,
    scaling: float,
    mask: torch.Tensor | None = None,
    *,
    n_splits: int | None = None,
    block_s: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    unpack_words: bool = True,
) -> torch.Tensor:
    """:func:`~lrkv_kernels.latent_rope.absorbed.absorbed_decode_attention_ref` in two launches (same
    arguments and result). The launch's defaults can be overridden: ``n_splits``, ``block_s`` (tokens per
    tile, a power of two ≥ 16), ``num_warps``, ``num_stages``, ``unpack_words`` (as
    :func:`~lrkv_kernels.latent_rope.flash.latent_decode_attention_triton`'s)."""
    src_k, src_v = sources(h_k, h_v)
    B, H, R = q.shape
    G = weights.ranks_k.shape[0]
    if H % G or R < weights.up.shape[2]:
        raise ValueError(
            f"queries {tuple(q.shape)} do not cover {G} groups of key rank ≤ {weights.up.shape[2]}"
        )
    nq = H // G
    S = src_k.length
    dtype = src_k.dtype
    out = torch.empty(B, weights.width, device=q.device, dtype=src_v.dtype)
    if S == 0:
        return out.fill_(float("nan"))
    rv_p, rk_p, nq_p = _pow2(weights.max_rank_v), _pow2(weights.up.shape[2]), _pow2(nq)
    block_s = block_s or 64
    splits = Splits.plan(S, block_s, B * G, nq_p, rv_p, q.device, n_splits)
    k_words, v_words = words_of(src_k, src_v, weights, unpack_words)
    if mask is not None:
        mask = mask.to(torch.float32)
    _absorbed_decode_kernel[(B * G, splits.n_splits)](
        q, src_k.dense, src_v.dense, q if mask is None else mask,
        weights.ranks_k, weights.ranks_v, weights.k_offsets, weights.v_offsets,
        src_k.codes, src_k.scale, src_k.zero, src_v.codes, src_v.scale, src_v.zero,
        splits.acc, splits.m, splits.l,
        S, src_k.packed_tokens, src_k.group_width, src_v.group_width, splits.split_len, splits.n_splits,
        float(scaling),
        *q.stride(), *src_k.strides(), *src_v.strides(), *((0, 0) if mask is None else mask.stride()),
        *src_k.packed_strides(), *src_v.packed_strides(),
        G=G, NQ=nq, NQ_P=nq_p, RK_P=rk_p, RV_P=rv_p, HAS_MASK=mask is not None, BLOCK_S=block_s,
        PRECISION="ieee" if dtype == torch.float32 else "tf32", DTYPE=_TL_DTYPES[dtype],
        K_BITS=src_k.bits, V_BITS=src_v.bits,
        K_WORDS=k_words, V_WORDS=v_words,
        K_SUB=src_k.group_width > 0, K_RECENT=src_k.has_recent, V_SUB=src_v.group_width > 0,
        V_RECENT=src_v.has_recent,
        K_ALIGN=weights.k_align, V_ALIGN=weights.v_align,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    splits.combine(weights, out, G, nq, nq_p, rv_p)
    return out
