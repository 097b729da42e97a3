"""The decomposition interface, its registry, the per-layer factors artifact and the one entry point."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open

from ..linalg import GroupFactors, group_slices
from ..registry import Method, Registry
from ..system.files import save_tensors
from .rope_equivariant import rotated_key_factors

KINDS = ("k", "v")
# latents of the keys before RoPE (keys rebuilt at attention), or of the keys after RoPE
KEY_LATENTS = ("rebuilt", "rotated")

Groups = dict[str, list[GroupFactors]]  # kind -> one GroupFactors per group


@dataclass(frozen=True)
class LayerWeights:
    """The projection weights of one layer a decomposition may read: (Hkv·D, d) k/v, (H·D, d) q and
    (d, H·D) o (q and o only where the decomposition :meth:`~Decomposition.reads` them)."""

    k: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor | None = None
    o: torch.Tensor | None = None


@dataclass(frozen=True)
class Decomposition(Method, ABC):
    """Factors each group of a layer's k_proj and v_proj (full spectrum; ranks are chosen later)."""

    needs: ClassVar[frozenset[str]] = frozenset()  # calibration statistics it reads, e.g. {"gram"}

    def reads(self, rope: bool) -> frozenset[str]:
        """The layer's projections fitting reads besides k and v: ``"q"`` (q_proj), ``"o"`` (o_proj), given
        the model's RoPE handling."""
        return frozenset()

    @abstractmethod
    def fit(
        self, weights: LayerWeights, stats: Mapping[str, Any], slices: list[slice], head_dim: int
    ) -> tuple[Groups, dict]:
        """``(groups["k"|"v"][g], info)`` for the layer; ``stats`` holds the layer's statistics by name."""


DECOMPOSITIONS: Registry[Decomposition] = Registry("decomposition", Decomposition)


def require_stat(stats: Mapping[str, Any], name: str, method: str) -> Any:
    """The layer's statistic ``name``, or a clear error saying ``method`` needs it."""
    if stats.get(name) is None:
        raise ValueError(f"{method} needs the {name} statistic (collect it first)")
    return stats[name]


@dataclass
class LayerFactors:
    """Full-spectrum factors of one layer: ``groups["k"][g]``, ``groups["v"][g]``, and with latents of rotated
    keys ``groups["k_rot"][g]``, the keys' RoPE-equivariant factors; ``groups["k"]`` then holds the same basis
    on the layer input (:func:`on_layer_input`), which ranks are planned on and priced with."""

    layer: int
    group_size: int
    method: str
    groups: dict[str, list[GroupFactors]]
    info: dict = field(default_factory=dict)

    def spectra(self) -> dict[str, list[torch.Tensor]]:
        return {kind: [f.sigma for f in self.groups[kind]] for kind in KINDS}


def decompose_layer(
    layer: int,
    weights: LayerWeights,
    stats: Mapping[str, Any] | None = None,
    *,
    n_kv_heads: int,
    head_dim: int,
    group_size: int,
    decomposition: str | Mapping[str, Any] | Decomposition = "whitened",
    key_latents: str = "rebuilt",
    rotary_dim: int | None = None,
) -> LayerFactors:
    """Factor k_proj and v_proj of one layer, group by group.

    Parameters
    ----------
    weights : the layer's (Hkv·D, d) k/v weights (and q, for methods that read it, and for rotated keys).
    stats : the layer's calibration statistics by name, e.g. ``{"gram": G}`` with G (d, d) ``Σ x xᵀ`` of
        the k/v_proj input; data-free methods need none.
    decomposition : a registered decomposition: name, recipe form or instance.
    key_latents : ``"rotated"`` also fits the keys after RoPE (``groups["k_rot"]``, from the Gram and q_proj:
        :func:`~lrkv_core.decompositions.rope_equivariant.rotated_key_factors`), and the keys' factors
        ``groups["k"]`` are that basis on the layer input (:func:`on_layer_input`), so that every allocator
        and the refinement price the keys the model will cache.
    rotary_dim : with ``"rotated"``, the dims of each head RoPE turns (None: all; partial rotary embeddings).
    """
    if key_latents not in KEY_LATENTS:
        raise ValueError(f"key_latents must be one of {KEY_LATENTS}, got {key_latents!r}")
    method = DECOMPOSITIONS.create(decomposition)
    slices = group_slices(n_kv_heads, head_dim, group_size)
    groups, info = method.fit(weights, stats or {}, slices, head_dim)
    if key_latents == "rotated":
        gram = require_stat(stats or {}, "gram", "latents of rotated keys")
        if weights.q is None:
            raise ValueError("latents of rotated keys read q_proj: pass its weight")
        groups["k_rot"] = rotated_key_factors(
            weights.k, weights.q, gram, n_kv_heads, head_dim, group_size, rotary_dim=rotary_dim
        )
        groups["k"] = on_layer_input(groups["k_rot"], weights.k, slices, groups["k"][0].down.dtype)
    return LayerFactors(layer=layer, group_size=group_size, method=method.name, groups=groups, info=info)


def on_layer_input(
    rotated: list[GroupFactors], w_k: torch.Tensor, slices: list[slice], dtype: torch.dtype
) -> list[GroupFactors]:
    """Each group's RoPE-equivariant key factors (``A`` acting on the group's keys) as factors of its slice
    of ``k_proj``: ``(σ, A W_k,g, B)``. At an even rank r, ``B_r A_r W_k,g`` is the weight whose keys, once
    rotated, are what the rotated-key latents rebuild (``B_r A_r`` commutes with RoPE); at full rank it is
    ``W_k,g``. The allocators' features, the KL response and the refinement's cut weights read these like
    any decomposition's factors (a bias of k_proj is left uncut there)."""
    w_k = w_k.detach().to(torch.float64).cpu()
    return [
        GroupFactors(
            f.sigma.to(dtype, copy=True), (f.down.double() @ w_k[sl]).to(dtype), f.up.to(dtype, copy=True)
        )
        for f, sl in zip(rotated, slices, strict=True)
    ]


def save_layer_factors(factors: LayerFactors, path: str | Path) -> None:
    tensors = {}
    for kind in factors.groups:  # k, v (and k_rot)
        for g, f in enumerate(factors.groups[kind]):
            tensors[f"{kind}.{g}.sigma"] = f.sigma.contiguous()
            tensors[f"{kind}.{g}.down"] = f.down.contiguous()
            tensors[f"{kind}.{g}.up"] = f.up.contiguous()
    meta = {
        "layer": factors.layer,
        "group_size": factors.group_size,
        "method": factors.method,
        "n_groups": len(factors.groups["k"]),
        "kinds": list(factors.groups),
        "info": factors.info,
    }
    save_tensors(tensors, str(path), metadata={"lrkv": json.dumps(meta)})


def load_layer_factors(path: str | Path) -> LayerFactors:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["lrkv"])
        groups = {
            kind: [
                GroupFactors(*(f.get_tensor(f"{kind}.{g}.{part}") for part in ("sigma", "down", "up")))
                for g in range(meta["n_groups"])
            ]
            for kind in meta.get("kinds", KINDS)
        }
    return LayerFactors(meta["layer"], meta["group_size"], meta["method"], groups, meta["info"])
