"""``plain`` (LoRC): SVD of each group slice ``W_g`` of the weights, data-free."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..linalg import fit_group
from .base import DECOMPOSITIONS, Decomposition, Groups, LayerWeights


@DECOMPOSITIONS.register
@dataclass(frozen=True)
class Plain(Decomposition):
    """SVD of the K/V weights themselves (LoRC): data-free"""

    name: ClassVar[str] = "plain"

    def fit(
        self, weights: LayerWeights, stats: Mapping[str, Any], slices: list[slice], head_dim: int
    ) -> tuple[Groups, dict]:
        groups = {
            kind: [fit_group(w[sl], None) for sl in slices]
            for kind, w in (("k", weights.k), ("v", weights.v))
        }
        return groups, {"whitening": "none", "damping": 0}
