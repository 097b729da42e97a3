"""Rank plans: how many latent dimensions each (layer, K/V, group) keeps.

Budget = kept fraction of the KV width, ``Σ r / (2·L·Hkv·D)``. Ranks are rounded to a multiple so the
latents map to efficient matmul shapes; the achieved ratio after rounding is reported next to the target:
never above it, and less than one rounding step (in total kept width) below it. The allocators and the
shared rounding rule live in :mod:`lrkv_core.allocators`; this module holds the plan artifact and the one
entry point, :func:`allocate_ranks`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .allocators import (
    ALLOCATORS,
    KINDS,
    ErrorCurves,
    RankProblem,
    Ranks,
    Sensitivity,
    Spectra,
    WeightCondition,
    log_condition,
    needs_fisher,
    round_rank,
    run_allocator,
)
from .decompose import LayerFactors
from .fisher import FisherInfo, fisher_error_curves, group_sensitivity

__all__ = [
    "ALLOCATORS",
    "RankPlan",
    "allocate_ranks",
    "needs_fisher",
    "plan_from_factors",
    "round_rank",
    "weight_log_condition",
]


@dataclass
class RankPlan:
    """Ranks per layer, per K/V, per group, with the budget they were chosen for."""

    allocator: str
    group_size: int
    group_width: int  # s·D
    rank_multiple: int
    target_ratio: float
    ranks: Ranks  # {"k": [[r_g for g] for layer], "v": ...}
    details: dict[str, Any] = field(default_factory=dict)  # what the allocator solved for (ε, d_min, λ, ...)

    @property
    def full_width(self) -> int:
        n = sum(len(groups) for groups in self.ranks["k"])
        return 2 * n * self.group_width

    @property
    def kept(self) -> int:
        return sum(r for kind in ("k", "v") for layer in self.ranks[kind] for r in layer)

    @property
    def budget_width(self) -> int:
        """⌊target ratio · full width⌋: the kept width the plan may use."""
        return int(math.floor(self.target_ratio * self.full_width + 1e-9))

    @property
    def achieved_ratio(self) -> float:
        return self.kept / self.full_width

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "achieved_ratio": self.achieved_ratio,
            "full_width": self.full_width,
            "budget_width": self.budget_width,
            "kept": self.kept,
        }

    @classmethod
    def from_dict(cls, d: dict) -> RankPlan:
        fields = ("allocator", "group_size", "group_width", "rank_multiple", "target_ratio", "ranks")
        return cls(**{k: d[k] for k in fields}, details=d.get("details", {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> RankPlan:
        return cls.from_dict(json.loads(Path(path).read_text()))


def allocate_ranks(
    spectra: Spectra,
    *,
    ratio: float,
    group_size: int,
    head_dim: int,
    rank_multiple: int = 8,
    allocator: str = "uniform",
    sensitivity: Sensitivity | None = None,
    error_curves: ErrorCurves | None = None,
    weight_condition: WeightCondition | None = None,
    options: Mapping[str, Any] | None = None,
) -> RankPlan:
    """Choose ranks for every group so that the kept KV width is at most ``ratio`` of the original.

    Parameters
    ----------
    spectra : ``spectra[layer][kind][g]``: (max_rank,) singular values of each group, most important first
        (:meth:`lrkv_core.decompose.LayerFactors.spectra`).
    ratio : target kept fraction of the KV width, in (0, 1].
    group_size, head_dim : s and D; a group is s·D wide in the uncompressed cache.
    rank_multiple : ranks are multiples of this (or a group's max rank ``min(s·D, d)``).
    allocator : a key of :data:`ALLOCATORS`.
    sensitivity : ``sensitivity[layer][kind][g]`` Fisher sums, needed by ``fisher``
        (:func:`lrkv_core.fisher.group_sensitivity`).
    error_curves : ``error_curves[layer][kind][g]`` (max_rank + 1,) Fisher-weighted truncation errors, needed
        by ``fisher-greedy`` (:func:`lrkv_core.fisher.fisher_error_curves`).
    weight_condition : ``weight_condition[layer][kind]`` log condition numbers of the k_proj/v_proj weights,
        used by ``lorc`` (:func:`weight_log_condition`); without them it reads κ off the spectra.
    options : allocator options, e.g. ``{"skip_threshold": 50.0}`` for ``lorc``.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if rank_multiple < 1:
        raise ValueError(f"rank multiple must be ≥ 1, got {rank_multiple}")
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator!r}; choose from {sorted(ALLOCATORS)}")
    width = group_size * head_dim
    problem = RankProblem(
        spectra,
        group_width=width,
        ratio=ratio,
        rank_multiple=rank_multiple,
        sensitivity=sensitivity,
        error_curves=error_curves,
        weight_condition=weight_condition,
    )
    flat, details = run_allocator(problem, allocator, options)
    plan = RankPlan(allocator, group_size, width, rank_multiple, ratio, problem.nest(flat), details)
    if plan.achieved_ratio > ratio + 1e-9:
        raise AssertionError(f"allocator {allocator} exceeded the budget: {plan.achieved_ratio} > {ratio}")
    return plan


def plan_from_factors(
    factors: list[LayerFactors],
    *,
    ratio: float,
    rank_multiple: int = 8,
    allocator: str = "uniform",
    fisher: FisherInfo | None = None,
    options: Mapping[str, Any] | None = None,
) -> RankPlan:
    """:func:`allocate_ranks` from the layers' factors, deriving what the allocator needs from the Fisher.

    Parameters
    ----------
    factors : every layer's full-spectrum factors (:func:`lrkv_core.decompose.decompose_layer`), in order.
    fisher : the per-element Fisher (:func:`lrkv_core.fisher.collect_fisher`); required by ``fisher`` (group
        sums) and ``fisher-greedy`` (Fisher-weighted error curves on the plan's rank grid).
    """
    if not factors:
        raise ValueError("no layer factors to plan from")
    group_size = factors[0].group_size
    group_width = factors[0].groups["k"][0].up.shape[0]
    entry = ALLOCATORS.get(allocator)
    needs, uses = (entry.needs, entry.uses) if entry else ((), ())
    sensitivity = curves = None
    if fisher is not None and "sensitivity" in needs:
        sensitivity = group_sensitivity(fisher, group_width)
    if fisher is not None and "error_curves" in needs:
        curves = fisher_error_curves(factors, fisher, rank_multiple=rank_multiple)
    return allocate_ranks(
        [f.spectra() for f in factors],
        ratio=ratio,
        group_size=group_size,
        head_dim=group_width // group_size,
        rank_multiple=rank_multiple,
        allocator=allocator,
        sensitivity=sensitivity,
        error_curves=curves,
        weight_condition=weight_log_condition(factors) if "weight_condition" in uses else None,
        options=options,
    )


def weight_log_condition(factors: list[LayerFactors]) -> WeightCondition:
    """``log κ`` of each layer's whole k_proj and v_proj weight, rebuilt from its full-spectrum factors.

    At full rank every group's ``up @ down`` is its slice of the weight (any decomposition), so stacking the
    groups gives back ``W_k`` / ``W_v`` (Hkv·D, d) and LoRC's condition numbers need no model.
    """
    out = []
    for f in factors:
        entry = {}
        for kind in KINDS:
            weight = torch.cat([g.up.double() @ g.down.double() for g in f.groups[kind]])
            entry[kind] = log_condition(torch.linalg.svdvals(weight))
        out.append(entry)
    return out
