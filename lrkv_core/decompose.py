"""Decompose one layer's K and V projections per group of KV heads, and persist the factors.

Granularity (Palu): group size s counts KV heads; s=1 is M-LRD (per head), s=Hkv is J-LRD (joint),
anything between is G-LRD. Methods are entries of :data:`DECOMPOSITIONS`: each says how a layer's
groups are fitted by the shared math of :mod:`lrkv_core.linalg`, given the layer's input Gram.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .linalg import (
    GroupFactors,
    fit_group,
    fit_on_shared_basis,
    fit_output_pca,
    fit_shared_basis,
    fit_whitening,
    group_slices,
)

KINDS = ("k", "v")

Groups = dict[str, list[GroupFactors]]
# (w_k, w_v, gram, group row slices, head_dim) -> (groups["k"|"v"][g], info)
LayerFit = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, list[slice], int], tuple[Groups, dict]]


def _require_gram(gram: torch.Tensor | None, what: str) -> torch.Tensor:
    if gram is None:
        raise ValueError(f"{what} needs the Gram matrix of the k/v_proj inputs (collect stats first)")
    return gram


def _whitened(
    w_k: torch.Tensor, w_v: torch.Tensor, gram: torch.Tensor | None, slices: list[slice], head_dim: int
) -> tuple[Groups, dict]:
    """SVD-LLM / Palu: SVD of ``W_g S`` per group."""
    wh = fit_whitening(_require_gram(gram, "whitened SVD"))
    groups = {kind: [fit_group(w[sl], wh) for sl in slices] for kind, w in (("k", w_k), ("v", w_v))}
    return groups, {"whitening": wh.method, "damping": wh.damping}


def _plain(
    w_k: torch.Tensor, w_v: torch.Tensor, gram: torch.Tensor | None, slices: list[slice], head_dim: int
) -> tuple[Groups, dict]:
    """LoRC: SVD of ``W_g`` per group, data-free."""
    groups = {kind: [fit_group(w[sl], None) for sl in slices] for kind, w in (("k", w_k), ("v", w_v))}
    return groups, {"whitening": "none", "damping": 0}


def _pca(
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    gram: torch.Tensor | None,
    slices: list[slice],
    head_dim: int,
    w_q: torch.Tensor | None = None,
) -> tuple[Groups, dict]:
    """Eigen Attention (Saxena et al. 2024): activation PCA of the K/V outputs.

    Values: eigenvectors of each group's output covariance ``W_v,g G W_v,gᵀ`` (the whitened-SVD subspace,
    see :func:`~lrkv_core.linalg.fit_output_pca`). Keys: one basis ``U_k`` (D × D) from
    ``Σ_h W_k,h G W_k,hᵀ`` over the layer's KV heads, shared by every head (``B_h = U_k``), interleaved
    per group (:func:`~lrkv_core.linalg.fit_on_shared_basis`). For RoPE models the key basis lives in the
    per-head key space before RoPE, which the latent attention applies after rebuilding keys. For non-RoPE
    models (``w_q`` given: Eigen Attention's OPT path) the basis is the joint K∪Q one, from
    ``Σ_h W_k,h G W_k,hᵀ + Σ_h W_q,h G W_q,hᵀ`` (unscaled q_proj); queries are projected onto it by the
    fusion, which folds ``B_k = U`` into ``W_q``.
    """
    gram = _require_gram(gram, "activation PCA")
    joint = w_k if w_q is None else torch.cat([w_k, w_q])  # (Hkv·D [+ H·D], d)
    basis = fit_shared_basis(joint, gram, head_dim)  # (D, D)
    groups = {
        "k": [fit_on_shared_basis(w_k[sl], gram, basis) for sl in slices],
        "v": [fit_output_pca(w_v[sl], gram) for sl in slices],
    }
    key_basis = "shared per layer" if w_q is None else "joint K and Q, shared per layer"
    return groups, {"whitening": "none", "damping": 0, "key_basis": key_basis}


JOINT_QK = frozenset({"pca"})  # methods whose key basis also uses W_q on non-RoPE models


# name -> how a layer's groups are fitted from its weights and input Gram (None: data-free)
DECOMPOSITIONS: dict[str, LayerFit] = {
    "whitened": _whitened,  # SVD-LLM / Palu
    "plain": _plain,  # LoRC
    "pca": _pca,  # Eigen Attention (RoPE models)
}
DATA_FREE = frozenset({"plain"})  # methods that need no activation statistics


def needs_gram(method: str) -> bool:
    """Whether a decomposition needs the Gram matrix of the k/v_proj inputs (calibration stats)."""
    if method not in DECOMPOSITIONS:
        raise ValueError(f"unknown decomposition {method!r}; choose from {sorted(DECOMPOSITIONS)}")
    return method not in DATA_FREE


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
    w_q: torch.Tensor | None = None,
) -> LayerFactors:
    """Factor k_proj and v_proj of one layer, group by group.

    Parameters
    ----------
    w_k, w_v : (Hkv·D, d) projection weights.
    gram : (d, d) ``Σ x xᵀ`` of the k/v_proj input (shared by K and V), or None for data-free methods.
    method : a key of :data:`DECOMPOSITIONS`. "pca" is Eigen Attention (shared key basis).
    w_q : (H·D, d) q_proj weight, for "pca" on non-RoPE models only (joint K∪Q key basis).
    """
    if method not in DECOMPOSITIONS:
        raise ValueError(f"unknown decomposition {method!r}; choose from {sorted(DECOMPOSITIONS)}")
    if w_q is not None and method not in JOINT_QK:
        raise ValueError(f"decomposition {method!r} takes no query weight")
    slices = group_slices(n_kv_heads, head_dim, group_size)
    extra = {"w_q": w_q} if w_q is not None else {}
    groups, info = DECOMPOSITIONS[method](w_k, w_v, gram, slices, head_dim, **extra)
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
