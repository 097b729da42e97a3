"""Attention whose cache holds low-rank latents (Palu's deployment form) for RoPE models.

Per layer, with groups g of s KV heads and ranks r_g:
- ``k_down`` (R_k × d) and ``v_down`` (R_v × d): all groups' ``A`` stacked, so the cache stores
  ``H_k = x A_kᵀ`` (B, S, R_k) and ``H_v = x A_vᵀ`` (B, S, R_v) with R = Σ_g r_g;
- ``k_up[g]`` (s·D × r_g, + k bias rows): keys are rebuilt per group, then (QK-norm models, Qwen3) the
  original's per-head ``k_norm``, then RoPE at the cached positions, then q·K; queries go through ``q_norm``
  before RoPE, as in the original;
- ``o_proj`` (d × Σ_h r_{g(h)}): ``B_v`` folded into the output projection, one block per query head,
  ``W_o,h B_v,g,h`` (d × r_g), so attention probabilities multiply latents directly and values are never
  rebuilt. A v bias folds into the o_proj bias (softmax rows sum to 1).
At full rank the module reproduces the original attention up to float rounding. Attention reads the latents
per group through the cache's :class:`~lrkv_core.cache.LatentView` (the cache's storage strategy decides how
they are kept); it never slices the concatenated latents itself.

:class:`LatentAttentionBase` holds what every latent attention shares (down projections, the folded
output projection, the cache and the attention interface); models without RoPE use
:class:`lrkv_core.model.attention_norope.NoRopeLatentAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from lrkv_kernels.latent_rope import (
    LatentDecodeWeights,
    additive_mask,
    apply_rope,
    latent_decode_attention,
    reconstruct_rope_keys,
    triton_runs_on,
)

from ..cache import LatentCache, LatentUpdates, LatentView, either_cache
from .adapters import ArchAdapter, AttnShape


@dataclass(frozen=True)
class LatentLayout:
    """Ranks of one layer: ``ranks_k[g]``, ``ranks_v[g]`` for groups of ``group_size`` KV heads."""

    group_size: int
    ranks_k: tuple[int, ...]
    ranks_v: tuple[int, ...]
    qkv_bias: bool = False  # q_proj (and k_up, with RoPE) carry the original q/k biases
    o_bias: bool = False  # o_proj bias (original o bias + the folded v bias)


class LatentAttentionBase(nn.Module):
    """Shared parts of latent attentions: ``k_down``, ``v_down``, ``o_proj`` (``B_v`` folded), the cache."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, adapter: ArchAdapter, layout: LatentLayout):
        super().__init__()
        shape: AttnShape = adapter.shape(config)
        n_groups = shape.Hkv // layout.group_size
        if len(layout.ranks_k) != n_groups or len(layout.ranks_v) != n_groups:
            raise ValueError(
                f"layer {layer_idx}: layout has the wrong number of groups (expected {n_groups})"
            )
        self.config = config
        self.layer_idx = layer_idx
        self.layout = layout
        self.shape = shape
        self.head_dim = shape.D
        self.num_key_value_groups = shape.n_rep  # read by transformers' attention interfaces
        self.scaling = adapter.scaling(config)  # D^-½, or Gemma 3's query_pre_attn_scalar^-½
        self.attention_dropout = getattr(config, "attention_dropout", 0.0)
        self.is_causal = True
        self._interface_kwargs = adapter.attention_kwargs(config, layer_idx)
        self.q_heads_per_group = layout.group_size * shape.n_rep
        o_width = sum(r * self.q_heads_per_group for r in layout.ranks_v)

        self.k_down = nn.Linear(shape.d, sum(layout.ranks_k), bias=False)
        self.v_down = nn.Linear(shape.d, sum(layout.ranks_v), bias=False)
        self.o_proj = nn.Linear(o_width, shape.d, bias=layout.o_bias)

    def projections(self) -> dict[str, list[nn.Linear]]:
        """The module's linear projections by role (``k_down``, ``v_down``, ``q_proj``, ``o_proj``, and
        ``k_up`` with one projection per group where keys are rebuilt): what LoRA recovery may adapt."""
        return {
            "k_down": [self.k_down],
            "v_down": [self.v_down],
            "q_proj": [self.q_proj],
            "o_proj": [self.o_proj],
        }

    def cached_latents(
        self,
        h_k: torch.Tensor,
        h_v: torch.Tensor,
        position_ids: torch.Tensor | None,
        past_key_values: LatentCache | None,
        cache: LatentCache | None = None,
    ) -> LatentView:
        """Store this step's latents h_k (B, T, R_k), h_v (B, T, R_v) in the cache; the per-group view of
        every latent attention reads, (B, S, r_g) per group, and positions (B, S). The decoder layer passes
        the cache as ``past_key_values`` (transformers < 5.24) or as ``cache`` (from 5.24)."""
        layout = self.layout
        past_key_values = either_cache(cache, past_key_values)
        if past_key_values is None:
            B, T = h_k.shape[:2]
            pos = None if position_ids is None else position_ids.expand(B, T)
            return LatentView.from_latents(h_k, h_v, pos, layout.ranks_k, layout.ranks_v)
        if not isinstance(past_key_values, LatentUpdates):
            raise TypeError(
                "an lrkv-compressed model caches latents in a LatentCache or a StaticLatentCache, "
                f"got {type(past_key_values).__name__}; "
                "pass no cache (one is created) or lrkv_core.LatentCache"
            )
        ranks = (layout.ranks_k, layout.ranks_v)
        return past_key_values.update_latents(h_k, h_v, position_ids, self.layer_idx, ranks)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs,
    ) -> torch.Tensor:
        """The model's attention interface on one group; (B, T, heads·r_v) with heads = q.shape[1].

        Under SDPA on the CPU, for more than one query token (a prefill, a chunk), values narrower than the
        keys (or wider) are padded with zero columns to one width (the keys and queries too where the values
        are wider): torch's fused CPU kernel takes one head width for all three and otherwise falls back to
        one that holds the whole T × S score matrix, 3–5× slower at 4K tokens. Zero columns add nothing to a
        score and give zero outputs, which are dropped. A decode step (one query, a 1 × S matrix) is left
        as it is; on CUDA the memory-efficient kernel takes a value width of its own."""
        implementation = self.config._attn_implementation
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        width = v.shape[-1]
        pad = implementation == "sdpa" and q.device.type == "cpu" and q.shape[2] > 1
        if pad and width != q.shape[-1]:
            full = max(width, q.shape[-1])
            q, k, v = (t if t.shape[-1] == full else F.pad(t, (0, full - t.shape[-1])) for t in (q, k, v))
        out, _ = interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **self._interface_kwargs,
            **kwargs,
        )  # (B, T, heads, r_v), or wider when padded
        return out[..., :width].reshape(*out.shape[:2], -1)


