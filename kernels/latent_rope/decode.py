"""A layer's decode attention over latents: the kernel's weight layout and the torch reference (the spec).

:func:`latent_decode_attention_ref` is one decode step of a latent attention layer, all groups at once:
per group, the scores against keys rebuilt from the latents (:func:`latent_rope_scores_ref`), the mask, a
float32 softmax, and the probabilities times the **value latents** (``B_v`` is folded into ``o_proj``, so
values are never rebuilt). The Triton kernel (:mod:`lrkv_kernels.latent_rope.flash`) computes the same in
one launch per layer.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .reference import latent_rope_scores_ref


@dataclass(frozen=True)
class LatentDecodeWeights:
    """A layer's key up-projections in the kernel's layout, made once per set of weights.

    ``up`` (G, s·D, max r_k) stacks the groups' ``B_k`` zero-padded to the widest rank; ``bias`` (G, s·D)
    or None; ``ranks_k``, ``ranks_v`` (G,) int32; ``k_offsets``, ``v_offsets`` (G,) int32 where each group's
    latents start in the concatenated H_k, H_v; ``out_offsets`` (G,) int32 where each group's outputs start
    in a row of the result (per group, head after head, r_v each); ``width`` that row's length;
    ``norm_weight`` (D,) float32 and ``norm_eps`` the keys' per-head RMSNorm before RoPE (QK-norm: Qwen3), or
    None; ``k_align``, ``v_align`` the largest power of two up to 8 that divides every group's key (value)
    rank, so every group's latents start at a multiple of it (how the kernels may read packed codes).
    """

    up: torch.Tensor
    bias: torch.Tensor | None
    ranks_k: torch.Tensor
    ranks_v: torch.Tensor
    k_offsets: torch.Tensor
    v_offsets: torch.Tensor
    out_offsets: torch.Tensor
    width: int
    max_rank_v: int
    norm_weight: torch.Tensor | None = None
    norm_eps: float = 0.0
    k_align: int = 1
    v_align: int = 1

    @classmethod
    def build(
        cls,
        ups: list[torch.Tensor],
        biases: list[torch.Tensor | None],
        ranks_v: list[int],
        q_heads_per_group: int,
        dtype: torch.dtype,
        norm_weight: torch.Tensor | None = None,
        norm_eps: float = 0.0,
    ) -> LatentDecodeWeights:
        """From each group's ``B_k`` (s·D, r_g) and k bias rows (s·D,) or None, in the latents' dtype, and
        the keys' RMSNorm scale (D,) (kept in float32) and epsilon where the model norms its keys."""
        device = ups[0].device
        ranks_k = [u.shape[1] for u in ups]
        up = torch.zeros(len(ups), ups[0].shape[0], max(ranks_k), device=device, dtype=dtype)
        for g, u in enumerate(ups):
            up[g, :, : u.shape[1]] = u
        bias = None if biases[0] is None else torch.stack([b_.to(dtype) for b_ in biases])

        def offsets(widths: list[int]) -> torch.Tensor:
            starts = [sum(widths[:g]) for g in range(len(widths))]
            return torch.tensor(starts, device=device, dtype=torch.int32)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, device=device, dtype=torch.int32)

        out_widths = [q_heads_per_group * r for r in ranks_v]
        norm = None if norm_weight is None else norm_weight.detach().to(device, torch.float32).contiguous()
        return cls(
            up, bias, ints(ranks_k), ints(ranks_v), offsets(ranks_k), offsets(list(ranks_v)),
            offsets(out_widths), sum(out_widths), max(ranks_v), norm, float(norm_eps),
            alignment(ranks_k), alignment(list(ranks_v)),
        )  # fmt: skip

    @classmethod
    def layout(
        cls, ranks_k: list[int], ranks_v: list[int], q_heads_per_group: int, device: torch.device | str
    ) -> LatentDecodeWeights:
        """The groups' layout alone (ranks, offsets, output width), for latents that need no key
        up-projection (:mod:`lrkv_kernels.latent_rope.absorbed`): ``up`` has no rows."""
        ups = [torch.empty(0, r, device=device) for r in ranks_k]
        return cls.build(ups, [None] * len(ups), list(ranks_v), q_heads_per_group, torch.float32)

    def groups(self) -> list[tuple[slice, slice, torch.Tensor, torch.Tensor | None]]:
        """Per group: its key and value latents' columns in H_k, H_v, its ``B_k`` (s·D, r_k) and bias."""
        out = []
        for g in range(self.up.shape[0]):
            rk, rv = int(self.ranks_k[g]), int(self.ranks_v[g])
            ko, vo = int(self.k_offsets[g]), int(self.v_offsets[g])
            bias = None if self.bias is None else self.bias[g]
            out.append((slice(ko, ko + rk), slice(vo, vo + rv), self.up[g, :, :rk], bias))
        return out


