"""Per-layer summaries: the spectra and the per-group features allocators read, a small artifact of its own.

Rank planning never loads factors: each layer's full-spectrum factors are summarised once into a
:class:`LayerSummary` (its groups' spectra plus the features the chosen allocator ``needs``), and the
plan is made from the summaries alone. A feature is computed per layer from the layer's factors and the
calibration statistics it declares (:data:`FEATURES`):

- ``weight_condition``: ``log κ`` of the layer's whole k_proj / v_proj weight (LoRC), rebuilt from the
  full-rank factors, so it is data-free whatever the decomposition;
- ``fisher_rms``: the mean over each group's rows of the RMS gradient ``√F`` (Palu's group score);
- ``fisher_sums``: the Fisher information summed over each group's rows;
- ``error_curves``: the Fisher-weighted truncation error ``E(r) = Σ F ⊙ (W − B_r A_r)²`` at every rank;
- ``kl_curves``: the model's measured second-order KL when the group alone is cut to each rank (the
  ``kl_response`` statistic, which reads the factors: :mod:`lrkv_core.statistics.response`).

A new feature is one :class:`Feature` entry (``register_feature``) wherever the allocator that needs it lives.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..decompositions import KINDS, LayerFactors
from ..linalg import GroupFactors
from ..system.files import save_tensors

# smallest σ_min/σ_max used for condition numbers: a rank-deficient matrix has κ = 1e12, not inf
KAPPA_FLOOR = 1e-12

PerKind = dict[str, list[Any]]  # kind -> one value per group of the layer


@dataclass(frozen=True)
class Feature:
    """A per-group quantity an allocator may read, computed per layer."""

    name: str
    statistics: frozenset[str]  # calibration statistics it reads ("fisher", ...)
    compute: Callable[[LayerFactors, Mapping[str, Any]], PerKind]  # (factors, the layer's statistics)


FEATURES: dict[str, Feature] = {}


def register_feature(feature: Feature) -> Feature:
    """Make a feature available to allocators that name it in ``needs``."""
    FEATURES[feature.name] = feature
    return feature


def log_condition(sigma: torch.Tensor) -> float:
    """``log σ_max/σ_min`` of a spectrum, with σ_min floored at ``KAPPA_FLOOR · σ_max`` (0 for a zero one)."""
    top = float(sigma.abs().max())
    low = max(float(sigma.abs().min()), KAPPA_FLOOR * top)
    return math.log(top / low) if top > 0 else 0.0


def _weight_condition(factors: LayerFactors, stats: Mapping[str, Any]) -> PerKind:
    """At full rank every group's ``up @ down`` is its slice of the weight, so stacking them gives W back."""
    out = {}
    for kind in KINDS:
        weight = torch.cat([g.up.double() @ g.down.double() for g in factors.groups[kind]])  # (Hkv·D, d)
        value = log_condition(torch.linalg.svdvals(weight))
        out[kind] = [value] * len(factors.groups[kind])
    return out


def _group_blocks(factors: LayerFactors, fisher: Mapping[str, torch.Tensor], kind: str) -> list[torch.Tensor]:
    """Each group's rows (s·D, d) of the layer's per-element Fisher for ``kind``."""
    width = factors.groups[kind][0].up.shape[0]
    return group_rows(fisher[kind], width)


def group_rows(fisher: torch.Tensor, group_width: int) -> list[torch.Tensor]:
    """Split a (Hkv·D, d) per-element Fisher into its groups' (s·D, d) row blocks."""
    if fisher.shape[0] % group_width:
        raise ValueError(
            f"Fisher has {fisher.shape[0]} rows, not a multiple of the group width {group_width}"
        )
    return list(fisher.split(group_width))


def fisher_group_sums(fisher: Mapping[str, torch.Tensor], group_width: int) -> PerKind:
    """Palu's group sensitivity: the Fisher of k_proj / v_proj summed over each group's rows."""
    return {kind: [float(b.double().sum()) for b in group_rows(fisher[kind], group_width)] for kind in KINDS}


def fisher_group_rms(fisher: Mapping[str, torch.Tensor], group_width: int) -> PerKind:
    """Palu's group score: the mean over each group's weight elements of the RMS gradient ``√F``."""
    return {
        kind: [float(b.double().sqrt().mean()) for b in group_rows(fisher[kind], group_width)]
        for kind in KINDS
    }


def _fisher_sums(factors: LayerFactors, stats: Mapping[str, Any]) -> PerKind:
    return fisher_group_sums(stats["fisher"], factors.groups["k"][0].up.shape[0])


def _fisher_rms(factors: LayerFactors, stats: Mapping[str, Any]) -> PerKind:
    return fisher_group_rms(stats["fisher"], factors.groups["k"][0].up.shape[0])


