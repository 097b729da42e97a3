"""Apply factors to a model: swap each attention for its latent form and fold ``B_v`` into ``o_proj``.

The math (factors, ranks) is computed elsewhere; this module only edits the model, and it is the one
place that does. Layers are addressed through the architecture adapter, and the adapter's ``rope`` flag
picks the attention kind (:data:`ATTENTION_KINDS`): its module class and how its keys are fused.

- RoPE models: ``q_proj`` is copied, ``B_k`` (+ k bias) becomes ``k_up`` (keys rebuilt, then rotated); the
  per-head ``q_norm``/``k_norm`` of QK-norm models (Qwen3) are copied and act on queries and rebuilt keys.
- Latents of rotated keys (RoPE models, ``attention="rotated-keys"``): ``q_proj`` and ``k_proj`` are copied,
  the groups' ``A_k`` (fitted to rotated keys) fill ``k_down``'s diagonal and ``B_k`` becomes ``k_up``, which
  the queries absorb (:mod:`lrkv_core.model.attention_rotated`).
- Non-RoPE models: ``B_k`` is folded into ``q_proj`` (rows ``B_k,g,jᵀ W_q,h``, bias ``B_k,g,jᵀ b_q,h``);
  the k bias only adds ``q·b_k``, constant per query row, and is dropped (softmax cancels it).
- All models: ``W_o,h B_v,g,j`` per query head h becomes ``o_proj``; ``W_o,h b_v,j`` joins its bias.
- Rotation (``--rotation``, :mod:`lrkv_core.quant.rotation`): each group's truncated factors become ``(Rᵀ A, B
  R)`` before any of the above, so ``k_down``/``v_down`` emit rotated latents and ``k_up``, the keys folded
  into ``q_proj`` and the values folded into ``o_proj`` all undo it: the product, and the model, are
  unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import StaticCache

from ..allocation import RankPlan
from ..cache import CACHE_ARG, CACHE_STORAGES, LatentCache, LatentUpdates, StaticLatentCache, pop_cache
from ..decompositions import LayerFactors
from ..format import LrkvFormat
from ..linalg import GroupFactors, truncate
from ..quant.rotation import RotationConfig, check_rotation, group_seed, rotate_factors, rotation_matrix
from ..version import __version__
from .adapters import ArchAdapter, AttnShape, get_adapter
from .attention import LatentAttention, LatentAttentionBase, LatentLayout
from .attention_norope import NoRopeLatentAttention
from .attention_rotated import RotatedKeyAttention


def layouts(fmt: LrkvFormat) -> list[LatentLayout]:
    """Each layer's latent layout (ranks per group, biases) as the format section gives it."""
    return [
        LatentLayout(fmt.group_size, tuple(rk), tuple(rv), fmt.qkv_bias, fmt.o_bias)
        for rk, rv in zip(fmt.ranks_k, fmt.ranks_v)
    ]


def _f64(t: torch.Tensor | None, n: int) -> torch.Tensor:
    """A bias in float64, or zeros (n,) when the projection has none."""
    return torch.zeros(n, dtype=torch.float64) if t is None else t.detach().to(torch.float64).cpu()


