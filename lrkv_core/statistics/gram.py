"""``gram``: the Gram matrix ``Σ x xᵀ`` of every layer's k/v_proj input, collected while streaming data.

Both projections read the same normed hidden state; the Gram is accumulated in float64 through forward
pre-hooks, and activations are never kept. It can observe another statistic's pass over the same rows
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
from .joint import JointStatistic, Observer, accumulate_joint


def collect_gram(
    model: nn.Module,
    rows: torch.Tensor,
    *,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[torch.Tensor], int]:
    """Gram matrices of the k/v_proj inputs of every layer.

    Parameters
    ----------
    rows : (N, T) calibration token ids.

    Returns
    -------
    grams : L tensors (d, d) float64, ``Σ_tokens x xᵀ``.
    n_tokens : number of token vectors accumulated per layer.
    """
    [(grams, counts)] = accumulate_joint(
        [Gram()], model, rows, first_row=0, batch_size=batch_size, progress=progress
    )
    return grams, counts["n_tokens"]


def gram_observer(model: nn.Module, recording: list[bool]) -> Observer:
    """Forward pre-hooks on every layer's k_proj adding ``x xᵀ`` (float64) while ``recording[0]``."""
    adapter = get_adapter(model.config)
    shape = adapter.shape(model.config)
    device = next(model.parameters()).device
    grams = [torch.zeros(shape.d, shape.d, dtype=torch.float64, device=device) for _ in range(shape.L)]
    counts = [0] * shape.L

    def make_hook(i: int):
        def hook(_module: nn.Module, args: tuple) -> None:
            if not recording[0]:
                return
            with torch.no_grad():
                x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)  # (B·T, d)
                grams[i].addmm_(x.T, x)
            counts[i] += x.shape[0]

        return hook

    hooks = [
        getattr(adapter.attention(model, i), adapter.k_name).register_forward_pre_hook(make_hook(i))
        for i in range(shape.L)
    ]
    return Observer(lambda: ([g.cpu() for g in grams], {"n_tokens": counts[0]}), hooks)


@STATISTICS.register
@dataclass(frozen=True)
class Gram(JointStatistic):
    """Σ x xᵀ of each layer's k/v_proj input (float64): what whitened SVD and PCA read"""

    name: ClassVar[str] = "gram"
    joint: ClassVar[str | None] = "forward"

    def observer(self, model: nn.Module, *, first_row: int, recording: list[bool]) -> Observer:
        return gram_observer(model, recording)

    def finish(self, sums: list[LayerValue], counts: Counts) -> tuple[list[LayerValue], dict[str, Any]]:
        return sums, {"n_tokens": counts["n_tokens"]}  # sums: they add up across shards as they are
