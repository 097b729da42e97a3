"""The lorc allocator (LoRC): progressive by cumulative condition number, Algorithm 1's skip rule."""

from __future__ import annotations

import math

import pytest
import torch

from lrkv_core.allocation import allocate_ranks, plan_from_summaries, summarize_layer
from lrkv_core.conversion.convert import model_layer_weights
from lrkv_core.decompositions import decompose_layer
from lrkv_core.statistics import collect_attention_gram, collect_gram, collect_output_fisher
from tests.support.spectra import (
    GROUP_SIZE,
    HEAD_DIM,
    N_LAYERS,
    WIDTH,
    allocate,
    spectral_condition,
    synthetic_inputs,
)


def test_lorc_is_progressive_and_solves_d_min() -> None:
    gen = torch.Generator().manual_seed(5)
    spectra = [
        {kind: [torch.rand(WIDTH, generator=gen, dtype=torch.float64).sort(descending=True).values + 0.01] * 2
         for kind in "kv"}
        for _ in range(6)
    ]  # fmt: skip
    kw = dict(group_size=GROUP_SIZE, head_dim=HEAD_DIM, rank_multiple=1, allocator="lorc")
    kw["features"] = {"weight_condition": spectral_condition(spectra)}
    plan = allocate_ranks(spectra, ratio=0.6, **kw)
    per_layer = [plan.ranks["k"][layer][0] for layer in range(6)]
    assert per_layer == sorted(per_layer, reverse=True) and per_layer[0] == WIDTH  # shallow layers keep more
    flat_k, flat_v = (sum(plan.ranks[kind], []) for kind in "kv")
    assert all(abs(a - b) <= 1 for a, b in zip(flat_k, flat_v))  # one fraction per layer, ± a leftover step
    assert 0 < plan.details["d_min"] < 1 and plan.details["d_max"] == 1
    cum = plan.details["log_cumulative_condition"]
    assert cum == sorted(cum, reverse=True) and cum[-1] == pytest.approx(plan.details["log_condition"][-1])
    low = allocate_ranks(spectra, ratio=0.2, **kw)  # below what d_min = 0 allows: d_max is lowered instead
    assert low.details["d_min"] == 0 and 0 < low.details["d_max"] < 1
    assert low.budget_width - low.kept < 1


def test_lorc_skip_threshold_keeps_the_layers_above_it_in_cumulative_condition_at_full_rank() -> None:
    """LoRC's Algorithm 1: layers whose cumulative κ̃_l exceeds the threshold (the shallow, sensitive ones)
    are not compressed; the others follow Eq. 13, normalised over all layers (hand-worked below)."""
    log_kappa = [(1.0, 2.0), (0.5, 0.5), (3.0, 1.0), (2.0, 2.0)]  # log κ̃ = 12, 9, 8, 4
    condition = [{"k": [k] * 2, "v": [v] * 2} for k, v in log_kappa]
    spectra = [{kind: [torch.ones(WIDTH, dtype=torch.float64)] * 2 for kind in "kv"} for _ in range(N_LAYERS)]
    kw = dict(
        group_size=GROUP_SIZE, head_dim=HEAD_DIM, rank_multiple=8, features={"weight_condition": condition}
    )
    lorc = {"name": "lorc", "skip_threshold": math.exp(8.5)}
    plan = allocate_ranks(spectra, ratio=0.7, allocator=lorc, **kw)
    assert plan.details["skipped_layers"] == [0, 1]  # κ̃ = e^12 and e^9 exceed e^8.5
    for layer in (0, 1):
        assert plan.ranks["k"][layer] == plan.ranks["v"][layer] == [WIDTH, WIDTH]
    assert plan.budget_width - plan.kept < 8
    assert all(r < WIDTH for r in plan.ranks["k"][3]) and plan.ranks["k"][2][0] >= plan.ranks["k"][3][0]
    # Eq. 13 over all four layers: n = (log κ̃ − 4) / (12 − 4) gives 0.5 for layer 2 and 0 for layer 3
    d_min = plan.details["d_min"]
    for layer, n in ((2, 0.5), (3, 0.0)):
        target = (d_min + (1 - d_min) * n) * WIDTH
        assert all(
            math.floor(target / 8) * 8 <= r <= math.floor(target / 8) * 8 + 8 for r in plan.ranks["k"][layer]
        )
    # normalised over the compressed layers only (4 … 8), layer 2 would keep full rank: it does not
    assert all(r < WIDTH for r in plan.ranks["k"][2])
    no_skip = allocate_ranks(spectra, ratio=0.7, allocator="lorc", **kw)
    assert no_skip.details["skipped_layers"] == [] and no_skip.ranks != plan.ranks
    with pytest.raises(ValueError, match=r"keeps layers \[0, 1, 2\] at full rank"):
        allocate_ranks(spectra, ratio=0.5, allocator={"name": "lorc", "skip_threshold": math.exp(5.0)}, **kw)


