"""``whitened`` (SVD-LLM / Palu): SVD of ``W_g S`` per group, ``S Sᵀ`` the Gram of the k/v_proj inputs.

Truncating to rank r minimises ``‖(W − B_r A_r) X‖_F`` over the calibration activations X (SVD-LLM, Thm. 1);
see :func:`lrkv_core.linalg.fit_group`.

``values="output"`` measures the values' error where the model uses it, after o_proj: the SVD of
``R W_v,g S`` with ``R² = M`` the group's :func:`~lrkv_core.linalg.value_output_metrics` (block-diagonal
over its KV heads), so the rank-r truncation minimises ``‖R (W − W_r) X‖_F``: value directions o_proj maps
to little are cut first. It reads o_proj's weight; the fused model's form is unchanged (``B_v`` folds into
o_proj either way). ``values="projection"`` is Palu's, the error of v_proj's output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from ..linalg import fit_group, fit_output_metric, fit_whitening, value_output_metrics
from .base import DECOMPOSITIONS, Decomposition, Groups, LayerWeights, require_stat


@DECOMPOSITIONS.register
@dataclass(frozen=True)
class Whitened(Decomposition):
    """SVD of W·S with S Sᵀ the input Gram (Palu / SVD-LLM): minimal activation-weighted error"""

    name: ClassVar[str] = "whitened"
    needs: ClassVar[frozenset[str]] = frozenset({"gram"})
    values: Literal["projection", "output"] = "projection"  # where the values' error is measured

    def __post_init__(self) -> None:
        if self.values not in ("projection", "output"):
            raise ValueError(f"whitened: values must be 'projection' or 'output', got {self.values!r}")

    def reads(self, rope: bool) -> frozenset[str]:
        return frozenset({"o"}) if self.values == "output" else frozenset()

    def fit(
        self, weights: LayerWeights, stats: Mapping[str, Any], slices: list[slice], head_dim: int
    ) -> tuple[Groups, dict]:
        wh = fit_whitening(require_stat(stats, "gram", "whitened SVD"))
        groups = {"k": [fit_group(weights.k[sl], wh) for sl in slices]}
        if self.values == "output":
            if weights.o is None:
                raise ValueError("whitened with values='output' reads o_proj's weight (LayerWeights.o)")
            per_head = value_output_metrics(weights.o, weights.v.shape[0] // head_dim, head_dim)
            heads = [range(sl.start // head_dim, sl.stop // head_dim) for sl in slices]
            metrics = [fit_output_metric(torch.block_diag(*per_head[list(h)])) for h in heads]
            groups["v"] = [fit_group(weights.v[sl], wh, m) for sl, m in zip(slices, metrics, strict=True)]
        else:
            groups["v"] = [fit_group(weights.v[sl], wh) for sl in slices]
        return groups, {"whitening": wh.method, "damping": wh.damping}
