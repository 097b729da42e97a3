"""``pca`` (Eigen Attention, Saxena et al. 2024): activation PCA of the K/V outputs.

Values: eigenvectors of each group's output covariance ``W_v,g G W_v,gᵀ`` (the whitened-SVD subspace, see
:func:`~lrkv_core.linalg.fit_output_pca`). Keys: one basis ``U_k`` (D × D) from ``Σ_h W_k,h G W_k,hᵀ``
over the layer's KV heads, shared by every head (``B_h = U_k``), interleaved per group
(:func:`~lrkv_core.linalg.fit_on_shared_basis`). For RoPE models the key basis lives in the per-head key
space before RoPE, which the latent attention applies after rebuilding keys. For non-RoPE models (Eigen
Attention's OPT path) the basis is the joint K∪Q one, from ``Σ_h W_k,h G W_k,hᵀ + Σ_h W_q,h G W_q,hᵀ``
(unscaled q_proj); queries are projected onto it by the fusion, which folds ``B_k = U`` into ``W_q``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..linalg import fit_on_shared_basis, fit_output_pca, fit_shared_basis
from .base import DECOMPOSITIONS, Decomposition, Groups, LayerWeights, require_stat


@DECOMPOSITIONS.register
@dataclass(frozen=True)
class Pca(Decomposition):
    """activation PCA (Eigen Attention): per-group value bases, one key basis per layer (K∪Q without RoPE)"""

    name: ClassVar[str] = "pca"
    needs: ClassVar[frozenset[str]] = frozenset({"gram"})

    def reads(self, rope: bool) -> frozenset[str]:
        return frozenset() if rope else frozenset({"q"})

    def fit(
        self, weights: LayerWeights, stats: Mapping[str, Any], slices: list[slice], head_dim: int
    ) -> tuple[Groups, dict]:
        gram = require_stat(stats, "gram", "activation PCA")
        joint = weights.k if weights.q is None else torch.cat([weights.k, weights.q])  # (Hkv·D [+ H·D], d)
        basis = fit_shared_basis(joint, gram, head_dim)  # (D, D)
        groups = {
            "k": [fit_on_shared_basis(weights.k[sl], gram, basis) for sl in slices],
            "v": [fit_output_pca(weights.v[sl], gram) for sl in slices],
        }
        key_basis = "shared per layer" if weights.q is None else "joint K and Q, shared per layer"
        return groups, {"whitening": "none", "damping": 0, "key_basis": key_basis}
