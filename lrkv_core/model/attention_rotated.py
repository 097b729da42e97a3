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
from torch import nn
from transformers import PretrainedConfig

from lrkv_kernels.latent_rope import apply_rope

from ..cache import LatentCache
from .adapters import ArchAdapter
from .attention import LatentAttentionBase, LatentLayout


def check_rotated_keys(adapter: ArchAdapter, config: PretrainedConfig) -> None:
    """Raise ``ValueError`` unless the model's attention can read latents of rotated keys: RoPE over whole
    heads, one RoPE for every layer, no QK-norm."""
    if not adapter.rope:
        raise ValueError(f"{adapter.model_type} has no RoPE: latents of rotated keys are for RoPE models")
    if adapter.qk_norms(config) is not None:
        raise ValueError(f"{adapter.model_type}: latents of rotated keys do not support QK-norm yet")
    rotary = adapter.rotary_embedding(config)
    if adapter.rope_per_layer_type or 2 * rotary.inv_freq.numel() != adapter.shape(config).D:
        raise ValueError(
            f"{adapter.model_type}: latents of rotated keys need RoPE over the whole head, one per model"
        )


class RotatedKeyAttention(LatentAttentionBase):
    """Drop-in replacement for a RoPE attention module, caching latents of its rotated keys."""

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
        H, Hkv, D, s = self.shape.H, self.shape.Hkv, self.shape.D, self.layout.group_size
        cos, sin = position_embeddings  # (B, T, D)
        q = apply_rope(self.q_proj(hidden_states).view(B, T, H, D).transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(self.k_proj(hidden_states).view(B, T, Hkv, D).transpose(1, 2), cos, sin)
        h_k = self.k_down(k.transpose(1, 2).reshape(B, T, Hkv * D))  # (B, T, R_k): latents of rotated keys
        h_v = self.v_down(hidden_states)  # (B, T, R_v)
        view = self.cached_latents(h_k, h_v, None, past_key_values, cache)  # per group (B, S, r_g)
        nq, outs = self.q_heads_per_group, []
        for g, (hk_g, hv_g, up) in enumerate(zip(view.keys, view.values, self.k_up, strict=True)):
            q_g = q[:, g * nq : (g + 1) * nq].unflatten(1, (s, nq // s))  # (B, s, n_rep, T, D)
            b_g = up.weight.view(s, D, -1)  # (s, D, r_g): B_g's rows of each local KV head
            q_lat = torch.einsum("bsntd,sdr->bsntr", q_g, b_g).flatten(1, 2)  # (B, s·n_rep, T, r_g)
            k_g, v_g = hk_g.unsqueeze(1), hv_g.unsqueeze(1)  # (B, 1, S, r_g)
            outs.append(self.attend(q_lat, k_g, v_g, attention_mask, **kwargs))  # (B, T, s·n_rep·r_v)
        return self.o_proj(torch.cat(outs, dim=-1)), None  # (B, T, d)