class FusedDecode:
    """A latent attention with a decode kernel of its own. ``fused_decode`` chooses: None (default) on CUDA
    tensors where Triton is installed, True always (on the CPU under ``TRITON_INTERPRET=1``, the tests),
    False never."""

    fused_decode: bool | None = None

    def decodes_fused(self, q: torch.Tensor) -> bool:
        """Whether this forward (queries q (B, H, T, D)) takes the fused decode path: a
        :meth:`masked_decode_step`, allowed by ``fused_decode``, under eager or SDPA attention."""
        if not self.masked_decode_step(q) or self.fused_decode is False:
            return False
        if self.fused_decode is None and not (q.is_cuda and triton_runs_on(q.device)):
            return False
        return self.config._attn_implementation in ("eager", "sdpa")  # flash kernels take no 4D mask

    def takes_kernel(self, q: torch.Tensor, view: LatentView, attention_mask: torch.Tensor | None) -> bool:
        """Whether this forward's attention (queries q (B, H, T, D) over ``view``) runs the decode kernel:
        where :meth:`decodes_fused`."""
        return self.decodes_fused(q)

    def masked_decode_step(self, q: torch.Tensor) -> bool:
        """Whether this forward (queries q (B, H, T, D)) is a decode step (one query token, not training)
        whose attention mask says all the interface would be told (any window is in it)."""
        return q.shape[2] == 1 and not self.training and set(self._interface_kwargs) <= {"sliding_window"}


