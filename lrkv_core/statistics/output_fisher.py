"""``output_fisher``: the Fisher of each layer's k_proj and v_proj outputs, ``Σ_t g_t g_tᵀ``.

``g_t`` is the gradient of a row's summed next-token loss at the projection's output (Hkv·D) at position t
(every later token's loss reads it), with targets drawn from the model's own predictions
(``labels="sampled"``, the true Fisher: the Hessian of the KL to the original) or the rows' own next tokens
(``labels="data"``, the empirical Fisher); each row's targets are drawn from a generator seeded by
``seed`` and the row's index, so neither batches nor shards change them. A weight error ``δW`` changes
the loss, to second order and in the Kronecker (K-FAC) approximation that treats the projection's inputs
and output gradients as independent, by ``½ tr(δW G δWᵀ M) / n``: ``G`` the input Gram, ``M`` this
statistic. So a decomposition that whitens the inputs with ``G`` and weighs the outputs with ``R² = M``
cuts first the directions the loss is least sensitive to, whatever path through RoPE, the softmax and the
later layers they take (what ``whitened`` with ``keys="fisher"`` reads).

It reads the first 128 calibration rows by default (``n_samples``; all of them when there are fewer): on
SmolLM2 at ratio 0.5 with the same ranks, the keys decomposed with the Fisher of 128 rows lose 0.3 % more KL
than with 256, and a gradient pass over the other 128 rows would add about a sixth to the default
conversion's time (docs/long-context.md). The Grams read every row: in the same pass over the first 128, in
a forward pass over the rest.

Each gradient is that of the row's summed loss (the batch-mean loss's gradient times the B·(T − 1) scored
positions), so batches of any size add up alike; accumulated in float64. Cost: one forward and backward
pass over the rows it reads, whose forward pass the Gram and the attention Gram can observe
(:mod:`lrkv_core.statistics.joint`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..model.adapters import get_adapter
from .base import STATISTICS, Counts, LayerValue
from .gradients import row_seeded_targets
from .joint import JointStatistic, Observer, accumulate_joint
from .response import KINDS, LABELS

FISHER_ROWS = 128  # calibration rows the keys' Fisher reads by default (docs/long-context.md)


def collect_output_fisher(
    model: nn.Module,
    rows: torch.Tensor,
    *,
    batch_size: int = 8,
    sampled: bool = True,
    seed: int = 0,
    first_row: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[dict[str, torch.Tensor]], int]:
    """``fisher[layer]["k"|"v"]`` (Hkv·D, Hkv·D) float64, ``Σ_t g_t g_tᵀ`` over every scored position of
    ``rows`` (N, T); and the number of positions summed. See the module docstring. Sampled targets are
    drawn per row, seeded by ``seed`` and the row's index (counted from ``first_row``)."""
    stat = OutputFisher(labels="sampled" if sampled else "data", seed=seed)
    [(sums, counts)] = accumulate_joint(
        [stat], model, rows, first_row=first_row, batch_size=batch_size, progress=progress
    )
    return sums, counts["n_tokens"]


def output_fisher_observer(model: nn.Module, *, sampled: bool, seed: int, first_row: int) -> Observer:
    """The loss of one backward pass (targets drawn per row from ``seed`` and the row's index, or the rows'
    own tokens) and the sums ``Σ g gᵀ`` its visits add up."""
    shape = get_adapter(model.config).shape(model.config)
    sums = [
        {kind: torch.zeros(shape.kv_width, shape.kv_width, dtype=torch.float64) for kind in KINDS}
        for _ in range(shape.L)
    ]
    scored_positions = [0]

    def visit(layer: int, kind: str, _x: torch.Tensor, g: torch.Tensor) -> None:
        scored = g.shape[0] * (g.shape[1] - 1)  # the loss is the mean over B·(T − 1) positions
        if layer == 0 and kind == KINDS[0]:
            scored_positions[0] += scored
        g = g.reshape(-1, g.shape[-1]).double() * scored
        sums[layer][kind] += (g.T @ g).cpu()

    targets = row_seeded_targets(seed, first_row) if sampled else None
    return Observer(lambda: (sums, {"n_tokens": scored_positions[0]}), loss=(visit, targets))


@STATISTICS.register
@dataclass(frozen=True)
class OutputFisher(JointStatistic):
    """Σ g gᵀ of the loss gradient at each k/v_proj output (float64): what keys='fisher' weighs keys by"""

    name: ClassVar[str] = "output_fisher"
    joint: ClassVar[str | None] = "gradient"
    caps_rows: ClassVar[bool] = True
    n_samples: int | None = FISHER_ROWS  # the first n calibration rows (all of them when fewer); None: all
    labels: str = "sampled"  # targets drawn from the model's predictions (true Fisher), or "data"
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.labels not in LABELS:
            raise ValueError(f"output_fisher labels must be one of {LABELS}, got {self.labels!r}")

    def observer(self, model: nn.Module, *, first_row: int, recording: list[bool]) -> Observer:
        sampled = self.labels == "sampled"
        return output_fisher_observer(model, sampled=sampled, seed=self.seed, first_row=first_row)

    def finish(self, sums: list[LayerValue], counts: Counts) -> tuple[list[LayerValue], dict[str, Any]]:
        return sums, {"n_tokens": counts["n_tokens"], "labels": self.labels}  # sums: added as they are
