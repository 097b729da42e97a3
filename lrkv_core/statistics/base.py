"""The calibration-statistic interface, its registry, and one file format for all statistics.

A statistic is collected from the model over the calibration rows in one streaming pass and gives one value
per layer: a tensor (the Gram matrix) or a dict of tensors (the Fisher of k_proj and v_proj). Methods name
the statistics they read in ``needs``; only those are collected.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from torch import nn

from ..files import save_tensors
from ..registry import Method, Registry

Progress = Callable[[int, int], None] | None
LayerValue = torch.Tensor | dict[str, torch.Tensor]


@dataclass(frozen=True)
class Statistic(Method, ABC):
    """A per-layer calibration statistic, collected in one pass over the calibration rows.

    ``n_samples`` uses only the first n calibration rows (they are drawn at random, so these are a random
    subset): statistics can then use different amounts of calibration data (e.g. Palu whitens with 256
    windows and estimates the Fisher with 2048) from one calibration set of the largest size.
    """

    n_samples: int | None = None  # the first n calibration rows; None: all of them
    # read the decomposition's factors (``collect(..., factors=...)``), so collected after decomposing
    uses_factors: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.n_samples is not None and self.n_samples < 1:
            raise ValueError(f"{self.name}: n_samples must be ≥ 1, got {self.n_samples}")

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The calibration rows this statistic uses; a clear error when it asks for more than there are."""
        if self.n_samples is None:
            return rows
        if self.n_samples > rows.shape[0]:
            raise ValueError(
                f"statistic {self.name} asks for {self.n_samples} calibration rows, the calibration has "
                f"{rows.shape[0]}: raise calibration.n_samples"
            )
        return rows[: self.n_samples]

    @abstractmethod
    def collect(
        self, model: nn.Module, rows: torch.Tensor, *, batch_size: int = 8, progress: Progress = None
    ) -> tuple[list[LayerValue], dict[str, Any]]:
        """Per-layer values for ``rows`` (N, T) token ids, and metadata (sample counts, ...).

        A statistic with ``uses_factors`` also takes ``factors=``, every layer's full-spectrum factors."""


STATISTICS: Registry[Statistic] = Registry("statistic", Statistic)


def forward_rows(
    model: nn.Module,
    rows: torch.Tensor,
    handles: list,
    *,
    batch_size: int,
    progress: Progress,
    after_batch: Callable[[], None] | None = None,
) -> None:
    """Run ``model`` (eval mode, no cache) over ``rows`` in batches for its hooks to accumulate, calling
    ``after_batch`` after each, reporting progress; the hooks in ``handles`` are removed and the train mode
    restored, even on error."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        n = rows.shape[0]
        for start in range(0, n, batch_size):
            model(rows[start : start + batch_size].to(device), use_cache=False)
            if after_batch is not None:
                after_batch()
            if progress:
                progress(min(start + batch_size, n), n)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)


def save_statistic(stat: Statistic, values: list[LayerValue], meta: dict[str, Any], path: str | Path) -> None:
    """Safetensors: ``{layer}`` for tensor values, ``{layer}.{key}`` for dict values; header as JSON."""
    tensors, keys = {}, None
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            tensors[str(i)] = value.contiguous()
        else:
            keys = sorted(value)
            tensors.update({f"{i}.{k}": value[k].contiguous() for k in keys})
    header = {"statistic": stat.to_dict(), "layers": len(values), "keys": keys, "meta": meta}
    save_tensors(tensors, str(path), metadata={"lrkv_statistic": json.dumps(header)})


def read_header(path: str | Path) -> dict[str, Any]:
    """The statistic's recipe form, layer count, value keys and metadata."""
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["lrkv_statistic"])


def load_statistic(path: str | Path, layer: int | None = None) -> LayerValue | list[LayerValue]:
    """One layer's value (only its tensors are read), or every layer's."""
    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["lrkv_statistic"])
        keys = header["keys"]

        def value(i: int) -> LayerValue:
            if keys is None:
                return f.get_tensor(str(i))
            return {k: f.get_tensor(f"{i}.{k}") for k in keys}

        if layer is not None:
            if not 0 <= layer < header["layers"]:
                raise IndexError(f"{path} holds {header['layers']} layers, not layer {layer}")
            return value(layer)
        return [value(i) for i in range(header["layers"])]
