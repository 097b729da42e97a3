"""``whitened`` (SVD-LLM / Palu): SVD of ``W_g S`` per group, ``S Sᵀ`` the Gram of the k/v_proj inputs.

Truncating to rank r minimises ``‖(W − B_r A_r) X‖_F`` over the calibration activations X (SVD-LLM, Thm. 1);
see :func:`lrkv_core.linalg.fit_group`.

``values`` says where the values' error is measured (keys are always whitened SVD):

- ``"projection"`` (Palu's, exactly): at v_proj's output, ``‖(W − W_r) X‖_F``.
- ``"output"``: after o_proj, ``‖R (W − W_r) X‖_F``: the SVD of ``R W_v,g S`` with ``R² = M`` the group's
  :func:`~lrkv_core.linalg.value_output_metrics` (block-diagonal over its KV heads), so value directions
  o_proj maps to little are cut first. Reads o_proj's weight.
- ``"attention"``: after the attention and o_proj, ``‖R (W − W_r) X̄‖_F``: as ``"output"``, but whitened with
  the Gram of the attention-mixed inputs ``x̄ = Σ_n p_n x_n`` that the heads read values through
  (statistic ``attention_gram``, one more calibration pass with eager attention). The default: with uniform
  ranks it loses the least of the three on both benchmark models at every ratio measured, and with the
  allocators less than ``"projection"`` in most cells (docs/decomposition.md).

The fused model's form is the same for all three (``B_v`` folds into o_proj either way).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from ..linalg import fit_group, fit_output_metric, fit_whitening, value_output_metrics
from .base import DECOMPOSITIONS, Decomposition, Groups, LayerWeights, require_stat

VALUES = ("projection", "output", "attention")


@DECOMPOSITIONS.register
@dataclass(frozen=True)
class Whitened(Decomposition):
    """SVD of W·S with S Sᵀ the input Gram (Palu / SVD-LLM): minimal activation-weighted error"""

    name: ClassVar[str] = "whitened"
    values: Literal["projection", "output", "attention"] = "attention"  # where the values' error is measured

    def __post_init__(self) -> None:
        if self.values not in VALUES:
            raise ValueError(f"whitened: values must be one of {', '.join(VALUES)}, got {self.values!r}")

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset({"gram", "attention_gram"} if self.values == "attention" else {"gram"})

    def reads(self, rope: bool) -> frozenset[str]:
        return frozenset() if self.values == "projection" else frozenset({"o"})

    def fit(
        self, weights: LayerWeights, stats: Mapping[str, Any], slices: list[slice], head_dim: int
    ) -> tuple[Groups, dict]:
        wh = fit_whitening(require_stat(stats, "gram", "whitened SVD"))
        groups = {"k": [fit_group(weights.k[sl], wh) for sl in slices]}
        info: dict[str, Any] = {"whitening": wh.method, "damping": wh.damping}
        if self.values == "projection":
            groups["v"] = [fit_group(weights.v[sl], wh) for sl in slices]
        else:
            if weights.o is None:
                raise ValueError(
                    f"whitened with values={self.values!r} reads o_proj's weight (LayerWeights.o)"
                )
            per_head = value_output_metrics(weights.o, weights.v.shape[0] // head_dim, head_dim)
            heads = [range(sl.start // head_dim, sl.stop // head_dim) for sl in slices]
            metrics = [fit_output_metric(torch.block_diag(*per_head[list(h)])) for h in heads]
            mixed = wh
            if self.values == "attention":
                mixed = fit_whitening(
                    require_stat(stats, "attention_gram", "whitened SVD with values='attention'")
                )
                info["value_whitening"], info["value_damping"] = mixed.method, mixed.damping
            groups["v"] = [fit_group(weights.v[sl], mixed, m) for sl, m in zip(slices, metrics, strict=True)]
        return groups, info
