"""``whitened`` (SVD-LLM / Palu): SVD of ``W_g S`` per group, ``S Sᵀ`` the Gram of the k/v_proj inputs.

Truncating to rank r minimises ``‖(W − B_r A_r) X‖_F`` over the calibration activations X (SVD-LLM, Thm. 1);
see :func:`lrkv_core.linalg.fit_group`.

``keys`` says how the keys' error is weighed:

- ``"projection"`` (Palu's, exactly): at k_proj's output, ``‖(W − W_r) X‖_F``.
- ``"fisher"``: by the loss, ``‖R (W − W_r) X‖_F`` with ``R² = M`` the group's block of the Fisher of the
  k_proj outputs (statistic ``output_fisher``, one gradient pass): the K-FAC second-order loss change, so
  key directions the scores, the softmax and the later layers are least sensitive to are cut first. The
  default: on both benchmark models it lowers the held-out rise in 35 of the 42 (split, ratio, allocator)
  cells measured against ``"projection"``, most for the allocators that cut keys deep
  (docs/decomposition.md).

``values`` says where the values' error is measured:

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

from ..linalg import OutputMetric, fit_group, fit_output_metric, fit_whitening, value_output_metrics
from .base import DECOMPOSITIONS, Decomposition, Groups, LayerWeights, require_stat

VALUES = ("projection", "output", "attention")
KEYS = ("projection", "fisher")
# the keys' Fisher metric is scaled to mean eigenvalue 1 (latents of the keys' usual size, whatever the
# loss's scale) plus this much of the identity: R's condition number stays below √(width / damping), so
# fp32/fp16 latents lose no precision; on shakespeare-llama 1e-4 to 1e-2 give the same rises (1e-3)
KEY_FISHER_DAMPING = 1e-3


@DECOMPOSITIONS.register
@dataclass(frozen=True)
class Whitened(Decomposition):
    """SVD of W·S with S Sᵀ the input Gram (Palu / SVD-LLM): minimal activation-weighted error"""

    name: ClassVar[str] = "whitened"
    values: Literal["projection", "output", "attention"] = "attention"  # where the values' error is measured
    keys: Literal["projection", "fisher"] = "fisher"  # how the keys' error is weighed

    def __post_init__(self) -> None:
        if self.values not in VALUES:
            raise ValueError(f"whitened: values must be one of {', '.join(VALUES)}, got {self.values!r}")
        if self.keys not in KEYS:
            raise ValueError(f"whitened: keys must be one of {', '.join(KEYS)}, got {self.keys!r}")

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset(
            {"gram"}
            | ({"attention_gram"} if self.values == "attention" else set())
            | ({"output_fisher"} if self.keys == "fisher" else set())
        )

    def reads(self, rope: bool) -> frozenset[str]:
        return frozenset() if self.values == "projection" else frozenset({"o"})

    def fit(
        self, weights: LayerWeights, stats: Mapping[str, Any], slices: list[slice], head_dim: int
    ) -> tuple[Groups, dict]:
        wh = fit_whitening(require_stat(stats, "gram", "whitened SVD"))
        info: dict[str, Any] = {"whitening": wh.method, "damping": wh.damping}
        if self.keys == "projection":
            groups = {"k": [fit_group(weights.k[sl], wh) for sl in slices]}
        else:
            fisher = require_stat(stats, "output_fisher", "whitened SVD with keys='fisher'")["k"]
            groups = {"k": [fit_group(weights.k[sl], wh, key_metric(fisher[sl, sl])) for sl in slices]}
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


def key_metric(fisher: torch.Tensor) -> OutputMetric:
    """The keys' output metric from a group's block of the output Fisher: scaled to mean eigenvalue 1 and
    damped by :data:`KEY_FISHER_DAMPING` of the identity."""
    fisher = fisher.to(torch.float64)
    scale = fisher.trace() / fisher.shape[0]
    if not torch.isfinite(scale) or scale <= 0:
        raise ValueError("the keys' output Fisher is zero or not finite: no gradient reached k_proj")
    eye = torch.eye(fisher.shape[0], dtype=torch.float64)
    return fit_output_metric(fisher / scale + KEY_FISHER_DAMPING * eye)
