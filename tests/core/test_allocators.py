"""Rank allocators: the budget rule, monotonicity in sensitivity, determinism, each method's own property."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lrkv_core.allocation import (
    ALLOCATORS,
    RankPlan,
    RankProblem,
    allocate_ranks,
    fit_to_budget,
    plan_from_summaries,
    relative_errors,
    statistics_for,
)
from lrkv_core.conversion.convert import CompressionConfig, decompose_model, plan_conversion
from lrkv_core.evaluation.metrics import kv_bytes_per_token
from lrkv_core.statistics import STATISTICS, collect_fisher, collect_gram
from tests.support.spectra import (
    GROUP_SIZE,
    HEAD_DIM,
    HKV,
    N_LAYERS,
    WIDTH,
    allocate,
    caps,
    flat,
    spectral_condition,
    synthetic_inputs,
)

MULTIPLES = (1, 8, 16, 32)
RATIOS = (0.2, 0.35, 0.5, 0.7, 0.9, 1.0)


@pytest.mark.parametrize("allocator", sorted(ALLOCATORS.names()))
@pytest.mark.parametrize("multiple", MULTIPLES)
def test_every_allocator_meets_the_budget_within_one_rounding_step(allocator: str, multiple: int) -> None:
    inputs = synthetic_inputs()
    group_caps = caps(inputs)
    full = 2 * N_LAYERS * HKV * HEAD_DIM
    for ratio in RATIOS:
        budget = math.floor(ratio * full + 1e-9)
        if sum(min(multiple, c) for c in group_caps) > budget:  # one step per group does not fit
            with pytest.raises(ValueError, match="leaves rank 0"):
                allocate(allocator, ratio, multiple, inputs)
            continue
        plan = allocate(allocator, ratio, multiple, inputs)
        ranks = flat(plan)
        assert plan.full_width == full and plan.budget_width == budget
        assert plan.kept == sum(ranks) <= budget
        assert plan.achieved_ratio == sum(ranks) / (2 * N_LAYERS * HKV * HEAD_DIM) <= ratio
        all_full = ranks == group_caps
        assert budget - plan.kept < multiple or all_full, (ratio, budget, plan.kept)
        for r, cap in zip(ranks, group_caps, strict=True):
            assert min(multiple, cap) <= r <= cap and (r % multiple == 0 or r == cap)


@pytest.mark.parametrize("allocator", sorted(ALLOCATORS.names()))
def test_allocation_is_deterministic(allocator: str, tmp_path) -> None:
    method = allocator
    if allocator == "lorc":  # a threshold between the first two layers' cumulative log κ: layer 0 is skipped
        kappa = [
            sum(layer[kind][0] for kind in "kv")
            for layer in synthetic_inputs(3)["features"]["weight_condition"]
        ]
        method = {"name": "lorc", "skip_threshold": math.exp(sum(kappa) - kappa[0] / 2)}
    a = allocate(method, 0.45, 8, synthetic_inputs(3))
    b = allocate(method, 0.45, 8, synthetic_inputs(3))  # fresh tensors, same values
    assert a == b and a.allocator == ALLOCATORS.create(method).to_dict() and a.allocator["name"] == allocator
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert RankPlan.load(tmp_path / "a.json") == a  # details survive the JSON round trip


def _equal_spectra(sensitivity: list[float]) -> dict:
    """Every group has the same spectrum; only the Fisher sums differ. 2 layers × K/V × 2 groups."""
    sigma = torch.exp(-0.05 * torch.arange(WIDTH, dtype=torch.float64))
    it = iter(sensitivity)
    sens = [{kind: [next(it) for _ in range(2)] for kind in "kv"} for _ in range(2)]
    return {
        "spectra": [{kind: [sigma] * 2 for kind in "kv"} for _ in range(2)],
        "features": {"fisher_sums": sens},
    }


@pytest.mark.parametrize("multiple", MULTIPLES)
@pytest.mark.parametrize("ratio", (0.5, 0.62, 0.8))
def test_fisher_rank_is_monotone_in_the_fisher_score_up_to_one_step(multiple: int, ratio: float) -> None:
    """Palu's floors are monotone in the score; its leftover steps go by ascending deficit, so a group may
    end one step below a group with a lower score (never more)."""
    gen = torch.Generator().manual_seed(multiple)
    fisher = (10 ** (3 * torch.rand(8, generator=gen, dtype=torch.float64))).tolist()
    for allocator in (
        {"name": "fisher", "score": "sum"},
        {"name": "fisher", "leftover": "water-fill", "score": "sum"},
    ):
        kw = dict(
            ratio=ratio, group_size=GROUP_SIZE, head_dim=HEAD_DIM, rank_multiple=multiple, allocator=allocator
        )
        inputs = _equal_spectra(fisher)
        ranks = flat(allocate_ranks(inputs["spectra"], features=inputs["features"], **kw))
        step = max(multiple, 1)
        for a in range(8):
            for b in range(8):
                if fisher[a] > fisher[b]:
                    assert ranks[a] >= ranks[b] - step, (allocator, fisher, ranks)
        # holding the rest equal: raising one group's Fisher never lowers its rank by more than a step
        for j in range(8):
            raised = _equal_spectra([f * 4 if i == j else f for i, f in enumerate(fisher)])
            assert (
                flat(allocate_ranks(raised["spectra"], features=raised["features"], **kw))[j]
                >= ranks[j] - step
            )


def test_fisher_gives_palus_plan_for_given_scores_and_ratio() -> None:
    """Palu's rule by hand: 4 groups of width 16, scores 1, 1.5, 3.2, 10.3 (Σ 16), ratio 0.5: budget 32.

    Shares 32·f/16 = 2, 3, 6.4, 20.6 → floors 2, 3, 6, 16 (the last capped at its width) = 27; the 5 left go
    one at a time by ascending deficit (0, 0, 0.4; the capped group is skipped): +1, +1, +1, then +1, +1.
    """
    spectra = [{kind: [torch.ones(16, dtype=torch.float64)] * 2 for kind in "kv"}]
    scores = {"k": [1.0, 1.5], "v": [3.2, 10.3]}
    kw = dict(ratio=0.5, group_size=1, head_dim=16, rank_multiple=1)
    palu = allocate_ranks(spectra, allocator="fisher", features={"fisher_rms": [scores]}, **kw)
    assert palu.ranks == {"k": [[4, 5]], "v": [[7, 16]]} and palu.kept == 32
    assert palu.details["palu_ranks"] == [4, 5, 7, 16]
    # the same scores as Fisher sums give the same plan; lrkv 0.1's water-filling spends the capped group's
    # excess in proportion to the scores: λ = 16 / 5.7, targets 2.81, 4.21, 8.98, 16 → 2, 4, 8 + 2 left over
    as_sums = {"name": "fisher", "score": "sum"}
    assert (
        allocate_ranks(spectra, allocator=as_sums, features={"fisher_sums": [scores]}, **kw).ranks
        == palu.ranks
    )
    water = {"name": "fisher", "score": "sum", "leftover": "water-fill"}
    assert allocate_ranks(spectra, allocator=water, features={"fisher_sums": [scores]}, **kw).ranks == {
        "k": [[3, 4]],
        "v": [[9, 16]],
    }


@pytest.mark.parametrize("multiple", MULTIPLES)
@pytest.mark.parametrize("ratio", (0.5, 0.62, 0.8))
def test_eigen_gives_faster_decaying_layers_no_more_rank(multiple: int, ratio: float) -> None:
    rates = [0.15, 0.03, 0.3, 0.08]  # one decay rate per layer, shared by its K/V groups
    spectra = [
        {kind: [torch.exp(-rate * torch.arange(WIDTH, dtype=torch.float64))] * 2 for kind in "kv"}
        for rate in rates
    ]
    plan = allocate_ranks(
        spectra,
        ratio=ratio,
        group_size=GROUP_SIZE,
        head_dim=HEAD_DIM,
        rank_multiple=multiple,
        allocator={"name": "eigen", "rule": "global"},
    )
    per_layer = [plan.ranks["k"][layer] + plan.ranks["v"][layer] for layer in range(4)]
    for a in range(4):
        for b in range(4):
            if rates[a] > rates[b]:
                assert max(per_layer[a]) <= min(per_layer[b]), (rates, per_layer)
    eps = plan.details["epsilon"]
    for layer in range(len(rates)):  # every group meets the error budget it was given
        err = relative_errors(spectra[layer]["k"][0])
        assert all(err[r] <= eps for r in per_layer[layer])


def test_fisher_greedy_with_unit_fisher_keeps_the_globally_largest_singular_values() -> None:
    """Unit Fisher + plain SVD: the weighted error is Eckart–Young's tail, and greedy is optimal (convex)."""
    gen = torch.Generator().manual_seed(2)
    spectra, curves = [], []
    for _ in range(3):
        s = {kind: [torch.rand(WIDTH, generator=gen, dtype=torch.float64).sort(descending=True).values + 1
                    for _ in range(2)] for kind in "kv"}  # fmt: skip
        spectra.append(s)
        curves.append({k: [torch.cat([(x**2).flip(0).cumsum(0).flip(0), x.new_zeros(1)]) for x in v]
                       for k, v in s.items()})  # fmt: skip
    plan = allocate_ranks(
        spectra, ratio=0.4, group_size=GROUP_SIZE, head_dim=HEAD_DIM, rank_multiple=1,
        allocator="fisher-greedy", features={"error_curves": curves},
    )  # fmt: skip
    kept = sum(
        float((spectra[layer][kind][g][:r] ** 2).sum())
        for layer in range(3)
        for kind in "kv"
        for g, r in enumerate(plan.ranks[kind][layer])
    )
    everything = torch.cat([x for layer in spectra for kind in "kv" for x in layer[kind]]) ** 2
    assert kept == pytest.approx(float(everything.sort(descending=True).values[: plan.kept].sum()), rel=1e-12)
    total = sum(float(c[0]) for layer in curves for kind in "kv" for c in layer[kind])
    assert plan.details["weighted_error"] == pytest.approx(total - kept, rel=1e-9)


