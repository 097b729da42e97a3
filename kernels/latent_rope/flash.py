"""Triton kernels: a whole layer's decode attention over latents, in one launch (flash-decoding).

For a decode step (one query token per sequence), one program takes a batch row, a group of ``s`` KV heads
and a split of the cached tokens. It walks its split in tiles of ``BLOCK_S`` tokens; for each tile it

- computes the tile's RoPE tables once (cos/sin of the float32 angle ``position · inv_freq``, as HF's
  rotary embedding does), shared by the group's KV heads;
- rebuilds the keys of a block of the group's KV heads side by side in registers from the key latents
  (``h_k B_kᵀ + b_k``, one product per half of the rotation pairs; :func:`heads_per_block` says how many
  heads), RMS-norms each head's keys over its D dims where the model norms its keys (QK-norm: Qwen3),
  rotates them and takes the scores of all the group's query heads in one product (each query head's row
  holds its own KV head's columns);
- adds the attention mask, updates a running maximum and sum (online softmax), and accumulates the
  attention-weighted **value latents** (``p · h_v``): values are never rebuilt, since ``B_v`` is folded
  into ``o_proj``.

A quantized cache's latents (:class:`~lrkv_kernels.latent_rope.packed.PackedLatents`) are read as their
packed b-bit codes (2, 3, 4 or 8 bits) with float16 scales and zero-points: :func:`_latent_tile` loads the
bytes that hold a whole number of codes once, cuts every code out of them in the registers of the thread
that loaded them, and dequantizes it, ``z + q·s`` in float32 rounded to the latents' dtype, exactly as the
cache's own dequantization, so no dequantized copy of the cache is ever written. Tokens of the cache's
unquantized residual window (after the packed ones) are read as they are.

Each program writes its split's partial sums; :func:`_combine_kernel` merges the splits of every query head
into the layout ``o_proj`` reads (per group, head after head, ``r_v`` latents each). Splitting the sequence
lets a long context use the whole GPU at small batch. The cache is read once, as latents; keys, scores and
probabilities exist only in registers.

Spec: :func:`lrkv_kernels.latent_rope.reference.latent_decode_attention_ref`, over packed latents
:func:`lrkv_kernels.latent_rope.packed.latent_decode_attention_packed_ref`. Imported lazily by the
dispatcher: ``TRITON_INTERPRET=1`` must be set before this module is first imported for the kernels to run on
CPU tensors (how the tests run them without a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..interpreter import read_scalars_as_indices
from .decode import LatentDecodeWeights, rope_tables_for
from .packed import PackedLatents

read_scalars_as_indices()  # the sequence loop's trip count is a run-time value

NUM_WARPS = 4
NUM_STAGES = 1  # software pipelining of the sequence loop multiplies its shared memory (over an H200's at 3)
MIN_SPLIT_TILES = 2  # a split walks at least this many tiles, so its partial sums are worth their write
PROGRAMS_PER_SM = 8  # programs in flight per multiprocessor: their loads hide each other's latency
MAX_SPLITS = 256
BLOCK_COLUMNS = 128  # key columns (KV heads × rotation pairs) one product rebuilds per token
BLOCK_BYTES = 64 * 1024  # B_k rows one product reads (or a program holds across its sequence loop)


@triton.jit
def _latent_tile(
    dense_ptr, sd_b, sd_s, sd_r, codes_ptr, sc_b, sc_s, scale_ptr, zero_ptr, ss_b, ss_s, ss_g,
    b, offs_s, mask_s, start, n, g, qw, S_packed,
    C: tl.constexpr, BITS: tl.constexpr, WORD_BYTES: tl.constexpr, SUBGROUPS: tl.constexpr,
    RECENT: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """The latents (BLOCK_S, C) of tokens ``offs_s``, row columns ``start`` … ``start + C`` (those past
    ``n`` read as zero codes): read as they are (``BITS`` 0), or, for tokens before ``S_packed``, unpacked
    from their ``BITS``-bit codes (code c in bits [c·BITS, c·BITS + BITS) of the row's little-endian bytes;
    a 3-bit code may cross into the next byte) and dequantized, ``z + q·s`` in float32 rounded to
    ``DTYPE``, with the scale and zero-point of column c's quantization group (c // ``qw`` where the groups
    are ``SUBGROUPS`` of the latent groups, else one per token for the latent group ``g``); where the cache
    keeps a ``RECENT`` window, later tokens read as they are, from ``dense_ptr``'s token
    ``offs_s − S_packed``.

    Codes are read one by one (``WORD_BYTES`` 0: one or two byte loads per code), or a word at a time: the
    ``WORD_BYTES`` bytes (1, or 3 for 3-bit codes) that hold a whole number of codes are loaded once and
    every code is cut from its word in registers (:func:`_word_codes`), which needs ``start`` to be a
    multiple of the codes per word (the host checks the groups' ranks). A code becomes a float by
    :func:`_exact_float`."""
    cols = start + tl.arange(0, C)
    mask_c = tl.arange(0, C) < n
    if BITS == 0:
        out = tl.load(
            dense_ptr + b * sd_b + offs_s[:, None] * sd_s + cols[None, :] * sd_r,
            mask=mask_s[:, None] & mask_c[None, :], other=0.0,
        )  # fmt: skip
    else:
        packed = mask_s & (offs_s < S_packed)
        in_codes = packed[:, None] & mask_c[None, :]
        row = codes_ptr + b * sc_b + offs_s[:, None] * sc_s
        if WORD_BYTES:  # each word's bytes read once, its codes cut in registers
            PER_WORD: tl.constexpr = WORD_BYTES * 8 // BITS
            words = tl.arange(0, C // PER_WORD)
            in_words = packed[:, None] & (words * PER_WORD < n)[None, :]
            at = row + ((start // PER_WORD + words) * WORD_BYTES)[None, :]
            rows: tl.constexpr = at.shape[0]
            if WORD_BYTES == 1:
                word = tl.load(at, mask=in_words, other=0).to(tl.int32)
            else:  # loaded as one flat run of words: a thread holds neighbouring words of one token
                n_w: tl.constexpr = rows * (C // PER_WORD)
                at = tl.reshape(at, (n_w,))
                in_words = tl.reshape(in_words, (n_w,))
                word = tl.load(at, mask=in_words, other=0).to(tl.int32)
                for i in tl.static_range(1, WORD_BYTES):
                    word = word | (tl.load(at + i, mask=in_words, other=0).to(tl.int32) << (8 * i))
                word = tl.reshape(word, (rows, C // PER_WORD))
            code = _word_codes(word, BITS, PER_WORD)  # (rows, C // PER_WORD, 2[, 2[, 2]]) in registers
            code = _exact_float(tl.reshape(code, (rows, C)))  # past n: words read as 0, so codes are 0
        else:
            bit = cols * BITS
            byte = (bit // 8)[None, :]
            shift = (bit % 8)[None, :]
            word = tl.load(row + byte, mask=in_codes, other=0).to(tl.int32)
            if 8 % BITS != 0:  # a code past the byte's last bit continues in the next byte
                crosses = in_codes & (shift + BITS > 8)
                word = word | (tl.load(row + byte + 1, mask=crosses, other=0).to(tl.int32) << 8)
            code = ((word >> shift) & ((1 << BITS) - 1)).to(tl.float32)  # (BLOCK_S, C)
        if SUBGROUPS:  # a scale and zero-point per token and sub-group of columns
            at = b * ss_b + offs_s[:, None] * ss_s + (cols // qw)[None, :] * ss_g
            scale = tl.load(scale_ptr + at, mask=in_codes, other=0.0).to(tl.float32)
            zero = tl.load(zero_ptr + at, mask=in_codes, other=0.0).to(tl.float32)
        else:  # one per token for the whole latent group: read once per token, not per column
            at = b * ss_b + offs_s * ss_s + g * ss_g
            scale = tl.load(scale_ptr + at, mask=packed, other=0.0).to(tl.float32)[:, None]
            zero = tl.load(zero_ptr + at, mask=packed, other=0.0).to(tl.float32)[:, None]
        out = (code * scale + zero).to(DTYPE)
        if RECENT:
            in_recent = (mask_s & (offs_s >= S_packed))[:, None] & mask_c[None, :]
            recent = tl.load(
                dense_ptr + b * sd_b + (offs_s - S_packed)[:, None] * sd_s + cols[None, :] * sd_r,
                mask=in_recent, other=0.0,
            ).to(DTYPE)  # fmt: skip
            out = tl.where(packed[:, None], out, recent)
    return out


@triton.jit
def _group_columns(rank_ptr, offset_ptr, g, ALIGN: tl.constexpr):
    """Group g's rank and first column in the row, loaded, and told to the compiler as multiples of
    ``ALIGN`` where every group's are (the host's ``k_align``/``v_align``): a tile's rows then load as
    vectors. The hint is given here, on the loaded values: on a function's argument it would be lost."""
    rank = tl.load(rank_ptr + g)
    offset = tl.load(offset_ptr + g)
    if ALIGN > 1:
        rank = tl.multiple_of(rank, ALIGN)
        offset = tl.multiple_of(offset, ALIGN)
    return rank, offset


