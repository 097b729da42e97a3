"""Synthetic rank problems for the allocator tests: spectra, Fisher sums, error curves, condition numbers."""

from __future__ import annotations

import torch

from lrkv_core.allocation import RankPlan, allocate_ranks
from lrkv_core.allocation.features import log_condition

N_LAYERS, HKV, HEAD_DIM, GROUP_SIZE = 4, 4, 32, 2
WIDTH = GROUP_SIZE * HEAD_DIM  # 64
SHORT_LAYER, SHORT_RANK = 1, 56  # d < s·D: this layer's groups have only 56 directions (partial last steps)


def spectral_condition(spectra: list[dict]) -> list[dict]:
    """``weight_condition`` per group: the largest log σ_max/σ_min over the groups of each layer's K or V."""
    return [
        {kind: [max(log_condition(s) for s in layer[kind])] * len(layer[kind]) for kind in "kv"}
        for layer in spectra
    ]


def synthetic_inputs(seed: int = 0) -> dict:
    """Synthetic spectra (geometric decay, a rate per group), Fisher sums, Fisher-weighted error curves and
    condition numbers (read off the spectra), laid out as allocation features."""
    gen = torch.Generator().manual_seed(seed)
    spectra, sensitivity, curves = [], [], []
    for layer in range(N_LAYERS):
        n = SHORT_RANK if layer == SHORT_LAYER else WIDTH
        entry, sens, curve = {}, {}, {}
        for kind in "kv":
            entry[kind], sens[kind], curve[kind] = [], [], []
            for _ in range(HKV // GROUP_SIZE):
                rate = 0.02 + 0.2 * torch.rand((), generator=gen, dtype=torch.float64)
                sigma = torch.exp(-rate * torch.arange(n, dtype=torch.float64))
                f = float(10 ** (2 * torch.rand((), generator=gen) - 1))
                tail = torch.cat([(sigma**2).flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])
                entry[kind].append(sigma)
                sens[kind].append(f)
                curve[kind].append(f * tail)
        spectra.append(entry)
        sensitivity.append(sens)
        curves.append(curve)
    features = {
        "fisher_sums": sensitivity,
        "fisher_rms": sensitivity,  # the fisher allocator reads either score: any positive values do
        "error_curves": curves,
        "kl_curves": curves,  # any (max_rank + 1,) curve per group: kl minimises them as fisher-greedy does
        "weight_condition": spectral_condition(spectra),
        "layer_errors": layer_error_curves(spectra, gen),
    }
    return {"spectra": spectra, "features": features}


def layer_error_curves(spectra: list[dict], gen: torch.Generator) -> list[dict]:
    """A decoder-layer output-error curve per layer (ε = 1 … 0 in steps of 0.02, error ``c_l (1 − ε)²`` with
    a scale per layer), carried by every group of the layer as the ``layer_errors`` feature."""
    eps = torch.linspace(1.0, 0.0, 51, dtype=torch.float64)
    out = []
    for entry in spectra:
        curve = torch.stack([eps, float(10 ** (2 * torch.rand((), generator=gen) - 1)) * (1 - eps) ** 2])
        out.append({kind: [curve] * len(entry[kind]) for kind in "kv"})
    return out


def allocate(allocator, ratio: float, multiple: int, inputs: dict | None = None) -> RankPlan:
    inputs = inputs or synthetic_inputs()
    return allocate_ranks(
        inputs["spectra"],
        ratio=ratio,
        group_size=GROUP_SIZE,
        head_dim=HEAD_DIM,
        rank_multiple=multiple,
        allocator=allocator,
        features=inputs["features"],
    )


def flat(plan: RankPlan) -> list[int]:
    return [r for layer in range(len(plan.ranks["k"])) for kind in "kv" for r in plan.ranks[kind][layer]]


def caps(inputs: dict) -> list[int]:
    return [s.numel() for layer in inputs["spectra"] for kind in "kv" for s in layer[kind]]
