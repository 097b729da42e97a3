"""Apply factors to a model: swap each attention for a LatentAttention and fold ``B_v`` into ``o_proj``.

The math (factors, ranks) is computed elsewhere; this module only edits the model, and it is the one
place that does. Layers are addressed through the architecture adapter.
"""

from __future__ import annotations

import torch
from torch import nn

from . import __version__
from .adapters import ArchAdapter, get_adapter
from .attention import LatentAttention, LatentLayout
from .cache import LatentCache
from .decompose import LayerFactors
from .linalg import truncate
from .ranks import RankPlan


def layouts_from_plan(plan: RankPlan, qkv_bias: bool, o_bias: bool) -> list[LatentLayout]:
    return [
        LatentLayout(plan.group_size, tuple(rk), tuple(rv), qkv_bias, o_bias)
        for rk, rv in zip(plan.ranks["k"], plan.ranks["v"])
    ]


@torch.no_grad()
def fuse_attention(
    attn: nn.Module, factors: LayerFactors, layout: LatentLayout, adapter: ArchAdapter, config, layer_idx: int
) -> LatentAttention:
    """A LatentAttention holding ``attn``'s weights through the truncated factors (float64 fusion)."""
    shape = adapter.shape(config)
    s, D, n_rep = layout.group_size, shape.D, shape.n_rep
    q = getattr(attn, adapter.q_name)
    k = getattr(attn, adapter.k_name)
    v = getattr(attn, adapter.v_name)
    o = getattr(attn, adapter.o_name)
    new = LatentAttention(config, layer_idx, adapter, layout).to(device=q.weight.device, dtype=q.weight.dtype)
    dtype = q.weight.dtype

    new.q_proj.weight.copy_(q.weight)
    if q.bias is not None:
        new.q_proj.bias.copy_(q.bias)
    k_parts = [truncate(f, r) for f, r in zip(factors.groups["k"], layout.ranks_k)]
    v_parts = [truncate(f, r) for f, r in zip(factors.groups["v"], layout.ranks_v)]
    new.k_down.weight.copy_(torch.cat([a for a, _ in k_parts]).to(dtype))
    new.v_down.weight.copy_(torch.cat([a for a, _ in v_parts]).to(dtype))
    for g, (_, b) in enumerate(k_parts):
        new.k_up[g].weight.copy_(b.to(dtype))
        if k.bias is not None:
            new.k_up[g].bias.copy_(k.bias[g * s * D : (g + 1) * s * D])

    w_o = o.weight.to(torch.float64)  # (d, H·D)
    blocks = []
    o_bias = (
        o.bias.to(torch.float64).clone() if o.bias is not None else torch.zeros(shape.d, dtype=torch.float64)
    )
    for g, (_, b_v) in enumerate(v_parts):
        for h in range(g * s * n_rep, (g + 1) * s * n_rep):
            j = h // n_rep - g * s  # KV head of query head h, within the group
            w_oh = w_o[:, h * D : (h + 1) * D]  # (d, D)
            blocks.append(w_oh @ b_v[j * D : (j + 1) * D])  # (d, r_g)
            if v.bias is not None:
                kv = h // n_rep
                o_bias += w_oh @ v.bias[kv * D : (kv + 1) * D].to(torch.float64)
    new.o_proj.weight.copy_(torch.cat(blocks, dim=1).to(dtype))
    if new.o_proj.bias is not None:
        new.o_proj.bias.copy_(o_bias.to(dtype))
    return new


def lrkv_section(plan: RankPlan, method: str, qkv_bias: bool, o_bias: bool, **extra) -> dict:
    """The ``lrkv`` section of config.json: everything needed to rebuild the module shapes."""
    return {
        "version": __version__,
        "method": "palu",
        "decomposition": method,
        "group_size": plan.group_size,
        "ranks_k": plan.ranks["k"],
        "ranks_v": plan.ranks["v"],
        "rank_multiple": plan.rank_multiple,
        "target_ratio": plan.target_ratio,
        "achieved_ratio": plan.achieved_ratio,
        "allocator": plan.allocator,
        "rope": "reconstruct-then-rope",
        "qkv_bias": qkv_bias,
        "o_bias": o_bias,
        "rotation": None,
        "bits": None,
        **extra,
    }


def compress_model(model: nn.Module, factors: list[LayerFactors], plan: RankPlan, method: str) -> nn.Module:
    """Replace every attention in place by its latent form with the plan's ranks; returns the model."""
    config = model.config
    adapter = get_adapter(config)
    first = adapter.attention(model, 0)
    qkv_bias = getattr(first, adapter.k_name).bias is not None
    o_bias = (
        getattr(first, adapter.o_name).bias is not None or getattr(first, adapter.v_name).bias is not None
    )
    layouts = layouts_from_plan(plan, qkv_bias, o_bias)
    if len(layouts) != len(factors) or len(layouts) != adapter.shape(config).L:
        raise ValueError("plan, factors and model disagree on the number of layers")
    for i, (f, layout) in enumerate(zip(factors, layouts)):
        adapter.set_attention(
            model, i, fuse_attention(adapter.attention(model, i), f, layout, adapter, config, i)
        )
    config.lrkv = lrkv_section(plan, method, qkv_bias, o_bias)
    enable_latent_cache(model)
    return model


def build_latent_skeleton(model: nn.Module) -> nn.Module:
    """Swap attentions for empty LatentAttentions shaped by ``model.config.lrkv`` (weights loaded after)."""
    config = model.config
    section = config.lrkv
    adapter = get_adapter(config)
    for i, (rk, rv) in enumerate(zip(section["ranks_k"], section["ranks_v"])):
        layout = LatentLayout(
            section["group_size"], tuple(rk), tuple(rv), section["qkv_bias"], section["o_bias"]
        )
        ref = adapter.attention(model, i)
        p = next(ref.parameters())
        adapter.set_attention(model, i, LatentAttention(config, i, adapter, layout).to(p.device, p.dtype))
    enable_latent_cache(model)
    return model


def _latent_cache_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Give the decoder stack a LatentCache whenever it would otherwise make (or got) an empty default one."""
    past = kwargs.get("past_key_values")
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(module.config, "use_cache", True)
    if past is None:
        if use_cache:
            kwargs["past_key_values"] = LatentCache(module.config.num_hidden_layers)
    elif not isinstance(past, LatentCache):
        if past.get_seq_length() != 0:
            raise TypeError(
                f"an lrkv-compressed model cannot continue from a filled {type(past).__name__}; "
                "use a LatentCache"
            )
        kwargs["past_key_values"] = LatentCache(module.config.num_hidden_layers)
    return args, kwargs


def enable_latent_cache(model: nn.Module) -> None:
    """Make plain ``model(ids, use_cache=True)`` and ``generate()`` use a LatentCache (idempotent)."""
    base = get_adapter(model.config).base_model(model)
    if _latent_cache_pre_hook not in base._forward_pre_hooks.values():
        base.register_forward_pre_hook(_latent_cache_pre_hook, with_kwargs=True)