def test_allocators_that_need_fisher_say_so() -> None:
    spectra = synthetic_inputs()["spectra"]
    kw = dict(ratio=0.5, group_size=GROUP_SIZE, head_dim=HEAD_DIM, rank_multiple=8)
    needs_fisher = [
        n for n in sorted(ALLOCATORS.names()) if "fisher" in statistics_for(ALLOCATORS.create(n).needs)
    ]
    assert needs_fisher == ["fisher", "fisher-greedy"]
    for name in ("fisher", "fisher-greedy"):
        with pytest.raises(ValueError, match=f"allocator '{name}' needs the feature"):
            allocate_ranks(spectra, allocator=name, **kw)
    for name in ("uniform", {"name": "eigen", "rule": "global"}):
        assert allocate_ranks(spectra, allocator=name, **kw).kept <= 512
    with pytest.raises(ValueError, match=r"allocator 'eigen' needs the feature\(s\) \['layer_errors'\]"):
        allocate_ranks(spectra, allocator={"name": "eigen", "rule": "layerwise"}, **kw)
    condition = {"weight_condition": spectral_condition(spectra)}
    assert allocate_ranks(spectra, allocator="lorc", features=condition, **kw).kept <= 512
    with pytest.raises(ValueError, match=r"allocator 'eigen' has no option\(s\) \['skip_threshold'\]"):
        allocate_ranks(spectra, allocator={"name": "eigen", "skip_threshold": 2.0}, **kw)
    coarse = synthetic_inputs()
    for layer in coarse["features"]["error_curves"]:
        for kind in "kv":
            for c in layer[kind]:
                c[1::2] = float("nan")  # as if computed for rank multiple 2
    with pytest.raises(ValueError, match="lacks ranks on the grid of rank multiple 1"):
        allocate("fisher-greedy", 0.5, 1, coarse)
    assert allocate("fisher-greedy", 0.5, 8, coarse).budget_width - allocate("fisher-greedy", 0.5, 8).kept < 8


