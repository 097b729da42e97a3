"""Decompose one layer's K and V projections per group of KV heads, and persist the factors.

Granularity (Palu): group size s counts KV heads; s=1 is M-LRD (per head), s=Hkv is J-LRD (joint),
anything between is G-LRD. Methods are entries of :data:`DECOMPOSITIONS`: each only chooses the
metric handed to :func:`lrkv_core.linalg.fit_group`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .linalg import GroupFactors, Whitening, fit_group, fit_whitening, group_slices

KINDS = ("k", "v")


def _whitened(gram: torch.Tensor | None) -> Whitening | None:
    if gram is None:
        raise ValueError("whitened SVD needs the Gram matrix of the k/v_proj inputs (collect stats first)")
    return fit_whitening(gram)


def _plain(gram: torch.Tensor | None) -> None:
    return None


# name -> how the metric is obtained from the layer's input Gram (None: data-free)
DECOMPOSITIONS: dict[str, Callable[[torch.Tensor | None], Whitening | None]] = {
    "whitened": _whitened,  # SVD-LLM / Palu
    "plain": _plain,  # LoRC
}


@dataclass
class LayerFactors:
    """Full-spectrum factors of one layer: ``groups["k"][g]``, ``groups["v"][g]``."""

    layer: int
    group_size: int
    method: str
    groups: dict[str, list[GroupFactors]]
    info: dict = field(default_factory=dict)

    def spectra(self) -> dict[str, list[torch.Tensor]]:
        return {kind: [f.sigma for f in self.groups[kind]] for kind in KINDS}


def decompose_layer(
    layer: int,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    gram: torch.Tensor | None,
    *,
    n_kv_heads: int,
    head_dim: int,
    group_size: int,
    method: str = "whitened",
) -> LayerFactors:
    """Factor k_proj and v_proj of one layer, group by group.

    Parameters
    ----------
    w_k, w_v : (Hkv·D, d) projection weights.
    gram : (d, d) ``Σ x xᵀ`` of the k/v_proj input (shared by K and V), or None for data-free methods.
    """
    if method not in DECOMPOSITIONS:
        raise ValueError(f"unknown decomposition {method!r}; choose from {sorted(DECOMPOSITIONS)}")
    whitening = DECOMPOSITIONS[method](gram)
    slices = group_slices(n_kv_heads, head_dim, group_size)
    groups = {kind: [fit_group(w[sl], whitening) for sl in slices] for kind, w in (("k", w_k), ("v", w_v))}
    info = {
        "whitening": whitening.method if whitening else "none",
        "damping": whitening.damping if whitening else 0,
    }
    return LayerFactors(layer=layer, group_size=group_size, method=method, groups=groups, info=info)


def save_layer_factors(factors: LayerFactors, path: str | Path) -> None:
    tensors = {}
    for kind in KINDS:
        for g, f in enumerate(factors.groups[kind]):
            tensors[f"{kind}.{g}.sigma"] = f.sigma.contiguous()
            tensors[f"{kind}.{g}.down"] = f.down.contiguous()
            tensors[f"{kind}.{g}.up"] = f.up.contiguous()
    meta = {
        "layer": factors.layer,
        "group_size": factors.group_size,
        "method": factors.method,
        "n_groups": len(factors.groups["k"]),
        "info": factors.info,
    }
    save_file(tensors, str(path), metadata={"lrkv": json.dumps(meta)})


def load_layer_factors(path: str | Path) -> LayerFactors:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["lrkv"])
        groups = {
            kind: [
                GroupFactors(*(f.get_tensor(f"{kind}.{g}.{part}") for part in ("sigma", "down", "up")))
                for g in range(meta["n_groups"])
            ]
            for kind in KINDS
        }
    return LayerFactors(meta["layer"], meta["group_size"], meta["method"], groups, meta["info"])