class LatentAttention(FusedDecode, LatentAttentionBase):
    """Drop-in replacement for a RoPE attention module (Llama, Mistral, Qwen2, Qwen3), caching latents.

    A decode step (one query token) on CUDA goes through the flash-decoding kernel
    (:func:`~lrkv_kernels.latent_rope.latent_decode_attention`): the whole layer in one launch, keys rebuilt
    in registers (Palu's fused reconstruction), online softmax, and the attention-weighted value latents; a
    quantized cache's packed codes are unpacked and dequantized in the kernel (``fused_decode`` chooses:
    :class:`FusedDecode`). Everything else (prefill, training, a LoRA-wrapped ``k_up``, flash attention, a
    RoPE whose frequencies change with the length) rebuilds the keys and calls the model's attention
    interface.
    """

    def __init__(self, config: PretrainedConfig, layer_idx: int, adapter: ArchAdapter, layout: LatentLayout):
        super().__init__(config, layer_idx, adapter, layout)
        shape, s = self.shape, layout.group_size
        self.q_proj = nn.Linear(shape.d, shape.H * shape.D, bias=layout.qkv_bias)
        self.k_up = nn.ModuleList(nn.Linear(r, s * shape.D, bias=layout.qkv_bias) for r in layout.ranks_k)
        self.rotary_emb = adapter.rotary_embedding(config)
        # Gemma 3: the rotary embedding holds each layer type's frequencies and is told which to use
        self._rope_layer_type = config.layer_types[layer_idx] if adapter.rope_per_layer_type else None
        norms = adapter.qk_norms(config)  # QK-norm: the original's per-head norms, before RoPE
        self.q_norm, self.k_norm = norms if norms is not None else (None, None)
        self._norm_offset = adapter.qk_norm_offset

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
        H, D = self.shape.H, self.shape.D
        q = self.q_proj(hidden_states).view(B, T, H, D)  # (B, T, H, D)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = q.transpose(1, 2)  # (B, H, T, D)
        cos, sin = position_embeddings  # (B, T, D)
        q = apply_rope(q, cos, sin)
        if position_ids is None:
            raise ValueError("LatentAttention needs position_ids (the decoder layer passes them)")
        h_k = self.k_down(hidden_states)  # (B, T, R_k)
        h_v = self.v_down(hidden_states)  # (B, T, R_v)
        view = self.cached_latents(h_k, h_v, position_ids, past_key_values, cache)
        return self.o_proj(self.attend_latents(q, view, attention_mask, **kwargs)), None  # (B, T, d)

    def attend_latents(
        self, q: torch.Tensor, view: LatentView, attention_mask: torch.Tensor | None, **kwargs
    ) -> torch.Tensor:
        """The attention of queries q (B, H, T, D) (RoPE'd) over the cached latents ``view``, before
        ``o_proj``: (B, T, Σ_g nq·r_v). The fused decode kernel where :meth:`decodes_fused`, else keys rebuilt
        per group and the model's attention interface."""
        if self.takes_kernel(q, view, attention_mask):
            return self.fused_decode_attention(q, view, attention_mask)
        B = q.shape[0]
        s = self.layout.group_size
        cos_k, sin_k = self.rope_at(view.keys[0], view.positions.long())  # (B, S, D); keys[0]: dtype only
        outs, nq = [], self.q_heads_per_group
        for g, (hk_g, hv_g, up) in enumerate(zip(view.keys, view.values, self.k_up, strict=True)):
            k_g = self.rebuild_keys(up, hk_g, cos_k, sin_k)  # (B, s, S, D)
            v_g = hv_g.unsqueeze(1).expand(B, s, *hv_g.shape[1:])  # (B, s, S, r_g)
            q_g = q[:, g * nq : (g + 1) * nq]  # (B, s·n_rep, T, D)
            outs.append(self.attend(q_g, k_g, v_g, attention_mask, **kwargs))  # (B, T, s·n_rep·r_g)
        return torch.cat(outs, dim=-1)

    def projections(self) -> dict[str, list[nn.Linear]]:
        return super().projections() | {"k_up": list(self.k_up)}

    def decodes_fused(self, q: torch.Tensor) -> bool:
        """Whether this forward (queries q (B, H, T, D)) takes the fused decode path: the shared conditions,
        and a RoPE and key up-projections the kernel reproduces."""
        if not super().decodes_fused(q):
            return False
        inv_freq, _, rope_type = self.rope_frequencies()
        return (
            2 * inv_freq.numel() == self.head_dim  # the kernel rotates all D (not partial RoPE: Phi-4-mini)
            and "dynamic" not in rope_type
            and rope_type != "longrope"  # both change inv_freq with the length
            and all(type(up) is nn.Linear for up in self.k_up)
        )

    def fused_decode_attention(
        self, q: torch.Tensor, view: LatentView, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """One decode step's attention output (B, 1, H·r_v per group): every group in one flash-decoding
        launch (:func:`~lrkv_kernels.latent_rope.latent_decode_attention`). A storage that hands out its
        packed codes (:attr:`LatentView.packed`, the quantized one) has them unpacked in the kernel, never
        dequantized into memory."""
        if view.packed is not None:
            h_k, h_v = view.packed  # PackedLatents of S tokens each
        else:
            h_k, h_v = joined(view.keys), joined(view.values)  # (B, S, R_k), (B, S, R_v)
        inv_freq, attention_scaling, _ = self.rope_frequencies()
        out = latent_decode_attention(
            q[:, :, 0], h_k, h_v, self.decode_weights(h_k.dtype), view.positions, inv_freq,
            attention_scaling, self.scaling, additive_mask(attention_mask, view.positions.shape[1]),
        )  # (B, Σ_g nq·r_v)  # fmt: skip
        return out.unsqueeze(1)

    def rope_at(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, S, D) at ``positions`` (B, S) in x's dtype, from this layer's RoPE frequencies."""
        if self._rope_layer_type is None:
            return self.rotary_emb(x, positions)
        return self.rotary_emb(x, positions, self._rope_layer_type)

    def rope_frequencies(self) -> tuple[torch.Tensor, float, str]:
        """This layer's RoPE as the decode kernel reads it: ``inv_freq`` (D/2,), attention scaling, type."""
        rope, kind = self.rotary_emb, self._rope_layer_type
        if kind is None:
            return rope.inv_freq, rope.attention_scaling, getattr(rope, "rope_type", "default")
        return (
            getattr(rope, f"{kind}_inv_freq"),
            getattr(rope, f"{kind}_attention_scaling"),
            rope.rope_type[kind],
        )

    def decode_weights(self, dtype: torch.dtype) -> LatentDecodeWeights:
        """The key up-projections in the decode kernel's layout, rebuilt only when a weight changed. Inside a
        compiled graph (which cannot read a tensor's address) the layout built by an eager step is reused."""
        if torch.compiler.is_compiling() and getattr(self, "_decode_weights_key", (None,))[0] == dtype:
            return self._decode_weights
        ups = [up.weight for up in self.k_up]
        norm = [] if self.k_norm is None else [self.k_norm.weight]
        key = (dtype, *((w.data_ptr(), w._version) for w in ups + norm))
        if getattr(self, "_decode_weights_key", None) != key:
            biases = [up.bias for up in self.k_up]
            scale, eps = (None, 0.0) if self.k_norm is None else self.key_norm()
            self._decode_weights = LatentDecodeWeights.build(
                ups, biases, list(self.layout.ranks_v), self.q_heads_per_group, dtype, scale, eps
            )
            self._decode_weights_key = key
        return self._decode_weights

    def rebuild_keys(
        self, up: nn.Module, h_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """One group's keys (B, s, S, D) from its latents h_k (B, S, r_g), RoPE'd with cos/sin (B, S, D).

        A plain ``k_up`` goes through the fused kernel, which reads its weight and bias. A wrapped one (a
        LoRA adapter around it while recovery trains, :mod:`lrkv_core.lora`) adds its own terms in its
        forward, which reading ``.weight`` would skip, so it is called and RoPE applied after. With QK-norm
        the rebuilt keys go through the original's ``k_norm`` module (its dtype handling included) per head
        before RoPE.
        """
        if type(up) is nn.Linear and self.k_norm is None:
            return reconstruct_rope_keys(h_k, up.weight, up.bias, cos, sin, self.head_dim)
        B, S, _ = h_k.shape
        k = up(h_k).view(B, S, -1, self.head_dim)  # (B, S, s, D)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k.transpose(1, 2), cos, sin)  # (B, s, S, D)

    def key_norm(self) -> tuple[torch.Tensor, float]:
        """The keys' RMSNorm as the decode kernel reads it: its scale (D,) (weight + the family's offset)
        and epsilon."""
        eps = getattr(self.k_norm, "variance_epsilon", getattr(self.k_norm, "eps", None))
        return self.k_norm.weight + self._norm_offset, float(eps)


def joined(groups: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Per-group latents (B, S, r_g) as one (B, S, Σ r_g) tensor: the tensor they are views of when they lie
    side by side in it (the dense cache), else a copy."""
    first = groups[0]
    width = sum(g.shape[-1] for g in groups)
    step = first.element_size()
    side_by_side = first.stride(-1) == 1 and all(
        g.stride() == first.stride()
        and g.data_ptr() == first.data_ptr() + sum(x.shape[-1] for x in groups[:i]) * step
        for i, g in enumerate(groups)
    )
    if side_by_side and first.stride(1) >= width:
        return first.as_strided((*first.shape[:-1], width), first.stride())
    return torch.cat(groups, dim=-1)


def set_fused_decode(model: nn.Module, value: bool | None) -> list[LatentAttentionBase]:
    """Set :attr:`FusedDecode.fused_decode` on every latent attention of ``model`` with a decode kernel
    (:class:`LatentAttention`, ``RotatedKeyAttention``; None: the default, the kernel on CUDA); returns those
    modules."""
    modules = [m for m in model.modules() if isinstance(m, FusedDecode)]
    for m in modules:
        m.fused_decode = value
    return modules