@triton.jit
def _word_codes(word, BITS: tl.constexpr, PER_WORD: tl.constexpr):
    """The ``PER_WORD`` (2, 4 or 8) codes of every word (rows, W), (rows, W, 2[, 2[, 2]]): read in row-major
    order, code j of word w at ``w·PER_WORD + j`` (column order). A join keeps each word's codes in the
    registers of the thread that holds the word (no shuffle through shared memory). Each join adds a last
    dim, so the innermost join picks the most significant bit of a code's place within its word: the leaves
    are listed in the bit-reversed order of j."""
    m: tl.constexpr = (1 << BITS) - 1
    if PER_WORD == 2:
        out = tl.join(word & m, (word >> BITS) & m)
    elif PER_WORD == 4:  # leaves j = 0, 2, 1, 3
        out = tl.join(
            tl.join(word & m, (word >> (2 * BITS)) & m), tl.join((word >> BITS) & m, (word >> (3 * BITS)) & m)
        )
    else:  # leaves j = 0, 4, 2, 6, 1, 5, 3, 7
        out = tl.join(
            tl.join(
                tl.join(word & m, (word >> (4 * BITS)) & m),
                tl.join((word >> (2 * BITS)) & m, (word >> (6 * BITS)) & m),
            ),
            tl.join(
                tl.join((word >> BITS) & m, (word >> (5 * BITS)) & m),
                tl.join((word >> (3 * BITS)) & m, (word >> (7 * BITS)) & m),
            ),
        )
    return out


