"""Latent attention for models without RoPE (OPT): keys are never rebuilt, ``B_k`` lives in ``W_q``.

Without a rotation between the key projection and the dot product, ``q_h · k_h`` for query head h of
group g (local KV head j) is ``q_h · (B_k,g,j H_k,g + b_k,j) = (B_k,g,jᵀ q_h) · H_k,g + q_h · b_k,j``.
The second term is the same for every key of a query row and cancels in softmax, so the fused query
projection maps x straight to ``q'_h = B_k,g,jᵀ (W_q,h x + b_q,h)`` (r_g dims) and scores are taken
against the cached key latents ``H_k,g`` (B, S, r_g) directly. All ``s·n_rep`` query heads of a group
share the group's one latent "key head" and one latent "value head" (multi-query attention within the
group); values are handled as for RoPE models (``B_v`` folded into ``o_proj``, v bias into its bias).
The cache holds latents only: no positions (OPT's learned positions are added before the layers).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from ..cache import LatentCache
from .adapters import ArchAdapter
from .attention import LatentAttentionBase, LatentLayout


class NoRopeLatentAttention(LatentAttentionBase):
    """Drop-in replacement for a non-RoPE attention module (OPT), caching latents without positions."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, adapter: ArchAdapter, layout: LatentLayout):
        super().__init__(config, layer_idx, adapter, layout)
        # one latent key/value head per group, shared by the group's query heads
        self.num_key_value_groups = self.q_heads_per_group
        q_width = sum(r * self.q_heads_per_group for r in layout.ranks_k)
        self.q_proj = nn.Linear(self.shape.d, q_width, bias=layout.qkv_bias)  # rows B_k,g,jᵀ W_q,h

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: LatentCache | None = None,
        position_ids: torch.LongTensor | None = None,  # absolute positions are already in hidden_states
        cache: LatentCache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        B, T, _ = hidden_states.shape
        nq = self.q_heads_per_group
        q = self.q_proj(hidden_states)  # (B, T, Σ_g s·n_rep·r_g)
        h_k = self.k_down(hidden_states)  # (B, T, R_k)
        h_v = self.v_down(hidden_states)  # (B, T, R_v)
        view = self.cached_latents(h_k, h_v, None, past_key_values, cache)  # per group (B, S, r_g)
        q_groups = torch.split(q, [nq * r for r in self.layout.ranks_k], dim=-1)  # (B, T, s·n_rep·r_g)
        outs = []
        for q_g, hk_g, hv_g in zip(q_groups, view.keys, view.values, strict=True):
            q_g = q_g.view(B, T, nq, hk_g.shape[-1]).transpose(1, 2)  # (B, s·n_rep, T, r_g)
            k_g, v_g = hk_g.unsqueeze(1), hv_g.unsqueeze(1)  # (B, 1, S, r_g)
            outs.append(self.attend(q_g, k_g, v_g, attention_mask, **kwargs))  # (B, T, s·n_rep·r_g)
        return self.o_proj(torch.cat(outs, dim=-1)), None  # (B, T, d)