def _set_linear(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    linear.weight.copy_(weight.to(linear.weight.dtype))
    if linear.bias is not None:
        linear.bias.copy_(bias.to(linear.bias.dtype) if bias is not None else torch.zeros_like(linear.bias))


def _heads(g: int, shape: AttnShape, s: int) -> list[tuple[int, int]]:
    """``(h, j)`` for each query head h of group g, with j its KV head within the group."""
    return [(h, h // shape.n_rep - g * s) for h in range(g * s * shape.n_rep, (g + 1) * s * shape.n_rep)]


def _fuse_keys_rope(new: LatentAttention, q: nn.Linear, k: nn.Linear, k_parts, shape: AttnShape) -> None:
    """Keys rebuilt per group: ``k_down`` the groups' ``A_k,g`` stacked, ``q_proj`` as is, ``k_up[g] =
    B_k,g`` with the group's k bias rows."""
    width = new.layout.group_size * shape.D
    _set_linear(new.k_down, torch.cat([a for a, _ in k_parts]))
    _set_linear(new.q_proj, q.weight, q.bias)
    k_bias = _f64(k.bias, shape.kv_width)
    for g, (_, b_k) in enumerate(k_parts):
        _set_linear(new.k_up[g], b_k, k_bias[g * width : (g + 1) * width])


def _fuse_keys_into_q(
    new: NoRopeLatentAttention, q: nn.Linear, k: nn.Linear, k_parts, shape: AttnShape
) -> None:
    """``k_down`` the groups' ``A_k,g`` stacked, ``q'_h = B_k,g,jᵀ (W_q,h x + b_q,h)``; the k bias cancels
    in softmax and is dropped."""
    D, s = shape.D, new.layout.group_size
    _set_linear(new.k_down, torch.cat([a for a, _ in k_parts]))
    w_q = q.weight.detach().to(torch.float64).cpu()  # (H·D, d)
    b_q = _f64(q.bias, shape.H * D)
    rows, bias = [], []
    for g, (_, b_k) in enumerate(k_parts):
        for h, j in _heads(g, shape, s):
            b_kh = b_k[j * D : (j + 1) * D]  # (D, r_g)
            rows.append(b_kh.T @ w_q[h * D : (h + 1) * D])  # (r_g, d)
            bias.append(b_kh.T @ b_q[h * D : (h + 1) * D])  # (r_g,)
    _set_linear(new.q_proj, torch.cat(rows), torch.cat(bias))


def _fuse_rotated_keys(
    new: RotatedKeyAttention, q: nn.Linear, k: nn.Linear, k_parts, shape: AttnShape
) -> None:
    """Latents of rotated keys: ``q_proj`` and ``k_proj`` as is, ``k_down`` the groups' ``A_g`` (r_g × s·D,
    on rotated keys) on its diagonal, ``k_up[g] = B_g`` (the rows the queries absorb)."""
    width = new.layout.group_size * shape.D
    _set_linear(new.q_proj, q.weight, q.bias)
    _set_linear(new.k_proj, k.weight, k.bias)
    down = torch.zeros(sum(new.layout.ranks_k), shape.Hkv * shape.D, dtype=torch.float64)
    row = 0
    for g, (a, b) in enumerate(k_parts):
        down[row : row + a.shape[0], g * width : (g + 1) * width] = a
        row += a.shape[0]
        _set_linear(new.k_up[g], b)
    _set_linear(new.k_down, down)


@dataclass(frozen=True)
class AttentionKind:
    """A latent attention module, how its keys are fused, and its name in ``config.lrkv["rope"]``."""

    name: str
    module: type[LatentAttentionBase]
    fuse_keys: Callable[..., None]


# keyed by ArchAdapter.rope: the one place the attention kind is chosen
ATTENTION_KINDS: dict[bool, AttentionKind] = {
    True: AttentionKind("reconstruct-then-rope", LatentAttention, _fuse_keys_rope),
    False: AttentionKind("keys-fused-into-q", NoRopeLatentAttention, _fuse_keys_into_q),
}


# latents of rotated keys (queries absorb B_k): chosen by name, for RoPE models, where the factors of the keys
# are fitted to rotated keys (lrkv_core.decompositions.rope_equivariant.rotated_key_factors)
ROTATED_KEYS = AttentionKind("rotated-keys", RotatedKeyAttention, _fuse_rotated_keys)


def attention_kind(adapter: ArchAdapter, name: str | None = None) -> AttentionKind:
    """The attention kind of a model: its architecture's default, or the one ``name``d (a format's
    ``rope``): ``rotated-keys`` for a RoPE model's latents of rotated keys."""
    default = ATTENTION_KINDS[adapter.rope]
    if name is None or name == default.name:
        return default
    if name == ROTATED_KEYS.name and adapter.rope:
        return ROTATED_KEYS
    raise ValueError(f"{adapter.model_type} models take {default.name!r} attention, not {name!r}")


def rotated_parts(
    groups: list[GroupFactors], ranks: tuple[int, ...], rotation: RotationConfig, layer: int, kind: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each group's rank-r factors ``(A (r, d), B (s·D, r))`` in float64 on the CPU, rotated to
    ``(Rᵀ A, B R)`` by the policy's matrix for that group
    (:func:`lrkv_core.quant.rotation.rotation_matrix`)."""
    parts = []
    for g, (f, r) in enumerate(zip(groups, ranks)):
        a, b = (t.to(torch.float64).cpu() for t in truncate(f, r))
        matrix, _ = rotation_matrix(r, rotation.name, group_seed(rotation.seed, layer, kind, g))
        parts.append(rotate_factors(a, b, matrix))
    return parts


@torch.no_grad()
def fuse_attention(
    attn: nn.Module,
    factors: LayerFactors,
    layout: LatentLayout,
    adapter: ArchAdapter,
    config,
    layer_idx: int,
    rotation: RotationConfig | None = None,
    kind: AttentionKind | None = None,
) -> LatentAttentionBase:
    """The latent attention holding ``attn``'s weights through the truncated (and rotated) factors, fused
    in float64, of the model's attention kind or ``kind``."""
    shape = adapter.shape(config)
    s, D = layout.group_size, shape.D
    q, k, v, o = (adapter.linear(attn, p, config) for p in "qkvo")  # Phi-3's fused qkv_proj: its rows
    kind = kind or attention_kind(adapter)
    new = kind.module(config, layer_idx, adapter, layout)  # filled in float64 on the CPU, then moved
    new = new.to(dtype=torch.float64)

    rotation = rotation or RotationConfig()
    keys = "k_rot" if kind is ROTATED_KEYS else "k"
    if keys not in factors.groups:
        raise ValueError(
            f"layer {layer_idx}'s factors hold no keys fitted after RoPE: decompose with key_latents: rotated"
        )
    k_parts = rotated_parts(factors.groups[keys], layout.ranks_k, rotation, layer_idx, "k")
    v_parts = rotated_parts(factors.groups["v"], layout.ranks_v, rotation, layer_idx, "v")
    _set_linear(new.v_down, torch.cat([a for a, _ in v_parts]))
    kind.fuse_keys(new, q, k, k_parts, shape)
    if adapter.qk_norm is not None:  # the per-head norms act on queries and rebuilt keys, never on latents
        new.q_norm.load_state_dict(attn.q_norm.state_dict())
        new.k_norm.load_state_dict(attn.k_norm.state_dict())

    w_o = o.weight.detach().to(torch.float64).cpu()  # (d, H·D)
    b_v = _f64(v.bias, shape.kv_width)
    o_bias = _f64(o.bias, shape.d)
    blocks = []
    for g, (_, up_v) in enumerate(v_parts):
        for h, j in _heads(g, shape, s):
            w_oh = w_o[:, h * D : (h + 1) * D]  # (d, D)
            blocks.append(w_oh @ up_v[j * D : (j + 1) * D])  # (d, r_g)
            kv = h // shape.n_rep
            o_bias += w_oh @ b_v[kv * D : (kv + 1) * D]  # softmax rows sum to 1
    _set_linear(new.o_proj, torch.cat(blocks, dim=1), o_bias)
    return new.to(device=q.weight.device, dtype=q.weight.dtype).train(attn.training)  # the replaced mode


def compress_model(
    model: nn.Module,
    factors: list[LayerFactors],
    plan: RankPlan,
    *,
    decomposition: dict,
    cache: dict | None = None,
    rotation: RotationConfig | str | Mapping[str, Any] | None = None,
    attention: str | None = None,
) -> nn.Module:
    """Replace every attention in place by its latent form with the plan's ranks; returns the model.

    ``attention`` names the attention kind (:func:`attention_kind`; None: the architecture's): with
    ``"rotated-keys"`` the keys' factors are each layer's ``groups["k_rot"]`` (fitted to rotated keys:
    :func:`~lrkv_core.decompositions.rope_equivariant.rotated_key_factors`) and their ranks even.

    ``decomposition`` and ``cache`` are the recipe forms (``{"name": ..., **options}``) recorded in the
    model-format section (``config.lrkv``); the cache storage is what the model's latent cache will use.
    ``rotation`` (a :class:`~lrkv_core.quant.rotation.RotationConfig`, its mapping form or a policy's name;
    None: no rotation) is fused into every group's factors. Whether the storage can hold the plan's ranks and
    the policy can rotate them is checked before the model is touched.
    """
    config = model.config
    adapter = get_adapter(config)
    kind = attention_kind(adapter, attention)
    rotation = RotationConfig.create(rotation)
    first = adapter.attention(model, 0)
    has_bias = {p: adapter.linear(first, p, config).bias is not None for p in "qkvo"}
    fmt = LrkvFormat(
        decomposition=dict(decomposition),
        allocator=dict(plan.allocator),
        group_size=plan.group_size,
        ranks_k=plan.ranks["k"],
        ranks_v=plan.ranks["v"],
        rank_multiple=plan.rank_multiple,
        target_ratio=plan.target_ratio,
        achieved_ratio=plan.achieved_ratio,
        rope=kind.name,
        qkv_bias=has_bias["q"] or has_bias["k"],
        o_bias=has_bias["o"] or has_bias["v"],  # the v bias folds into the output bias
        cache=dict(cache or {"name": "dense"}),
        rotation=rotation.name,
        rotation_seed=rotation.seed,
        lrkv_version=__version__,
    )
    if fmt.n_layers != len(factors) or fmt.n_layers != adapter.shape(config).L:
        raise ValueError("plan, factors and model disagree on the number of layers")
    storage = CACHE_STORAGES.create(fmt.cache)
    for ranks in (*fmt.ranks_k, *fmt.ranks_v):
        storage.check_ranks(ranks)
    storage.check_rotation(rotation.name)
    check_rotation(rotation.name, [*fmt.ranks_k, *fmt.ranks_v])
    if kind is ROTATED_KEYS and any(r % 2 for ranks in fmt.ranks_k for r in ranks):
        raise ValueError(f"latents of rotated keys take even key ranks (RoPE pairs), got {fmt.ranks_k}")
    for i, (f, layout) in enumerate(zip(factors, layouts(fmt))):
        attn = adapter.attention(model, i)
        new = fuse_attention(attn, f, layout, adapter, config, i, rotation, kind)
        adapter.set_attention(model, i, new)
    config.lrkv = fmt.to_dict()
    enable_latent_cache(model)
    return model


def build_latent_skeleton(model: nn.Module) -> nn.Module:
    """Swap attentions for empty latent attentions shaped by ``model.config.lrkv`` (weights loaded after)."""
    config = model.config
    fmt = LrkvFormat.of(config)
    adapter = get_adapter(config)
    try:
        kind = attention_kind(adapter, fmt.rope)
    except ValueError:
        raise ValueError(
            f"lrkv section says rope handling {fmt.rope!r}, "
            f"but {adapter.model_type} models need {attention_kind(adapter).name!r}"
        ) from None
    if fmt.n_layers != adapter.shape(config).L:
        raise ValueError(
            f"lrkv section has ranks for {fmt.n_layers} layers, the model has {adapter.shape(config).L}"
        )
    for i, layout in enumerate(layouts(fmt)):
        ref = adapter.attention(model, i)
        p = next(ref.parameters())
        new = kind.module(config, i, adapter, layout).to(p.device, p.dtype).train(ref.training)
        adapter.set_attention(model, i, new)
    config.lrkv = fmt.to_dict()  # migrated to the current format version
    enable_latent_cache(model)
    return model


def _latent_cache_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Give the decoder stack a latent cache whenever it would otherwise make (or got) an empty default one,
    under the installed transformers' cache keyword (:data:`CACHE_ARG`), whichever name the caller used: a
    :class:`StaticLatentCache` of the same length for an empty static one (``generate(...,
    cache_implementation="static")``), a :class:`LatentCache` otherwise."""
    past = pop_cache(kwargs)
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(module.config, "use_cache", True)
    if past is None:
        if use_cache:
            kwargs[CACHE_ARG] = LatentCache.from_config(module.config)
    elif isinstance(past, LatentUpdates):
        kwargs[CACHE_ARG] = past
    elif past.get_seq_length() != 0:
        raise TypeError(
            f"an lrkv-compressed model cannot continue from a filled {type(past).__name__}; use a LatentCache"
        )
    elif isinstance(past, StaticCache):
        kwargs[CACHE_ARG] = StaticLatentCache.from_config(module.config, past.get_max_length())
    else:
        kwargs[CACHE_ARG] = LatentCache.from_config(module.config)
    return args, kwargs


def enable_latent_cache(model: nn.Module) -> None:
    """Make plain ``model(ids, use_cache=True)`` and ``generate()`` use a LatentCache (idempotent)."""
    base = get_adapter(model.config).base_model(model)
    if _latent_cache_pre_hook not in base._forward_pre_hooks.values():
        base.register_forward_pre_hook(_latent_cache_pre_hook, with_kwargs=True)