def test_at_full_rank_no_allocator_reads_features() -> None:
    """Ratio 1.0 keeps every group's max rank: no statistic is needed, whatever the allocator."""
    spectra = synthetic_inputs()["spectra"]
    kw = dict(ratio=1.0, group_size=GROUP_SIZE, head_dim=HEAD_DIM, rank_multiple=8)
    for name in sorted(ALLOCATORS.names()):
        plan = allocate_ranks(spectra, allocator=name, **kw)
        assert plan.ranks == {k: [[len(s) for s in layer[k]] for layer in spectra] for k in "kv"}, name
        assert plan.details == {"every_group_at_max_rank": True}
        needed = CompressionConfig(ratio=1.0, allocator=name).needed_statistics()
        # the decomposition's (whitened, values measured after the attention)
        assert needed == [STATISTICS.create(n) for n in ("attention_gram", "gram", "output_fisher")]
    assert "kl_response" in {s.name for s in CompressionConfig(ratio=0.99).needed_statistics()}


def test_factors_alone_collect_only_what_the_decomposition_reads(make_tiny, one_thread) -> None:
    """decompose_model gives plan_conversion's factors without the allocator's statistics."""
    model = make_tiny("llama", 2)
    rows = torch.randint(3, 61, (8, 16), generator=torch.Generator().manual_seed(0))
    config = CompressionConfig(ratio=0.5, group_size=1, rank_multiple=1, allocator="kl")
    factors, stats = decompose_model(model, rows, config)
    assert set(stats) == {"gram", "attention_gram", "output_fisher"}  # no kl_response: it only prices ranks
    planned = plan_conversion(model, rows, config, statistics=stats)
    assert "kl_response" in {s.name for s in config.needed_statistics()}  # what the plan collects
    assert planned.plan.achieved_ratio == 0.5
    for mine, theirs in zip(factors, planned.factors, strict=True):
        for kind in "kv":
            for a, b in zip(mine.groups[kind], theirs.groups[kind], strict=True):
                assert torch.equal(a.up, b.up) and torch.equal(a.down, b.down)
    assert decompose_model(model, None, CompressionConfig(decomposition="plain"))[1] == {}  # data-free


