"""``lorc`` (LoRC, Zhang et al. 2024): progressive allocation by cumulative condition numbers of K/V weights.

A layer's condition number is ``κ_l = κ(W_k,l) · κ(W_v,l)``, each of the layer's whole projection weight:
data-free, whatever the decomposition (the ``weight_condition`` feature rebuilds the weights from the
full-rank factors). The cumulative ``κ̃_l = Π_{j≥l} κ_j`` bounds how much an error made in layer l can be
amplified by the layers after it, so shallow layers keep more. Every layer's fraction of each group is LoRC's
Eq. 13, ``d_l = d_min + (d_max − d_min) · n_l`` with ``n_l`` the min-max normalised ``log κ̃_l`` over all
layers; following its Algorithm 1, layers whose cumulative ``κ̃_l`` exceeds ``skip_threshold`` (the shallow,
most sensitive ones; the paper uses 30 and 90 on its models) are then not compressed at all. ``d_max = 1``
(full rank) and ``d_min`` is solved by bisection so the budget is met; if even ``d_min = 0`` is too wide,
``d_min = 0`` and ``d_max`` is solved instead.

``schedule: uniform`` is the paper's baseline: the same layers skipped, every other layer at one fraction
solved for the budget (its appendix F.1: "the same refrained layers while applying the uniform compression
ratios across compressed layers").

The paper's thresholds (30 and 90) are values of κ̃ for its models and do not transfer: read as κ̃ itself,
they skip every layer of every model lrkv ships with, whose deepest layer alone has ``κ_l`` above 90 (e^5.0 on
SmolLM2-135M). ``skip_threshold`` is a value of κ̃ (``e^90`` reads 90 as a natural log of κ̃);
docs/allocation.md (LoRC's own rule) measures both schedules with skipped layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from .base import ALLOCATORS, Allocation, Allocator
from .problem import KINDS, RankProblem, bisect_to_budget, clamped_total, ranks_from_targets


def layer_log_condition(problem: RankProblem) -> list[float]:
    """``log κ_l = log κ(W_k,l) + log κ(W_v,l)`` per layer, from the ``weight_condition`` feature."""
    per_kind = {(spec.layer, spec.kind): spec.features["weight_condition"] for spec in problem.groups}
    return [sum(per_kind[(layer, kind)] for kind in KINDS) for layer in range(problem.n_layers)]


SCHEDULES = ("progressive", "uniform")


@ALLOCATORS.register
@dataclass(frozen=True)
class Lorc(Allocator):
    """progressive: shallow layers keep more, by the cumulative condition number of the K/V weights (LoRC)"""

    name: ClassVar[str] = "lorc"
    needs: ClassVar[frozenset[str]] = frozenset({"weight_condition"})
    # layers whose cumulative condition number κ̃_l exceeds this keep full rank (None: no layer is skipped)
    skip_threshold: float | None = None
    # progressive: Eq. 13 (LoRC); uniform: one fraction for every compressed layer (the paper's baseline)
    schedule: Literal["progressive", "uniform"] = "progressive"

    def __post_init__(self) -> None:
        if self.skip_threshold is not None and not self.skip_threshold > 0:
            raise ValueError(f"lorc skip_threshold must be > 0, got {self.skip_threshold}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"lorc schedule must be one of {SCHEDULES}, got {self.schedule!r}")

    def allocate(self, problem: RankProblem) -> Allocation:
        log_kappa = layer_log_condition(problem)
        cumulative = [sum(log_kappa[layer:]) for layer in range(problem.n_layers)]  # log κ̃_l
        limit = math.inf if self.skip_threshold is None else math.log(self.skip_threshold)
        skipped = [layer for layer, c in enumerate(cumulative) if c > limit]
        lo_c, hi_c = min(cumulative), max(cumulative)  # Eq. 13 normalises over all layers, skipped or not
        if self.schedule == "uniform":  # n_l = 0 everywhere: every compressed layer at d_min
            norm = [0.0] * problem.n_layers
        else:
            norm = [(c - lo_c) / (hi_c - lo_c) if hi_c > lo_c else 1.0 for c in cumulative]

        def fractions(theta: float) -> tuple[float, float]:
            """(d_min, d_max): θ ∈ [1, 2] moves d_min from 0 to 1 at d_max = 1; θ ∈ [0, 1] is d_max = θ."""
            return (theta - 1.0, 1.0) if theta >= 1 else (0.0, theta)

        def targets(theta: float) -> list[float]:
            d_min, d_max = fractions(theta)
            return [
                spec.max_rank
                if spec.layer in skipped
                else (d_min + (d_max - d_min) * norm[spec.layer]) * spec.max_rank
                for spec in problem.groups
            ]

        if clamped_total(problem, targets(0.0)) > problem.budget:
            raise ValueError(
                f"skip threshold {self.skip_threshold} keeps layers {skipped} at full rank, which alone "
                f"exceeds the budget of ratio {problem.ratio}; raise the ratio or the skip threshold"
            )
        theta = bisect_to_budget(lambda x: clamped_total(problem, targets(x)), 0.0, 2.0, problem.budget)
        d_min, d_max = fractions(theta)
        details = {
            "d_min": d_min,
            "d_max": d_max,
            "skipped_layers": skipped,
            "log_condition": log_kappa,
            "log_cumulative_condition": cumulative,
        }
        return ranks_from_targets(problem, targets(theta)), details
