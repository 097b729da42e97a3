"""``whitened`` (SVD-LLM / Palu): SVD of ``W_g S`` per group, ``S Sᵀ`` the Gram of the k/v_proj inputs.

Truncating to rank r minimises ``‖(W − B_r A_r) X‖_F`` over the calibration activations X (SVD-LLM, Thm. 1);
see :func:`lrkv_core.linalg.fit_group`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..linalg import fit_group, fit_whitening
from .base import DECOMPOSITIONS, Decomposition, Groups, LayerWeights, require_stat


@DECOMPOSITIONS.register
@dataclass(frozen=True)
class Whitened(Decomposition):
    """SVD of W·S with S Sᵀ the input Gram (Palu / SVD-LLM): minimal activation-weighted error"""

    name: ClassVar[str] = "whitened"
    needs: ClassVar[frozenset[str]] = frozenset({"gram"})

    def fit(
        self, weights: LayerWeights, stats: Mapping[str, Any], slices: list[slice], head_dim: int
    ) -> tuple[Groups, dict]:
        wh = fit_whitening(require_stat(stats, "gram", "whitened SVD"))
        groups = {
            kind: [fit_group(w[sl], wh) for sl in slices] for kind, w in (("k", weights.k), ("v", weights.v))
        }
        return groups, {"whitening": wh.method, "damping": wh.damping}
