"""Latent attention over latents of *rotated* keys, for RoPE models: no key is rebuilt, no RoPE in the
cache's read.

Per layer, with groups g of s KV heads and ranks r_g:
- ``q_proj`` and ``k_proj`` are the original's; queries and keys are rotated (RoPE) as in the original;
- ``k_down`` (R_k × Hkv·D, block-diagonal over the groups): ``A_g`` maps a group's rotated keys (s·D) to
  its latents, ``H_k,g = A_g rope(k_g)`` (B, S, r_g): what the cache stores, with no positions;
- ``k_up[g]`` (s·D × r_g) holds ``B_g``: each query head h of the group (local KV head j) absorbs its rows,
  ``q'_h = B_g,jᵀ rope(q_h)`` (r_g dims), and scores ``q'_h · H_k,g = rope(q_h) · B_g,j A_g rope(k_g)``;
- values as in :class:`~lrkv_core.model.attention.LatentAttention` (``B_v`` folded into ``o_proj``).

With a RoPE-equivariant basis (:mod:`lrkv_core.decompositions.rope_equivariant`) ``B_g A_g`` commutes with
RoPE, so the approximation of the scores is the same at every position. At full rank ``B_g A_g = I`` and the
module reproduces the original attention up to float rounding. All of a group's query heads read its one
latent key head (multi-query attention within the group), as for models without RoPE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from lrkv_kernels.latent_rope import absorbed_decode_attention, additive_mask, apply_rope

from ..cache import LatentCache, LatentView
from .adapters import ArchAdapter
from .attention import FusedDecode, LatentAttention, LatentAttentionBase, LatentLayout, joined

SDPA_MAX_HEAD_DIM = 256  # the widest head torch's fast attention kernels (cuDNN, flash) take


def check_rotated_keys(
    adapter: ArchAdapter,
    config: PretrainedConfig,
    remedy: str = "convert it with key_latents: rebuilt (the default)",
) -> None:
    """Raise ``ValueError`` (its reason, then ``remedy``) unless the model's attention can read latents of
    rotated keys: one RoPE for every layer (over whole heads or their first dims), no QK-norm."""
    reason = None
    if not adapter.rope:
        reason = f"{adapter.model_type} has no RoPE: latents of rotated keys are for RoPE models"
    elif adapter.qk_norms(config) is not None:
        reason = (
            f"{adapter.model_type}: latents of rotated keys do not support QK-norm (its keys are normed per "
            "head before RoPE)"
        )
    elif adapter.rope_per_layer_type:
        reason = f"{adapter.model_type}: latents of rotated keys need one RoPE for every layer"
    if reason is not None:
        raise ValueError(f"{reason}; {remedy}")


def rotary_dims(adapter: ArchAdapter, config: PretrainedConfig) -> int:
    """The dims of each head RoPE turns: the head dim, or fewer with partial rotary embeddings."""
    return 2 * adapter.rotary_embedding(config).inv_freq.numel()


def rotated_key_inputs(
    adapter: ArchAdapter, config: PretrainedConfig, key_latents: str
) -> tuple[set[str], int | None]:
    """What a layer's decomposition reads beyond its method's weights: for latents of rotated keys q_proj's
    weight and the dims RoPE turns, for rebuilt keys nothing (``(set(), None)``)."""
    if key_latents != "rotated":
        return set(), None
    return {"q"}, rotary_dims(adapter, config)


class RotatedKeyAttention(FusedDecode, LatentAttentionBase):
    """Drop-in replacement for a RoPE attention module, caching latents of its rotated keys.

    A decode step (one query token) under SDPA calls torch's attention once per group with the group's
    query heads as the query rows of its one latent head (:meth:`decodes_packed`: no copy of the latents per
    query head, compiled or not). On CUDA the absorbed flash-decoding kernel
    (:func:`~lrkv_kernels.latent_rope.absorbed_decode_attention`: the whole layer in one launch) takes the
    steps SDPA cannot read as fast (:meth:`takes_kernel`): a quantized cache's packed codes (read in the
    kernel), latents in float32 or wider than SDPA's fast kernels take, a model under eager attention
    (``fused_decode`` forces either way: :class:`FusedDecode`). Everything else calls the model's attention
    interface.
    """

    k_norm = None  # no QK-norm (refused): the kernel layout's keys are not normed
    decode_weights = LatentAttention.decode_weights  # the kernel's layout of k_up (its ranks and offsets)

    def __init__(self, config: PretrainedConfig, layer_idx: int, adapter: ArchAdapter, layout: LatentLayout):
        super().__init__(config, layer_idx, adapter, layout)
        shape, s = self.shape, layout.group_size
        check_rotated_keys(adapter, config)
        self.num_key_value_groups = self.q_heads_per_group  # one latent key/value head per group
        self.q_proj = nn.Linear(shape.d, shape.H * shape.D, bias=layout.qkv_bias)
        self.k_proj = nn.Linear(shape.d, shape.Hkv * shape.D, bias=layout.qkv_bias)
        self.k_down = nn.Linear(shape.Hkv * shape.D, sum(layout.ranks_k), bias=False)  # block-diagonal
        self.k_up = nn.ModuleList(nn.Linear(r, s * shape.D, bias=False) for r in layout.ranks_k)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: LatentCache | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: LatentCache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        B, T, _ = hidden_states.shape
        H, Hkv, D = self.shape.H, self.shape.Hkv, self.shape.D
        cos, sin = position_embeddings  # (B, T, D)
        q = apply_rope(self.q_proj(hidden_states).view(B, T, H, D).transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(self.k_proj(hidden_states).view(B, T, Hkv, D).transpose(1, 2), cos, sin)
        h_k = self.k_down(k.transpose(1, 2).reshape(B, T, Hkv * D))  # (B, T, R_k): latents of rotated keys
        h_v = self.v_down(hidden_states)  # (B, T, R_v)
        view = self.cached_latents(h_k, h_v, None, past_key_values, cache)  # per group (B, S, r_g)
        return self.o_proj(self.attend_latents(q, view, attention_mask, **kwargs)), None  # (B, T, d)

    def projections(self) -> dict[str, list[nn.Linear]]:
        """The projections LoRA recovery may adapt, by role: the keys' role ``k_down`` is ``k_proj``, the keys
        before RoPE, where any change keeps the latents' map commuting with RoPE. An adapter on ``k_down``
        (after RoPE) or ``k_up`` (absorbed by the queries after RoPE) would make the scores depend on the
        tokens' absolute positions: it would hold only at the positions it was trained on."""
        return super().projections() | {"k_down": [self.k_proj]}

    def attend_latents(
        self, q: torch.Tensor, view: LatentView, attention_mask: torch.Tensor | None, **kwargs
    ) -> torch.Tensor:
        """The attention of queries q (B, H, T, D) (RoPE'd) over the cached latents ``view``, before
        ``o_proj``: (B, T, Σ_g nq·r_v). Each query head absorbs its ``B_g`` rows; then the absorbed kernel
        where :meth:`takes_kernel`, else torch's attention per group."""
        s, D, nq = self.layout.group_size, self.shape.D, self.q_heads_per_group
        q_lats = []  # per group (B, s·n_rep, T, r_g)
        for g, up in enumerate(self.k_up):
            q_g = q[:, g * nq : (g + 1) * nq].unflatten(1, (s, nq // s))  # (B, s, n_rep, T, D)
            b_g = up.weight.view(s, D, -1)  # (s, D, r_g): B_g's rows of each local KV head
            q_lats.append(torch.einsum("bsntd,sdr->bsntr", q_g, b_g).flatten(1, 2))
        if self.takes_kernel(q, view, attention_mask):
            return self.fused_decode_attention(q_lats, view, attention_mask)
        packed = self.decodes_packed(q, attention_mask)
        outs = []
        for q_lat, hk_g, hv_g in zip(q_lats, view.keys, view.values, strict=True):
            k_g, v_g = hk_g.unsqueeze(1), hv_g.unsqueeze(1)  # (B, 1, S, r_g)
            if packed:  # the group's query heads as the query rows of its one latent head: (B, 1, nq, r_v)
                out = F.scaled_dot_product_attention(
                    q_lat.transpose(1, 2), k_g, v_g, attn_mask=attention_mask, scale=self.scaling
                )
                outs.append(out.flatten(2))
            else:
                outs.append(self.attend(q_lat, k_g, v_g, attention_mask, **kwargs))  # (B, T, s·n_rep·r_v)
        return torch.cat(outs, dim=-1)

    def decodes_packed(self, q: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
        """Whether this forward (queries q (B, H, T, D)) is a decode step torch's SDPA takes with each group's
        query heads as query rows: a :meth:`masked_decode_step` of the model under SDPA, its mask shared by
        the heads. transformers' SDPA interface, in a compiled step with a mask (or keys and values of
        different widths), copies the latents once per query head; this reads them once (the same
        attention)."""
        shared = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1))
        return self.masked_decode_step(q) and self.config._attn_implementation == "sdpa" and shared

    def takes_kernel(self, q: torch.Tensor, view: LatentView, attention_mask: torch.Tensor | None) -> bool:
        """Whether this forward runs the absorbed kernel: where :meth:`decodes_fused`, unless the choice is
        lrkv's (``fused_decode`` None) and torch's SDPA reads these latents faster
        (:meth:`sdpa_is_faster`)."""
        if not self.decodes_fused(q):
            return False
        return self.fused_decode is True or not self.sdpa_is_faster(q, view, attention_mask)

    def sdpa_is_faster(self, q: torch.Tensor, view: LatentView, attention_mask: torch.Tensor | None) -> bool:
        """Whether a decode step reads the cache faster through torch's SDPA (:meth:`decodes_packed`) than
        through the absorbed kernel: dense latents (a quantized cache's codes are read by the kernel only) in
        half precision, every group's key and value rank a multiple of 8 up to :data:`SDPA_MAX_HEAD_DIM`, the
        head dims cuDNN's and flash attention take. On an H200 (docs/fused-decode.md) SDPA took 0.57–0.79 of
        the kernel's time over such latents, at 16K and 64K tokens, ranks 48 to 256; past 256 it falls back
        to its math path, 35× the kernel's time at rank 384."""
        ranks = (*self.layout.ranks_k, *self.layout.ranks_v)
        return (
            view.packed is None
            and q.dtype in (torch.float16, torch.bfloat16)
            and all(r % 8 == 0 and r <= SDPA_MAX_HEAD_DIM for r in ranks)
            and self.decodes_packed(q, attention_mask)
        )

    def fused_decode_attention(
        self, q_lats: list[torch.Tensor], view: LatentView, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """One decode step's attention output (B, 1, Σ_g nq·r_v) in one launch of the absorbed kernel, from
        the absorbed queries (per group (B, nq, 1, r_g)); a quantized cache's packed codes are read in the
        kernel."""
        if view.packed is not None:
            h_k, h_v = view.packed  # PackedLatents of S tokens each
            length = len(h_k)
        else:
            h_k, h_v = joined(view.keys), joined(view.values)  # (B, S, R_k), (B, S, R_v)
            length = h_k.shape[1]
        B, H = q_lats[0].shape[0], self.shape.H
        q = q_lats[0].new_zeros(B, H, max(self.layout.ranks_k))  # each head's absorbed query, zero-padded
        nq = self.q_heads_per_group
        for g, q_lat in enumerate(q_lats):
            q[:, g * nq : (g + 1) * nq, : q_lat.shape[-1]] = q_lat[:, :, 0]
        weights = self.decode_weights(view.values[0].dtype if view.packed is None else h_v.dtype)
        out = absorbed_decode_attention(
            q, h_k, h_v, weights, self.scaling, additive_mask(attention_mask, length)
        )  # (B, Σ_g nq·r_v)
        return out.unsqueeze(1)
