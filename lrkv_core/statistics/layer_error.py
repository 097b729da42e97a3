"""``layer_output_error``: how far each decoder layer's output moves when its K/V groups are cut by a
spectral threshold (Eigen Attention's layer-wise rank search, its Algorithm 1).

For a threshold ε, every K and V group of a layer keeps the smallest rank whose prefix holds at least the
share ε of the group's energy (the paper's Eq. 5, on the decomposition's spectrum:
``Σ_{j<r} σ_j² ≥ ε Σ_j σ_j²``).
With those projections the decoder layer runs on its calibration inputs ``X_l`` (the original model's), and
its output ``X'_{l+1}`` is compared with the original's: ``e_l(ε) = ‖X'_{l+1} − X_{l+1}‖² / ‖X_{l+1}‖²`` over
every calibration token. ε runs from 1 down to 0 in steps of ``step`` (the paper's ε_s, 0.02): each layer's
whole curve, so that the allocator can search the error budget ``e_b`` that meets a target ratio without
running the model again. Thresholds that give the same ranks share one measurement. The numerator and the
denominator are sums over tokens, so shards of the rows add both and divide once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..model.adapters import get_adapter
from .base import STATISTICS, Counts, LayerValue, Progress, Statistic, forward_rows

if TYPE_CHECKING:
    from ..decompositions import LayerFactors

KINDS = ("k", "v")


def threshold_grid(step: float) -> torch.Tensor:
    """ε = 1, 1 − step, … down to 0 (float64), the thresholds Algorithm 1 walks through."""
    n = round(1 / step)
    if abs(n * step - 1) > 1e-9:
        raise ValueError(f"layer_output_error step must divide 1, got {step}")
    return torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64)


def energy_rank(sigma: torch.Tensor, eps: float) -> int:
    """Eq. 5: the smallest rank r whose first r latents hold at least the share ``eps`` of ``Σ σ²``."""
    energy = sigma.to(torch.float64).square().cumsum(0)
    if eps <= 0 or energy[-1] <= 0:
        return 0
    target = (eps - 1e-12) * energy[-1]  # a share met up to float rounding counts as met
    return min(int(torch.searchsorted(energy, target, side="left")) + 1, sigma.numel())


@STATISTICS.register
@dataclass(frozen=True)
class LayerOutputError(Statistic):
    """each decoder layer's relative output error at every spectral threshold ε (Eigen Attention's search)"""

    name: ClassVar[str] = "layer_output_error"
    uses_factors: ClassVar[bool] = True
    step: float = 0.02  # ε_s: the thresholds are 1, 1 − step, …, 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.step <= 1:
            raise ValueError(f"layer_output_error step must be in (0, 1], got {self.step}")
        threshold_grid(self.step)

    def accumulate(
        self,
        model: nn.Module,
        rows: torch.Tensor,
        *,
        first_row: int,
        batch_size: int,
        progress: Progress,
        factors: Sequence[LayerFactors] | None = None,
    ) -> tuple[list[LayerValue], Counts]:
        if factors is None:
            raise ValueError(
                "layer_output_error reads the decomposition's factors: collect it after decomposing"
            )
        sums = sum_layer_output_error(
            model, rows, factors, threshold_grid(self.step), batch_size=batch_size, progress=progress
        )
        return sums, {"n_rows": rows.shape[0]}

    def finish(self, sums: list[LayerValue], counts: Counts) -> tuple[list[LayerValue], dict[str, Any]]:
        values = relative_errors(sums, threshold_grid(self.step))
        return values, {"n_rows": counts["n_rows"], "step": self.step}


def collect_layer_output_error(
    model: nn.Module,
    rows: torch.Tensor,
    factors: Sequence[LayerFactors],
    thresholds: torch.Tensor,
    *,
    batch_size: int = 8,
    progress: Progress = None,
) -> list[dict[str, torch.Tensor]]:
    """Per layer ``{"epsilon": (n,), "error": (n,)}`` float64: ``e_l(ε)`` at each threshold (see the module).

    Parameters
    ----------
    rows : (N, T) calibration token ids.
    factors : every layer's full-spectrum factors, in layer order.
    thresholds : the ε to measure, in [0, 1].
    """
    sums = sum_layer_output_error(model, rows, factors, thresholds, batch_size=batch_size, progress=progress)
    return relative_errors(sums, thresholds)


def relative_errors(sums: list[LayerValue], thresholds: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer ``{"epsilon", "error"}`` from :func:`sum_layer_output_error`'s sums: ``e_l(ε)`` is the
    summed squared difference over the summed squared reference (0 where the reference is 0)."""
    out = []
    for layer in sums:
        norm = float(layer["norm"])
        error = [d / norm if norm else 0.0 for d in layer["diff"].tolist()]
        out.append({"epsilon": thresholds.clone(), "error": torch.tensor(error, dtype=torch.float64)})
    return out