def test_lorc_uniform_schedule_skips_the_same_layers_and_cuts_the_others_alike() -> None:
    """The paper's baseline: the layers over the threshold kept at full rank, every other layer at one
    fraction (hand-worked: two of four layers kept, 0.7 of the width leaves 0.4 for each of the others)."""
    log_kappa = [(1.0, 2.0), (0.5, 0.5), (3.0, 1.0), (2.0, 2.0)]  # log κ̃ = 12, 9, 8, 4
    condition = [{"k": [k] * 2, "v": [v] * 2} for k, v in log_kappa]
    spectra = [{kind: [torch.ones(WIDTH, dtype=torch.float64)] * 2 for kind in "kv"} for _ in range(N_LAYERS)]
    kw = dict(
        group_size=GROUP_SIZE, head_dim=HEAD_DIM, rank_multiple=1, features={"weight_condition": condition}
    )
    uniform = {"name": "lorc", "skip_threshold": math.exp(8.5), "schedule": "uniform"}
    plan = allocate_ranks(spectra, ratio=0.7, allocator=uniform, **kw)
    assert plan.details["skipped_layers"] == [0, 1]
    assert plan.details["d_min"] == pytest.approx(0.4, abs=1 / WIDTH)
    for kind in "kv":
        assert plan.ranks[kind][0] == plan.ranks[kind][1] == [WIDTH, WIDTH]
        kept = [r for layer in (2, 3) for r in plan.ranks[kind][layer]]
        assert max(kept) - min(kept) <= 1 and abs(sum(kept) - 4 * 0.4 * WIDTH) <= 2
    progressive = allocate_ranks(spectra, ratio=0.7, allocator={**uniform, "schedule": "progressive"}, **kw)
    assert progressive.details["skipped_layers"] == [0, 1]
    assert progressive.ranks["k"][2][0] > progressive.ranks["k"][3][0] + 8  # Eq. 13 cuts layer 3 harder
    with pytest.raises(ValueError, match="lorc schedule must be one of"):
        allocate_ranks(spectra, ratio=0.7, allocator={"name": "lorc", "schedule": "flat"}, **kw)


def test_lorc_follows_the_progressive_rule_in_closed_form() -> None:
    """Given κ per layer, rank = ⌊(d_min + (1 − d_min)·n_l)·width⌋ (multiple 1), n_l = normalised log κ̃_l."""
    log_kappa = [(1.0, 2.0), (0.5, 0.5), (3.0, 1.0), (2.0, 2.0)]  # (K, V) per layer: κ_l = e^{sum}
    condition = [{"k": [k] * 2, "v": [v] * 2} for k, v in log_kappa]
    spectra = synthetic_inputs()["spectra"]  # κ comes from the weights' condition numbers, not the spectra
    plan = allocate_ranks(
        spectra, ratio=0.6, group_size=GROUP_SIZE, head_dim=HEAD_DIM, rank_multiple=1, allocator="lorc",
        features={"weight_condition": condition},
    )  # fmt: skip
    per_layer = [k + v for k, v in log_kappa]
    cumulative = [sum(per_layer[layer:]) for layer in range(N_LAYERS)]  # 12, 9, 8, 4
    assert (
        plan.details["log_condition"] == per_layer and plan.details["log_cumulative_condition"] == cumulative
    )
    norm = [(c - min(cumulative)) / (max(cumulative) - min(cumulative)) for c in cumulative]
    d_min = plan.details["d_min"]
    for layer in range(N_LAYERS):
        for kind in "kv":
            for r, sigma in zip(plan.ranks[kind][layer], spectra[layer][kind]):
                target = (d_min + (1 - d_min) * norm[layer]) * sigma.numel()
                assert math.floor(target) <= r <= math.floor(target) + 1  # + at most one leftover step
    assert plan.budget_width - plan.kept < 1
    short = synthetic_inputs()
    short["features"]["weight_condition"] = condition[:3]
    with pytest.raises(
        ValueError, match="feature 'weight_condition' does not match the spectra: no entry for layer 3"
    ):
        allocate("lorc", 0.6, 1, short)


def test_lorc_reads_the_weights_condition_numbers_whatever_the_decomposition(make_tiny, one_thread) -> None:
    """LoRC is data-free: κ comes from W_k and W_v themselves, so every decomposition gets the same plan."""
    model = make_tiny("llama", 2)  # L=2, Hkv=2, D=8, d=32
    rows = torch.randint(3, 61, (8, 16), generator=torch.Generator().manual_seed(0))
    grams, mixed = collect_gram(model, rows)[0], collect_attention_gram(model, rows)[0]
    fisher = collect_output_fisher(model, rows)[0]
    plans = {}
    for method in ("plain", "whitened", "pca"):
        summaries = []
        for i in range(2):
            kw = dict(n_kv_heads=2, head_dim=8, group_size=1, decomposition=method)
            stats = {"gram": grams[i], "attention_gram": mixed[i], "output_fisher": fisher[i]}
            factors = decompose_layer(i, model_layer_weights(model, i, reads=("o",)), stats, **kw)
            summaries.append(summarize_layer(factors, features=["weight_condition"]))
        expected = []
        for layer in model.model.layers:
            attn = layer.self_attn
            expected.append({
                kind: math.log(float(s.max() / s.min()))
                for kind, s in (("k", torch.linalg.svdvals(attn.k_proj.weight.detach().double())),
                                ("v", torch.linalg.svdvals(attn.v_proj.weight.detach().double())))
            })  # fmt: skip
        for summary, e in zip(summaries, expected):
            got = {kind: summary.features["weight_condition"][kind][0] for kind in "kv"}
            assert got == pytest.approx(e, rel=1e-9)
        plans[method] = plan_from_summaries(
            summaries, ratio=0.5, group_size=1, head_dim=8, rank_multiple=1, allocator="lorc"
        )
        assert plans[method].details["log_condition"] == pytest.approx([e["k"] + e["v"] for e in expected])
    assert plans["plain"].ranks == plans["whitened"].ranks == plans["pca"].ranks