def alignment(ranks: list[int]) -> int:
    """The largest power of two up to 8 dividing every rank (1 where one is odd)."""
    align = 8
    while any(r % align for r in ranks):
        align //= 2
    return align


TABLE_FLOOR = 4096  # positions the RoPE tables cover at least
_TABLES: OrderedDict[tuple[int, float], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()
_KEPT_TABLES = 8  # models whose tables stay cached


def rope_tables_for(
    inv_freq: torch.Tensor, attention_scaling: float, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (P, D/2) float32 of positions 0 … P−1, P ≥ ``length`` a power of two, exactly as HF's rotary
    embedding computes them (the float32 angle ``position · inv_freq``, its cos/sin, times
    ``attention_scaling``): the decode kernel reads them instead of evaluating cos/sin for every cached token,
    layer and group. Cached per ``inv_freq`` tensor (held while cached, so its identity stays unique) and
    grown by doubling; positions past P make the kernel compute cos/sin itself."""
    key = (id(inv_freq), float(attention_scaling))
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is inv_freq and hit[1].shape[0] >= length:
        _TABLES.move_to_end(key)
        return hit[1], hit[2]
    size = max(TABLE_FLOOR, 1 << max(length - 1, 0).bit_length())
    angle = (
        torch.arange(size, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    )
    cos, sin = angle.cos() * attention_scaling, angle.sin() * attention_scaling
    _TABLES[key] = (inv_freq, cos, sin)
    while len(_TABLES) > _KEPT_TABLES:
        _TABLES.popitem(last=False)
    return cos, sin


def additive_mask(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """A decode step's attention mask as the kernel reads it: (B, S) float32 to add to the scores, from a
    transformers mask (B, 1, 1, ≥ S), boolean (True attends) or additive; None stays None."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, 0, -1, :length]  # the one query row
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.float()


def latent_decode_attention_ref(
    q: torch.Tensor,
    h_k: torch.Tensor,
    h_v: torch.Tensor,
    weights: LatentDecodeWeights,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    scaling: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step's attention of a latent layer, before ``o_proj``. Where ``weights`` carry a key norm,
    each KV head's rebuilt keys are RMS-normed over their D dims and scaled by it before RoPE.

    Parameters
    ----------
    q : (B, H, D) RoPE'd queries of the step's token; group g owns query heads g·H/G … (g+1)·H/G − 1.
    h_k, h_v : (B, S, R_k), (B, S, R_v) the cached key and value latents, groups side by side.
    weights : the layer's :class:`LatentDecodeWeights`.
    positions : (B, S) the cached tokens' positions.
    inv_freq, attention_scaling : the model's RoPE.
    scaling : the softmax scale.
    mask : (B, S) float added to the scores (−inf: not attended), or None.

    Returns
    -------
    (B, width) in h_v's dtype: per group, per query head, the attention-weighted value latents (r_v each),
    the row ``o_proj`` reads.
    """
    B, H, _ = q.shape
    groups = weights.groups()
    nq = H // len(groups)
    norm = None if weights.norm_weight is None else (weights.norm_weight, weights.norm_eps)
    outs = []
    for g, (cols_k, cols_v, up, bias) in enumerate(groups):
        q_g = q[:, g * nq : (g + 1) * nq, None]  # (B, nq, 1, D)
        scores = latent_rope_scores_ref(
            q_g, h_k[..., cols_k], up, bias, positions, inv_freq, attention_scaling, scaling, norm
        )  # (B, nq, 1, S) float32
        if mask is not None:
            scores = scores + mask[:, None, None, :].float()
        probs = torch.softmax(scores, dim=-1)
        outs.append((probs @ h_v[:, None, :, cols_v].float()).reshape(B, -1))  # (B, nq·r_v)
    return torch.cat(outs, dim=-1).to(h_v.dtype)