@torch.no_grad()
def sum_layer_output_error(
    model: nn.Module,
    rows: torch.Tensor,
    factors: Sequence[LayerFactors],
    thresholds: torch.Tensor,
    *,
    batch_size: int = 8,
    progress: Progress = None,
) -> list[dict[str, torch.Tensor]]:
    """The sums behind :func:`collect_layer_output_error`, per layer float64 ``{"diff": (n,), "norm": ()}``:
    ``‖X'_{l+1}(ε) − X_{l+1}‖²`` at each threshold and ``‖X_{l+1}‖²``, over every token of ``rows``."""
    adapter = get_adapter(model.config)
    shape = adapter.shape(model.config)
    if len(factors) != shape.L or [f.layer for f in factors] != list(range(shape.L)):
        raise ValueError(f"layer_output_error needs the factors of layers 0..{shape.L - 1} in order")
    layers = adapter.layers(model)
    # per layer, the ranks each threshold gives every group, and the distinct rank settings to measure
    ranks = [
        [
            tuple(energy_rank(g.sigma, float(eps)) for kind in KINDS for g in f.groups[kind])
            for eps in thresholds
        ]
        for f in factors
    ]
    settings = [sorted(set(per_eps)) for per_eps in ranks]
    diff = [dict.fromkeys(s, 0.0) for s in settings]
    norm = [0.0] * shape.L
    captured: dict[int, tuple[tuple, dict, torch.Tensor]] = {}
    capturing = [True]  # off while the layers are rerun with cut weights

    def capture(i: int):
        def hook(_module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if capturing[0]:
                captured[i] = (args, kwargs, output[0] if isinstance(output, tuple) else output)

        return hook

    def measure() -> None:
        """The batch's layers rerun on their captured inputs, at every distinct setting of their ranks."""
        capturing[0] = False
        for i, f in enumerate(factors):
            args, kwargs, reference = captured[i]
            ref = reference.double()
            norm[i] += float(ref.square().sum())
            for setting in settings[i]:
                with _cut(adapter.attention(model, i), adapter, model.config, f, setting):
                    out = layers[i](*args, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                diff[i][setting] += float((out.double() - ref).square().sum())
        captured.clear()
        capturing[0] = True

    handles = [layer.register_forward_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)]
    forward_rows(model, rows, handles, batch_size=batch_size, progress=progress, after_batch=measure)
    return [
        {
            "diff": torch.tensor([diff[i][s] for s in ranks[i]], dtype=torch.float64),
            "norm": torch.tensor(norm[i], dtype=torch.float64),
        }
        for i in range(shape.L)
    ]


class _cut:
    """Within the block, the layer's k_proj / v_proj weights are their groups' factors cut to ``setting``
    (the ranks of the K groups, then the V groups); restored on exit."""

    def __init__(
        self, attention: nn.Module, adapter, config, factors: LayerFactors, setting: tuple[int, ...]
    ):
        # the k and v weights (rows of Phi-3's fused qkv_proj), edited in place through these views
        self.projections = [adapter.linear(attention, kind, config) for kind in KINDS]
        self.factors, self.setting = factors, setting
        self.saved: list[torch.Tensor] = []

    def __enter__(self) -> None:
        ranks = iter(self.setting)
        for proj, kind in zip(self.projections, KINDS, strict=True):
            weight = proj.weight
            self.saved.append(weight.detach().clone())
            blocks = []
            for g in self.factors.groups[kind]:
                r = next(ranks)
                blocks.append(g.up[:, :r].to(torch.float64) @ g.down[:r].to(torch.float64))
            weight.data.copy_(torch.cat(blocks).to(weight.device, weight.dtype))

    def __exit__(self, *exc) -> None:
        for proj, saved in zip(self.projections, self.saved, strict=True):
            proj.weight.data.copy_(saved)
