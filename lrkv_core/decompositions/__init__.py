"""Decompositions of a layer's K and V projections, per group of KV heads: one file per method.

Granularity (Palu): group size s counts KV heads; s=1 is M-LRD (per head), s=Hkv is J-LRD (joint), anything
between is G-LRD. Every method fits each group slice ``W_g ≈ B_g A_g`` with the shared math of
:mod:`lrkv_core.linalg`; they differ in the metric that picks the subspace, which is what each file supplies.

Add a decomposition: a new file here with a frozen dataclass ``@DECOMPOSITIONS.register``-ed (its fields are
its options, ``needs`` the calibration statistics it reads) and its import below.
"""

from . import pca, plain, whitened  # noqa: F401  (registration)
from .base import (
    DECOMPOSITIONS,
    KEY_LATENTS,
    KINDS,
    Decomposition,
    LayerFactors,
    LayerWeights,
    decompose_layer,
    load_layer_factors,
    save_layer_factors,
)

__all__ = [
    "DECOMPOSITIONS",
    "KEY_LATENTS",
    "KINDS",
    "Decomposition",
    "LayerFactors",
    "LayerWeights",
    "decompose_layer",
    "load_layer_factors",
    "save_layer_factors",
]