@triton.jit
def _exact_float(code):
    """Codes (int32, 0 ≤ code < 2²³) as float32, exactly: the code in the mantissa of 2²³, minus 2²³ (an
    integer OR and a float add at full rate, where the GPU's integer-to-float conversion runs at a
    fraction of it)."""
    return (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


def word_bytes(bits: int, align: int) -> int:
    """The bytes :func:`_latent_tile` reads as one word of ``bits``-bit codes (3 for 3-bit codes, 1 for
    2- and 4-bit ones) where every latent group starts at a multiple of ``align`` columns that is a whole
    word's codes; 0 (codes read one by one) otherwise, and for unpacked or 8-bit latents."""
    if bits not in (2, 3, 4):
        return 0
    size = 3 if bits == 3 else 1
    return size if align % (size * 8 // bits) == 0 else 0


@triton.jit
def _norm_rotate(
    k1, k2, cos, sin, norm1, norm2, norm_eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr, LAST: tl.constexpr
):
    """Keys' halves (…, HALF_P), rotation pairs along axis ``LAST``: RMS-normed over each head's D dims and
    scaled where the model norms its keys (both halves; padded pairs are zero), then rotated:
    rope(k) = k·cos + rotate_half(k)·sin, with rotate_half(k1, k2) = (−k2, k1). ``cos``, ``sin`` and the
    norm's halves broadcast against the keys."""
    if HAS_NORM:
        ms = (tl.sum(k1 * k1, axis=LAST) + tl.sum(k2 * k2, axis=LAST)) / (2 * HALF)
        inv = tl.expand_dims(1.0 / tl.sqrt(ms + norm_eps), LAST)
        k1 = k1 * inv * norm1
        k2 = k2 * inv * norm2
    return k1 * cos - k2 * sin, k2 * cos + k1 * sin


@triton.jit
def _head_block(
    up_ptr, bias_ptr, q_ptr, b, g, first, offs_r, mask_r, offs_h, mask_h, kv_of, scaling,
    su_g, su_o, su_r, sb_g, sq_b, sq_h, sq_d,
    S_HEADS: tl.constexpr, NQ: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    HEADS_P: tl.constexpr, HAS_BIAS: tl.constexpr, LATENT_SCORES: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """KV heads ``first`` … ``first + HEADS_P − 1`` of group ``g`` side by side in columns (head j's rotation
    pair d in column j·HALF_P + d; heads past the group's and padded pairs are zero): the rows of ``B_k``
    that make the first and second halves of their keys, (RK_P, HEADS_P·HALF_P) each; their k bias halves
    (or zeros); and the query halves (NQ_P, HEADS_P·HALF_P), each query head's row holding its KV head's
    columns only (zero elsewhere), scaled by ``scaling``."""
    cols = tl.arange(0, HEADS_P * HALF_P)
    head = first + cols // HALF_P
    d = cols % HALF_P
    ok = (head < S_HEADS) & (d < HALF)
    rows1 = head * 2 * HALF + d  # up rows of each head's first half (HF's half-split RoPE)
    up_rows = up_ptr + g * su_g + offs_r[:, None] * su_r
    up_mask = mask_r[:, None] & ok[None, :]
    up1 = tl.load(up_rows + rows1[None, :] * su_o, mask=up_mask, other=0.0)
    up2 = tl.load(up_rows + (rows1 + HALF)[None, :] * su_o, mask=up_mask, other=0.0)
    if HAS_BIAS:
        bias1 = tl.load(bias_ptr + g * sb_g + rows1, mask=ok, other=0.0).to(tl.float32)
        bias2 = tl.load(bias_ptr + g * sb_g + rows1 + HALF, mask=ok, other=0.0).to(tl.float32)
    else:
        bias1 = tl.zeros((HEADS_P * HALF_P,), tl.float32)
        bias2 = bias1
    q_rows = q_ptr + b * sq_b + (g * NQ + offs_h)[:, None] * sq_h
    q_mask = mask_h[:, None] & ok[None, :] & (kv_of[:, None] == head[None, :])
    qa = tl.load(q_rows + d[None, :] * sq_d, mask=q_mask, other=0.0).to(tl.float32) * scaling
    qb = tl.load(q_rows + (d + HALF)[None, :] * sq_d, mask=q_mask, other=0.0).to(tl.float32) * scaling
    if LATENT_SCORES:  # queries in the latents' dtype, as the original's are
        qa, qb = qa.to(DTYPE), qb.to(DTYPE)
    return up1, up2, bias1, bias2, qa, qb


@triton.jit
def _online_softmax(scores, mask_s, m_i, l_i):
    """One tile of the online softmax: the scores (NQ_P, BLOCK_S) of tokens ``mask_s`` (others −inf) update
    the running maximum ``m_i`` and sum ``l_i``; returns the tile's probabilities, the factor that rescales
    what was accumulated before, and the new maximum and sum."""
    scores = tl.where(mask_s[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked row so far: nothing to shift
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])  # (NQ_P, BLOCK_S)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit(do_not_specialize=["k_qw", "v_qw"])  # one compiled kernel for every quantization group width
def _flash_decode_kernel(
    q_ptr, hk_ptr, hv_ptr, up_ptr, bias_ptr, norm_ptr, pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, mask_ptr,
    rk_ptr, rv_ptr, koff_ptr, voff_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    acc_ptr, m_ptr, l_ptr,
    S, S_packed, k_qw, v_qw, split_len, n_splits, table_len, n_rep, scaling, rope_scaling, norm_eps,
    sq_b, sq_h, sq_d,
    shk_b, shk_s, shk_r,
    shv_b, shv_s, shv_r,
    su_g, su_o, su_r,
    sb_g,
    sp_b, sp_s,
    sm_b, sm_s,
    skc_b, skc_s, sks_b, sks_s, sks_g,
    svc_b, svc_s, svs_b, svs_s, svs_g,
    G: tl.constexpr, S_HEADS: tl.constexpr, RK_P: tl.constexpr, NQ: tl.constexpr, NQ_P: tl.constexpr,
    HALF: tl.constexpr, HALF_P: tl.constexpr, RV_P: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_S: tl.constexpr, HAS_NORM: tl.constexpr,
    PRECISION: tl.constexpr, ACCURATE_TRIG: tl.constexpr, LATENT_SCORES: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_WORDS: tl.constexpr, V_WORDS: tl.constexpr,
    DTYPE: tl.constexpr, HEADS_P: tl.constexpr, HOIST: tl.constexpr,
    K_SUB: tl.constexpr, K_RECENT: tl.constexpr, V_SUB: tl.constexpr, V_RECENT: tl.constexpr,
    K_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // G).to(tl.int64)  # b · stride can pass 2³¹ elements on long, wide batches
    g = pid % G
    rk, koff = _group_columns(rk_ptr, koff_ptr, g, K_ALIGN)
    rv, voff = _group_columns(rv_ptr, voff_ptr, g, V_ALIGN)

    offs_h = tl.arange(0, NQ_P)  # the group's query heads, padded (tl.dot wants ≥ 16 rows)
    mask_h = offs_h < NQ
    kv_of = offs_h // n_rep  # the KV head of the group each query head reads, as repeat_kv pairs them
    offs_d = tl.arange(0, HALF_P)  # rotation pairs, padded to a power of two
    mask_d = offs_d < HALF
    offs_r = tl.arange(0, RK_P)  # the group's key latents, padded
    mask_r = offs_r < rk
    offs_rv = tl.arange(0, RV_P)
    inv_freq = tl.load(inv_freq_ptr + offs_d, mask=mask_d, other=0.0)
    norm1 = tl.load(norm_ptr + offs_d, mask=mask_d & HAS_NORM, other=0.0)  # the key norm's scale, if any
    norm2 = tl.load(norm_ptr + HALF + offs_d, mask=mask_d & HAS_NORM, other=0.0)
    if HOIST:  # every KV head in one block: its B_k and queries are read once, before the sequence loop
        up1, up2, bias1, bias2, qa, qb = _head_block(
            up_ptr, bias_ptr, q_ptr, b, g, 0, offs_r, mask_r, offs_h, mask_h, kv_of, scaling,
            su_g, su_o, su_r, sb_g, sq_b, sq_h, sq_d,
            S_HEADS, NQ, HALF, HALF_P, HEADS_P, HAS_BIAS, LATENT_SCORES, DTYPE,
        )  # fmt: skip

    m_i = tl.full((NQ_P,), float("-inf"), tl.float32)
    l_i = tl.zeros((NQ_P,), tl.float32)
    acc = tl.zeros((NQ_P, RV_P), tl.float32)
    start = split * split_len  # the last split may run past S: its tail is masked
    for t in range(0, split_len // BLOCK_S):
        offs_s = start + t * BLOCK_S + tl.arange(0, BLOCK_S)
        mask_s = offs_s < S
        pos = tl.load(pos_ptr + b * sp_b + offs_s * sp_s, mask=mask_s, other=0)
        if tl.max(pos, axis=0) < table_len:  # the RoPE tables, read (cos/sin computed once per position)
            at = pos[:, None] * HALF + offs_d[None, :]
            cos = tl.load(cos_ptr + at, mask=mask_d[None, :], other=0.0)
            sin = tl.load(sin_ptr + at, mask=mask_d[None, :], other=0.0)
        else:  # positions past the tables: float32 angle, then cos/sin, as HF's rotary embedding
            angle = pos.to(tl.float32)[:, None] * inv_freq[None, :]
            if ACCURATE_TRIG:  # libdevice's cos/sin (exact to an ulp at angles of thousands of radians)
                cos, sin = libdevice.cos(angle) * rope_scaling, libdevice.sin(angle) * rope_scaling
            else:  # the interpreter (numpy's cos/sin) has no libdevice
                cos, sin = tl.cos(angle) * rope_scaling, tl.sin(angle) * rope_scaling

        h = _latent_tile(
            hk_ptr, shk_b, shk_s, shk_r, kc_ptr, skc_b, skc_s, ks_ptr, kz_ptr, sks_b, sks_s, sks_g,
            b, offs_s, mask_s, koff, rk, g, k_qw, S_packed, RK_P, K_BITS, K_WORDS, K_SUB, K_RECENT, DTYPE,
        )  # (BLOCK_S, RK_P)  # fmt: skip
        scores = tl.zeros((NQ_P, BLOCK_S), tl.float32)
        for first in range(0, S_HEADS, HEADS_P):  # blocks of KV heads side by side in columns
            if not HOIST:
                up1, up2, bias1, bias2, qa, qb = _head_block(
                    up_ptr, bias_ptr, q_ptr, b, g, first, offs_r, mask_r, offs_h, mask_h, kv_of, scaling,
                    su_g, su_o, su_r, sb_g, sq_b, sq_h, sq_d,
                    S_HEADS, NQ, HALF, HALF_P, HEADS_P, HAS_BIAS, LATENT_SCORES, DTYPE,
                )  # fmt: skip
            k1 = tl.dot(h, up1, input_precision=PRECISION)  # (BLOCK_S, HEADS_P·HALF_P) float32
            k2 = tl.dot(h, up2, input_precision=PRECISION)
            if HAS_BIAS:
                k1 += bias1[None, :]
                k2 += bias2[None, :]
            if HEADS_P == 1:
                r1, r2 = _norm_rotate(k1, k2, cos, sin, norm1, norm2, norm_eps, HALF, HAS_NORM, 1)
            else:  # per KV head: (BLOCK_S, HEADS_P, HALF_P), the same rotation for every head
                r1, r2 = _norm_rotate(
                    tl.reshape(k1, (BLOCK_S, HEADS_P, HALF_P)), tl.reshape(k2, (BLOCK_S, HEADS_P, HALF_P)),
                    cos[:, None, :], sin[:, None, :], norm1, norm2, norm_eps, HALF, HAS_NORM, 2,
                )  # fmt: skip
                r1 = tl.reshape(r1, (BLOCK_S, HEADS_P * HALF_P))
                r2 = tl.reshape(r2, (BLOCK_S, HEADS_P * HALF_P))
            if LATENT_SCORES:  # rotated keys in the latents' dtype, as the original's keys are
                r1, r2 = r1.to(h.dtype), r2.to(h.dtype)
            scores = tl.dot(qa, tl.trans(r1), scores, input_precision=PRECISION)  # (NQ_P, BLOCK_S)
            scores = tl.dot(qb, tl.trans(r2), scores, input_precision=PRECISION)

        if HAS_MASK:
            add = tl.load(mask_ptr + b * sm_b + offs_s * sm_s, mask=mask_s, other=0.0)
            scores += add[None, :]
        p, alpha, m_i, l_i = _online_softmax(scores, mask_s, m_i, l_i)
        v = _latent_tile(
            hv_ptr, shv_b, shv_s, shv_r, vc_ptr, svc_b, svc_s, vs_ptr, vz_ptr, svs_b, svs_s, svs_g,
            b, offs_s, mask_s, voff, rv, g, v_qw, S_packed, RV_P, V_BITS, V_WORDS, V_SUB, V_RECENT, DTYPE,
        )  # (BLOCK_S, RV_P)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)

    row = (pid * NQ_P + offs_h) * n_splits + split  # partial sums laid out (B·G·NQ_P, n_splits[, RV_P])
    tl.store(m_ptr + row, m_i)
    tl.store(l_ptr + row, l_i)
    tl.store(acc_ptr + row[:, None] * RV_P + offs_rv[None, :], acc)


@triton.jit
def _combine_kernel(
    acc_ptr, m_ptr, l_ptr, rv_ptr, ooff_ptr, out_ptr,
    so_b, n_splits,
    G: tl.constexpr, NQ: tl.constexpr, NQ_P: tl.constexpr, NSPLIT_P: tl.constexpr, RV_P: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # one query head of one group and batch row
    b = (pid // (G * NQ)).to(tl.int64)
    g = (pid // NQ) % G
    head = pid % NQ
    row = (b * G + g) * NQ_P + head
    offs_sp = tl.arange(0, NSPLIT_P)
    mask_sp = offs_sp < n_splits
    m = tl.load(m_ptr + row * n_splits + offs_sp, mask=mask_sp, other=float("-inf"))
    l = tl.load(l_ptr + row * n_splits + offs_sp, mask=mask_sp, other=0.0)  # noqa: E741
    m_max = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    offs_rv = tl.arange(0, RV_P)
    rows = (row * n_splits + offs_sp)[:, None] * RV_P
    acc = tl.load(acc_ptr + rows + offs_rv[None, :], mask=mask_sp[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    rv = tl.load(rv_ptr + g)
    dst = out_ptr + b * so_b + tl.load(ooff_ptr + g) + head * rv + offs_rv
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=offs_rv < rv)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def splits_for(batch_groups: int, tiles: int, sms: int) -> int:
    """How many splits of the sequence: about :data:`PROGRAMS_PER_SM` programs for each of ``sms``
    multiprocessors, each walking at least :data:`MIN_SPLIT_TILES` tiles."""
    want = max(1, -(-PROGRAMS_PER_SM * sms // max(batch_groups, 1)))
    return max(1, min(want, tiles // MIN_SPLIT_TILES, MAX_SPLITS))


def heads_per_block(s: int, half_p: int, rk_p: int, itemsize: int) -> int:
    """KV heads one product rebuilds side by side: all ``s`` of the group (rounded up to a power of two)
    while their keys stay within :data:`BLOCK_COLUMNS` columns per token and their ``B_k`` rows (both
    halves, ``rk_p`` latents of ``itemsize`` bytes) within :data:`BLOCK_BYTES`, else the most that fit."""
    heads = _pow2(s, 1)
    while heads > 1 and (
        heads * half_p > BLOCK_COLUMNS or _up_bytes(rk_p, heads, half_p, itemsize) > BLOCK_BYTES
    ):
        heads //= 2
    return heads


_default_heads = heads_per_block  # the launch's argument of that name shadows it


def _up_bytes(rk_p: int, heads: int, half_p: int, itemsize: int) -> int:
    """Bytes of a block's ``B_k`` rows: both halves of ``heads`` KV heads over ``rk_p`` latents."""
    return 2 * rk_p * heads * half_p * itemsize


def hoists(s: int, heads_p: int, rk_p: int, half_p: int, itemsize: int) -> bool:
    """Whether a program reads its group's ``B_k`` once, before its sequence loop: when every KV head is in
    one block and both halves' rows fit :data:`BLOCK_BYTES`."""
    return heads_p >= s and _up_bytes(rk_p, heads_p, half_p, itemsize) <= BLOCK_BYTES


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the interpreter: a couple of splits, so the tests merge partial sums


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True)
class _Source:
    """One kind of latents (keys or values) as the kernel's arguments: the tensor read as it is (the
    latents, or a packed cache's residual window), and the packed codes, scales, zero-points, bits (0: none)
    and quantization group width (0: one per latent group)."""

    dense: torch.Tensor
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_width: int
    dtype: torch.dtype
    packed_tokens: int
    length: int

    @classmethod
    def of(cls, h: torch.Tensor | PackedLatents) -> _Source:
        if isinstance(h, torch.Tensor):
            return cls(h, h, h, h, 0, 0, h.dtype, 0, h.shape[1])
        scale, zero = h.scale, h.zero
        if scale.stride() != zero.stride():
            scale, zero = scale.contiguous(), zero.contiguous()
        dense = h.codes if h.recent is None else h.recent
        width = h.group_width or 0
        return cls(dense, h.codes, scale, zero, h.bits, width, h.dtype, h.packed_tokens, len(h))

    @property
    def has_recent(self) -> bool:
        """Packed codes followed by tokens kept as they are (a residual window)."""
        return bool(self.bits) and self.dense is not self.codes

    def strides(self) -> tuple[int, ...]:
        """The dense tensor's (b, s, r) strides (zeros where it stands in for a missing window)."""
        return (0, 0, 0) if self.bits and self.dense is self.codes else self.dense.stride()

    def packed_strides(self) -> tuple[int, ...]:
        """Codes (b, s), then scales and zero-points (b, s, group)."""
        return (*self.codes.stride()[:2], *self.scale.stride())


def sources(h_k: torch.Tensor | PackedLatents, h_v: torch.Tensor | PackedLatents) -> tuple[_Source, _Source]:
    """Keys' and values' latents as the kernels' arguments, checked to hold the same tokens."""
    src_k, src_v = _Source.of(h_k), _Source.of(h_v)
    if (src_k.packed_tokens, src_k.length) != (src_v.packed_tokens, src_v.length):
        raise ValueError(
            f"keys and values of different tokens: {src_k.packed_tokens} + "
            f"{src_k.length - src_k.packed_tokens} and {src_v.packed_tokens} + "
            f"{src_v.length - src_v.packed_tokens} (packed + as they are)"
        )
    return src_k, src_v


def words_of(src_k: _Source, src_v: _Source, weights: LatentDecodeWeights, unpack: bool) -> tuple[int, int]:
    """The bytes per word the kernels read the keys' and the values' packed codes by (:func:`word_bytes`
    for the groups' ranks; 0, codes one by one, without ``unpack``)."""
    if not unpack:
        return 0, 0
    return word_bytes(src_k.bits, weights.k_align), word_bytes(src_v.bits, weights.v_align)


@dataclass(frozen=True)
class Splits:
    """How a launch splits the sequence, and the partial sums its programs write: ``acc``
    (rows·NQ_P·n_splits, RV_P), running maxima ``m`` and sums ``l``, for ``rows`` (batch rows × groups)."""

    n_splits: int
    split_len: int
    acc: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor  # noqa: E741

    @classmethod
    def plan(
        cls,
        length: int,
        block_s: int,
        rows: int,
        nq_p: int,
        rv_p: int,
        device: torch.device,
        n_splits: int | None,
    ) -> Splits:
        """``n_splits`` (default :func:`splits_for`) of ``length`` tokens, in whole tiles of ``block_s``."""
        tiles = triton.cdiv(length, block_s)
        n_splits = n_splits or splits_for(rows, tiles, _multiprocessors(device))
        split_len = triton.cdiv(tiles, n_splits) * block_s
        n_splits = triton.cdiv(length, split_len)
        m = torch.empty(rows * nq_p * n_splits, device=device, dtype=torch.float32)
        acc = torch.empty(m.shape[0], rv_p, device=device, dtype=torch.float32)
        return cls(n_splits, split_len, acc, m, torch.empty_like(m))

    def combine(
        self, weights: LatentDecodeWeights, out: torch.Tensor, G: int, nq: int, nq_p: int, rv_p: int
    ) -> None:
        """Merge the splits' partial sums into ``out`` (B, width), the row ``o_proj`` reads."""
        _combine_kernel[(out.shape[0] * G * nq,)](
            self.acc, self.m, self.l, weights.ranks_v, weights.out_offsets, out, out.stride(0), self.n_splits,
            G=G, NQ=nq, NQ_P=nq_p, NSPLIT_P=_pow2(self.n_splits, 1), RV_P=rv_p,
        )  # fmt: skip


def latent_decode_attention_triton(
    q: torch.Tensor,
    h_k: torch.Tensor | PackedLatents,
    h_v: torch.Tensor | PackedLatents,
    weights: LatentDecodeWeights,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    scaling: float,
    mask: torch.Tensor | None = None,
    *,
    n_splits: int | None = None,
    block_s: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    latent_scores: bool | None = None,
    heads_per_block: int | None = None,
    hoist: bool | None = None,
    unpack_words: bool = True,
    stats: dict | None = None,
) -> torch.Tensor:
    """:func:`~lrkv_kernels.latent_rope.reference.latent_decode_attention_ref` in two launches (same
    arguments; (B, width) in the latents' dtype). ``h_k`` and ``h_v`` are the latents (B, S, R), or both
    a quantized cache's :class:`~lrkv_kernels.latent_rope.packed.PackedLatents`, unpacked and dequantized
    in registers (the spec is then
    :func:`~lrkv_kernels.latent_rope.packed.latent_decode_attention_packed_ref`).

    The launch's defaults can be overridden: ``n_splits`` (splits of the sequence), ``block_s`` (tokens per
    tile, a power of two ≥ 16), ``num_warps``, ``num_stages``; ``latent_scores`` (default: on for 16-bit
    latents; float32 latents always take float32) takes the scores' products in the latents' dtype, queries
    and rotated keys rounded to it as the original model's keys are; ``heads_per_block`` (a power of two;
    default :func:`heads_per_block`) is how many of a group's KV heads one product rebuilds side by side;
    ``hoist`` (default :func:`hoists`) reads their ``B_k`` once per program instead of once per tile, which
    needs the whole group in one block; ``unpack_words`` (on) reads packed codes a word at a time where the
    groups' ranks allow (:func:`word_bytes`), else one by one. ``stats``, a dict, receives the launch's
    settings and, on a GPU, the compiled kernel's registers per thread, spilled registers and shared
    memory."""
    src_k, src_v = sources(h_k, h_v)
    B, H, D = q.shape
    S = src_k.length
    dtype = src_k.dtype
    G = weights.up.shape[0]
    s = weights.up.shape[1] // D
    if D % 2 or weights.up.shape[1] != s * D or H % G or (H // G) % s:
        raise ValueError(f"shapes do not pair: q {tuple(q.shape)}, up {tuple(weights.up.shape)}")
    if 2 * inv_freq.numel() != D:
        raise ValueError(
            f"the kernel rotates all D = {D} dims, got {inv_freq.numel()} frequencies (partial RoPE)"
        )
    nq = H // G
    out = torch.empty(B, weights.width, device=q.device, dtype=src_v.dtype)
    if S == 0:
        return out.fill_(float("nan"))  # a softmax over nothing, as torch's
    rv_p = _pow2(weights.max_rank_v)
    block_s = block_s or (32 if src_k.bits or rv_p > 128 else 64)  # unpacking codes takes registers
    nq_p = _pow2(nq)
    splits = Splits.plan(S, block_s, B * G, nq_p, rv_p, q.device, n_splits)
    k_words, v_words = words_of(src_k, src_v, weights, unpack_words)
    if mask is not None:
        mask = mask.to(torch.float32)
    bias = weights.bias
    precision = "ieee" if dtype == torch.float32 else "tf32"
    latent_scores = dtype != torch.float32 and latent_scores is not False
    cos, sin = rope_tables_for(inv_freq, attention_scaling, S)
    half_p = _pow2(D // 2)
    rk_p = _pow2(weights.up.shape[2])
    itemsize = weights.up.element_size()
    heads_p = heads_per_block or _default_heads(s, half_p, rk_p, itemsize)
    if heads_p & (heads_p - 1):
        raise ValueError(f"heads_per_block must be a power of two, got {heads_p}")
    hoist = hoists(s, heads_p, rk_p, half_p, itemsize) if hoist is None else hoist
    if hoist and heads_p < s:
        raise ValueError(f"hoisting B_k needs the group's {s} KV heads in one block, got {heads_p}")
    compiled = _flash_decode_kernel[(B * G, splits.n_splits)](
        q, src_k.dense, src_v.dense, weights.up, weights.up if bias is None else bias,
        weights.up if weights.norm_weight is None else weights.norm_weight, positions,
        inv_freq.float().contiguous(), cos, sin, q if mask is None else mask,
        weights.ranks_k, weights.ranks_v, weights.k_offsets, weights.v_offsets,
        src_k.codes, src_k.scale, src_k.zero, src_v.codes, src_v.scale, src_v.zero,
        splits.acc, splits.m, splits.l,
        S, src_k.packed_tokens, src_k.group_width, src_v.group_width, splits.split_len, splits.n_splits,
        cos.shape[0],
        nq // s, float(scaling), float(attention_scaling), weights.norm_eps,
        *q.stride(), *src_k.strides(), *src_v.strides(), *weights.up.stride(),
        0 if bias is None else bias.stride(0),
        *positions.stride(), *((0, 0) if mask is None else mask.stride()),
        *src_k.packed_strides(), *src_v.packed_strides(),
        G=G, S_HEADS=s, RK_P=rk_p, NQ=nq, NQ_P=nq_p, HALF=D // 2, HALF_P=half_p, RV_P=rv_p,
        HAS_BIAS=bias is not None, HAS_MASK=mask is not None, BLOCK_S=block_s,
        HAS_NORM=weights.norm_weight is not None,
        PRECISION=precision, ACCURATE_TRIG=q.is_cuda, LATENT_SCORES=latent_scores,
        K_BITS=src_k.bits, V_BITS=src_v.bits, DTYPE=_TL_DTYPES[dtype], HEADS_P=heads_p, HOIST=hoist,
        K_WORDS=k_words, V_WORDS=v_words,
        K_SUB=src_k.group_width > 0, K_RECENT=src_k.has_recent, V_SUB=src_v.group_width > 0,
        V_RECENT=src_v.has_recent,
        K_ALIGN=weights.k_align, V_ALIGN=weights.v_align,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if stats is not None:
        stats.update(block_s=block_s, n_splits=splits.n_splits, heads_per_block=heads_p, hoist=hoist)
        stats.update(word_bytes=(k_words, v_words))
        for key in ("n_regs", "n_spills"):
            if hasattr(compiled, key):
                stats[key] = getattr(compiled, key)
        if hasattr(compiled, "metadata"):
            stats["shared_bytes"] = getattr(compiled.metadata, "shared", None)
    splits.combine(weights, out, G, nq, nq_p, rv_p)
    return out
