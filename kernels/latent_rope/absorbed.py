"""Decode attention over latents of *rotated* keys: the latents project each group's keys after RoPE, so the
query absorbs the projection and no key is ever rebuilt.

With latents of the keys before RoPE (lrkv's decompositions, Palu's), attention must rebuild every cached
key (``h_k B_kᵀ``, then rotate it at its position) at every decode step: ``s·D·r`` multiply-adds per token
and group. Where a group's basis ``U`` (s·D, r, orthonormal columns) projects the keys *after* RoPE, the
cache holds ``h_k = Uᵀ rope(k)`` and a query head reading KV head j of the group scores

    rope(q)·rope(k)_j ≈ rope(q)·(U h_k)_j = (U_jᵀ rope(q))·h_k,

so the step turns each query head into ``q̃ = U_jᵀ rope(q)`` (r numbers) once, and the attention over the
cache is a plain multi-query attention with head dim r: ``r`` multiply-adds per cached token and query head,
as cheap as reading the latents. At full rank ``U`` is orthogonal and the scores are the original's. Any
pair of maps works the same way (the cache holds ``A rope(k)``, each query absorbs ``B_j``: an oblique basis
weighted by the queries, or one that commutes with RoPE); the spec takes the absorbed queries as given.

:func:`absorbed_decode_attention_ref` is the spec (per group: scores, mask, float32 softmax, the value
latents); :mod:`lrkv_kernels.latent_rope.flash_absorbed` computes it in one Triton launch per layer.
"""

from __future__ import annotations

import torch

from .decode import LatentDecodeWeights
from .packed import PackedLatents, dequantize_ref, weights_ranks


def absorbed_decode_attention_ref(
    q: torch.Tensor,
    h_k: torch.Tensor | PackedLatents,
    h_v: torch.Tensor | PackedLatents,
    weights: LatentDecodeWeights,
    scaling: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step's attention over rotated-key latents, before ``o_proj``.

    Parameters
    ----------
    q : (B, H, R) the absorbed queries ``U_jᵀ rope(q)``: query head h of group g in its first r_k(g)
        entries (R ≥ every group's key rank; the rest is not read). Group g owns heads g·H/G … (g+1)·H/G − 1.
    h_k, h_v : (B, S, R_k), (B, S, R_v) the cached latents, groups side by side, or a quantized cache's
        :class:`PackedLatents` (dequantized first).
    weights : the layer's :class:`LatentDecodeWeights`; only its layout is read (ranks, offsets, width).
    scaling : the softmax scale (the original's, ``D^-½``).
    mask : (B, S) float added to the scores (−inf: not attended), or None.

    Returns
    -------
    (B, width) in the value latents' dtype: per group, per query head, the attention-weighted value latents.
    """
    ranks_k, ranks_v = weights_ranks(weights)
    if isinstance(h_k, PackedLatents):
        h_k, h_v = dequantize_ref(h_k, ranks_k), dequantize_ref(h_v, ranks_v)
    B, H, _ = q.shape
    G = len(ranks_k)
    nq = H // G
    outs = []
    for g, (cols_k, cols_v, _, _) in enumerate(weights.groups()):
        q_g = q[:, g * nq : (g + 1) * nq, : ranks_k[g]].float()  # (B, nq, r_k)
        scores = q_g @ h_k[..., cols_k].float().transpose(1, 2) * scaling  # (B, nq, S)
        if mask is not None:
            scores = scores + mask[:, None, :].float()
        probs = torch.softmax(scores, dim=-1)
        outs.append((probs @ h_v[..., cols_v].float()).reshape(B, -1))  # (B, nq·r_v)
    return torch.cat(outs, dim=-1).to(h_v.dtype)