def _toy_problem(caps: list[int], multiple: int, ratio: float) -> RankProblem:
    spectra = [{"k": [torch.ones(c, dtype=torch.float64) for c in caps], "v": []}]
    return RankProblem(spectra, group_width=max(caps), ratio=ratio, rank_multiple=multiple)


def test_fit_to_budget_spends_leftover_on_the_largest_benefit_and_trims_the_smallest() -> None:
    problem = _toy_problem([16, 16, 16], multiple=4, ratio=0.5)  # budget 24
    targets = [9.5, 7.9, 6.6]

    def deficit(i: int, r: int) -> float:
        return targets[i] - r

    assert fit_to_budget(problem, [8, 4, 4], deficit) == [8, 8, 8]  # leftover 8: deficits 3.9 and 2.6 win
    over = fit_to_budget(problem, [16, 16, 16], deficit)  # over budget: the largest surplus goes first
    assert over == [8, 8, 8]
    assert fit_to_budget(problem, [4, 4, 4], lambda i, r: 0.0) == [16, 4, 4]  # ties favour the first group
    assert fit_to_budget(problem, [16, 16, 16], lambda i, r: 0.0) == [16, 4, 4]
    with pytest.raises(AssertionError, match="not an allowed rank"):
        fit_to_budget(problem, [5, 4, 4], deficit)


def test_partial_last_step_to_a_max_rank_off_the_grid() -> None:
    problem = _toy_problem([64, 56], multiple=32, ratio=1.0)  # grid: {32, 64} and {32, 56}
    assert problem.grid(1) == [32, 56] and problem.next_rank(1, 32) == 56 and problem.prev_rank(1, 56) == 32
    assert fit_to_budget(problem, [32, 32], lambda i, r: 1.0) == [64, 56]


def test_plans_from_a_tiny_model_are_what_the_cache_holds(make_tiny, one_thread) -> None:
    """End to end: Fisher + factors → every allocator's plan → compressed model whose cache holds Σ r."""
    model = make_tiny("llama", 2)  # L=2, Hkv=2, D=8, d=32
    rows = torch.randint(3, 61, (8, 16), generator=torch.Generator().manual_seed(0))
    grams, _ = collect_gram(model, rows)
    fisher, _ = collect_fisher(model, rows, batch_size=4)
    stats = {"gram": grams, "fisher": fisher}
    windows = rows[:2]
    for name in sorted(ALLOCATORS.names()):
        config = CompressionConfig(ratio=0.55, group_size=1, rank_multiple=1, allocator=name)
        conversion = plan_conversion(model, rows, config, statistics=stats)
        plan = conversion.plan
        assert plan.budget_width == 35 and plan.kept == 35 and plan.achieved_ratio == 35 / 64
        comp = conversion.apply(copy.deepcopy(model))
        got = kv_bytes_per_token(comp, windows, n_rows=2)
        assert (
            got["kv_bytes_per_token"] == plan.kept * 4 + 2 * 4
        )  # fp32 latents + an int32 position per layer
        with torch.no_grad():
            assert torch.isfinite(comp(windows).logits).all()
    config = CompressionConfig(ratio=0.5, group_size=1, rank_multiple=1, allocator="uniform")
    summaries = plan_conversion(model, rows, config, statistics=stats).summaries  # uniform: no features
    with pytest.raises(ValueError, match="'fisher-greedy' needs the feature"):
        plan_from_summaries(
            summaries, ratio=0.5, group_size=1, head_dim=8, rank_multiple=1, allocator="fisher-greedy"
        )
