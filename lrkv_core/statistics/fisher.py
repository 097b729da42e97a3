"""``fisher``: empirical diagonal Fisher information of every layer's k_proj and v_proj weights.

``F = (1/S) Σ_s (∂ℓ_s/∂W)²`` per element of ``W_k`` and ``W_v`` (same shape as the weight), over S samples
of the calibration rows, where ``ℓ_s`` is the mean next-token loss of the sample. A sample is one row
(``per_row=True``, the textbook empirical Fisher: one squared gradient per sequence) or one micro-batch
(``per_row=False``, what Palu accumulates: the squared gradient of each batch's mean loss, which folds
cross-row terms in and depends on the batch size). With ``batch_size=1`` both are the same. Collected in
shards, the squared gradients are summed per shard and divided once by the total S; a per-batch Fisher's
shards are cut between micro-batches (every shard with the same batch size), so its samples stay the same.

Labels are the input ids themselves: the HF model shifts them internally, so the loss of row ``x`` scores
``x[t+1]`` given ``x[..t]``. Palu passes ``input_ids[:, :-1]`` with labels ``input_ids[:, 1:]`` and the model
shifts again, scoring ``x[t+2]`` given ``x[..t]``: a different (and wrong) Fisher.

Per-row gradients come from one backward pass per micro-batch (:func:`~.gradients.kv_gradient_passes`):
with the k/v_proj input ``x`` (B, T, d) and the loss gradient at its output ``g`` (B, T, out), row b's weight
gradient is ``g_bᵀ x_b`` (out, d). The squares are accumulated in float32 or float64 whatever the model's
dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..model.adapters import get_adapter
from .base import STATISTICS, Counts, LayerValue, Progress, Statistic
from .gradients import kv_gradient_passes

KINDS = ("k", "v")

# fisher[layer][kind] -> (Hkv·D, d), same shape as the projection weight
FisherInfo = list[dict[str, torch.Tensor]]


def collect_fisher(
    model: nn.Module,
    rows: torch.Tensor,
    *,
    batch_size: int = 8,
    per_row: bool = True,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[FisherInfo, int]:
    """Diagonal empirical Fisher of every layer's k_proj and v_proj weights.

    Parameters
    ----------
    rows : (N, T) calibration token ids (no padding: every row has T − 1 scored tokens).
    batch_size : rows per forward/backward pass.
    per_row : one squared gradient per row (default) or per micro-batch (Palu).
    dtype : accumulator dtype, float32 or float64.

    Returns
    -------
    fisher : ``fisher[layer]["k"|"v"]`` (Hkv·D, d) in ``dtype``, the mean squared gradient per sample.
    n_samples : S, the number of squared gradients averaged (N per row, ⌈N / batch_size⌉ per batch).
    """
    sums, n_samples = sum_fisher(
        model, rows, batch_size=batch_size, per_row=per_row, dtype=dtype, progress=progress
    )
    return _mean(sums, n_samples), n_samples


def sum_fisher(
    model: nn.Module,
    rows: torch.Tensor,
    *,
    batch_size: int = 8,
    per_row: bool = True,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[FisherInfo, int]:
    """The sums of :func:`collect_fisher`'s squared gradients (on the CPU), not yet divided by the number of
    samples S; and S."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"accumulate the Fisher in float32 or float64, not {dtype}")
    shape = get_adapter(model.config).shape(model.config)
    fisher = [
        {kind: torch.zeros(shape.kv_width, shape.d, dtype=dtype) for kind in KINDS} for _ in range(shape.L)
    ]
    acc_device = []

    def visit(layer: int, kind: str, x: torch.Tensor, g: torch.Tensor) -> None:
        if not acc_device:
            acc_device.append(x.device)
            for entry in fisher:
                for k in KINDS:
                    entry[k] = entry[k].to(x.device)
        _accumulate(fisher[layer][kind], x, g, per_row)

    n_rows, n_batches = kv_gradient_passes(model, rows, visit, batch_size=batch_size, progress=progress)
    return [{kind: layer[kind].cpu() for kind in KINDS} for layer in fisher], n_rows if per_row else n_batches


def _mean(sums: FisherInfo, n_samples: int) -> FisherInfo:
    return [{kind: layer[kind] / n_samples for kind in KINDS} for layer in sums]


def _accumulate(acc: torch.Tensor, x: torch.Tensor, g: torch.Tensor, per_row: bool) -> None:
    """Add squared weight gradients: x (B, T, d) the projection input, g (B, T, out) ∂(batch loss)/∂output."""
    x, g = x.to(acc.dtype), g.to(acc.dtype)
    if not per_row:
        grad = g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (out, d)
        acc.add_(grad.square())
        return
    B = x.shape[0]
    for b in range(B):  # the batch loss is the mean over B equally long rows: ∂ℓ_b = B · (row b's share)
        grad = (g[b].T @ x[b]) * B  # (out, d)
        acc.add_(grad.square())


@STATISTICS.register
@dataclass(frozen=True)
class Fisher(Statistic):
    """diagonal empirical Fisher of each layer's k/v_proj weights: what the Fisher-based allocators read"""

    name: ClassVar[str] = "fisher"
    per_row: bool = True  # one squared gradient per row (textbook), else per micro-batch (Palu)

    def unit(self, batch_size: int) -> int:
        return 1 if self.per_row else batch_size  # a micro-batch is one sample: shards cut between batches

    def accumulate(
        self,
        model: nn.Module,
        rows: torch.Tensor,
        *,
        first_row: int,
        batch_size: int,
        progress: Progress,
    ) -> tuple[list[LayerValue], Counts]:
        sums, n = sum_fisher(model, rows, batch_size=batch_size, per_row=self.per_row, progress=progress)
        return sums, {"n_samples": n}

    def finish(self, sums: list[LayerValue], counts: Counts) -> tuple[list[LayerValue], dict[str, Any]]:
        n = counts["n_samples"]
        return _mean(sums, n), {"n_samples": n, "per_row": self.per_row}