@torch.no_grad()
def weighted_error_curve(factors: GroupFactors, fisher: torch.Tensor) -> torch.Tensor:
    """Fisher-weighted truncation error ``E(r) = Σ F ⊙ (W − B_r A_r)²`` of one group, at every rank r.

    ``W = B A`` is the full-rank product of the factors (the original weight up to float64 rounding), so
    ``W − B_r A_r = B_{r:} A_{r:}`` and E(max rank) = 0. E need not decrease with r: F weights elements,
    not directions.

    Parameters
    ----------
    factors : the group's full-spectrum factors, ``up`` (s·D, m), ``down`` (m, d).
    fisher : (s·D, d) the group's rows of the per-element Fisher.

    Returns
    -------
    (m + 1,) float64, ``E[r]``.
    """
    up, down = factors.up.to(torch.float64), factors.down.to(torch.float64)
    weight = fisher.to(device=up.device, dtype=torch.float64)
    if weight.shape != (up.shape[0], down.shape[1]):
        raise ValueError(
            f"Fisher block {tuple(weight.shape)} does not match the group {(up.shape[0], down.shape[1])}"
        )
    m = factors.max_rank
    curve = torch.zeros(m + 1, dtype=torch.float64)
    residual = torch.zeros_like(weight)  # B_{r:} A_{r:}, grown from the tail
    for r in range(m - 1, -1, -1):
        residual += up[:, r : r + 1] @ down[r : r + 1]  # (s·D, d)
        curve[r] = float((weight * residual.square()).sum())
    return curve


def _error_curves(factors: LayerFactors, stats: Mapping[str, Any]) -> PerKind:
    return {
        kind: [
            weighted_error_curve(g, block)
            for g, block in zip(
                factors.groups[kind], _group_blocks(factors, stats["fisher"], kind), strict=True
            )
        ]
        for kind in KINDS
    }


def _kl_curves(factors: LayerFactors, stats: Mapping[str, Any]) -> PerKind:
    out = {}
    for kind in KINDS:
        curves, groups = stats["kl_response"][kind], factors.groups[kind]
        if curves.shape != (len(groups), groups[0].max_rank + 1):
            raise ValueError(
                f"kl_response of layer {factors.layer} {kind} has shape {tuple(curves.shape)}, not "
                f"{(len(groups), groups[0].max_rank + 1)}: it was collected from other factors"
            )
        out[kind] = [curve.to(torch.float64) for curve in curves]
    return out


register_feature(Feature("weight_condition", frozenset(), _weight_condition))
register_feature(Feature("fisher_sums", frozenset({"fisher"}), _fisher_sums))
register_feature(Feature("fisher_rms", frozenset({"fisher"}), _fisher_rms))
register_feature(Feature("error_curves", frozenset({"fisher"}), _error_curves))
register_feature(Feature("kl_curves", frozenset({"kl_response"}), _kl_curves))


def statistics_for(features: Iterable[str]) -> frozenset[str]:
    """The calibration statistics the named features read."""
    out: set[str] = set()
    for name in features:
        if name not in FEATURES:
            raise ValueError(f"unknown feature {name!r}; known: {', '.join(FEATURES)}")
        out |= FEATURES[name].statistics
    return frozenset(out)


@dataclass
class LayerSummary:
    """What rank planning knows of one layer: its groups' spectra and the requested features."""

    layer: int
    spectra: dict[str, list[torch.Tensor]]  # kind -> (max_rank,) per group
    features: dict[str, PerKind] = field(default_factory=dict)  # name -> kind -> value per group

    def save(self, path: str | Path) -> None:
        """Safetensors: spectra and tensor-valued features as tensors, float features in the metadata."""
        tensors, scalars = {}, {}
        for kind in KINDS:
            for g, sigma in enumerate(self.spectra[kind]):
                tensors[f"spectra.{kind}.{g}"] = sigma.detach().to(torch.float64).contiguous()
        for name, per_kind in self.features.items():
            for kind in KINDS:
                for g, value in enumerate(per_kind[kind]):
                    if isinstance(value, torch.Tensor):
                        tensors[f"feature.{name}.{kind}.{g}"] = value.detach().to(torch.float64).contiguous()
                    else:
                        scalars.setdefault(name, {}).setdefault(kind, []).append(float(value))
        meta = {"layer": self.layer, "groups": len(self.spectra["k"]), "features": sorted(self.features)}
        save_tensors(
            tensors, str(path), metadata={"lrkv_summary": json.dumps(meta), "scalars": json.dumps(scalars)}
        )

    @classmethod
    def load(cls, path: str | Path) -> LayerSummary:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["lrkv_summary"])
            scalars = json.loads(f.metadata()["scalars"])
            n = meta["groups"]
            spectra = {kind: [f.get_tensor(f"spectra.{kind}.{g}") for g in range(n)] for kind in KINDS}
            features = {
                name: scalars[name]
                if name in scalars
                else {kind: [f.get_tensor(f"feature.{name}.{kind}.{g}") for g in range(n)] for kind in KINDS}
                for name in meta["features"]
            }
        return cls(meta["layer"], spectra, features)


def summarize_layer(
    factors: LayerFactors, stats: Mapping[str, Any] | None = None, features: Iterable[str] = ()
) -> LayerSummary:
    """The layer's spectra plus the named features, computed from its factors and statistics.

    Parameters
    ----------
    factors : the layer's full-spectrum factors.
    stats : the layer's calibration statistics by name (e.g. ``{"fisher": {"k": F_k, "v": F_v}}``).
    features : names of :data:`FEATURES`.
    """
    stats = stats or {}
    names = sorted(set(features))
    missing = sorted(statistics_for(names) - set(stats))
    if missing:
        raise ValueError(f"features {names} need the calibration statistic(s) {missing}")
    computed = {name: FEATURES[name].compute(factors, stats) for name in names}
    return LayerSummary(factors.layer, factors.spectra(), computed)
