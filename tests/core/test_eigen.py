"""The eigen allocator as Eigen Attention describes it: Eq. 5's energy threshold per group, and Algorithm 1's
per-layer threshold search on the decoder layer's output error (hand-worked), measured on a tiny model."""

from __future__ import annotations

import pytest
import torch

from lrkv_core.allocation import allocate_ranks
from lrkv_core.allocation.eigen import lowest_threshold
from lrkv_core.conversion.convert import CompressionConfig, model_layer_weights, plan_conversion
from lrkv_core.decompositions import decompose_layer
from lrkv_core.statistics import collect_gram, collect_layer_output_error
from lrkv_core.statistics.layer_error import energy_rank, threshold_grid


def test_eq5_keeps_the_smallest_prefix_holding_the_share_of_energy() -> None:
    sigma = torch.tensor(
        [4.0, 3.0, 2.0, 1.0], dtype=torch.float64
    ).sqrt()  # energies 4, 3, 2, 1 of 10: prefixes 0.4, 0.7, 0.9, 1
    got = {eps: energy_rank(sigma, eps) for eps in (1.0, 0.95, 0.9, 0.71, 0.7, 0.4, 0.39, 0.0)}
    assert got == {1.0: 4, 0.95: 4, 0.9: 3, 0.71: 3, 0.7: 2, 0.4: 1, 0.39: 1, 0.0: 0}
    assert threshold_grid(0.25).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    with pytest.raises(ValueError, match="must divide 1"):
        threshold_grid(0.3)


def test_algorithm_1_lowers_each_layer_threshold_while_its_output_error_is_within_budget() -> None:
    eps = [1.0, 0.75, 0.5, 0.25, 0.0]
    shallow = torch.tensor([eps, [0.0, 0.01, 0.05, 0.2, 1.0]], dtype=torch.float64)
    deep = torch.tensor([eps, [0.0, 0.001, 0.002, 0.3, 1.0]], dtype=torch.float64)
    bumpy = torch.tensor([eps, [0.0, 0.02, 0.01, 0.01, 1.0]], dtype=torch.float64)  # not monotone
    assert [lowest_threshold(c, 0.05) for c in (shallow, deep, bumpy)] == [0.5, 0.5, 0.25]
    assert [lowest_threshold(c, 0.01) for c in (shallow, deep, bumpy)] == [
        0.75,
        0.5,
        1.0,
    ]  # stops at the 1st excess
    assert [lowest_threshold(c, 0.0) for c in (shallow, deep, bumpy)] == [1.0, 1.0, 1.0]
    assert [lowest_threshold(c, 1.0) for c in (shallow, deep, bumpy)] == [0.0, 0.0, 0.0]


def test_the_budget_search_gives_the_least_error_that_fits_the_ratio() -> None:
    """Two layers with one K and one V group each (width 4, energies 4:3:2:1): the plan at each candidate
    budget follows from the thresholds above, and the search stops at the smallest budget that fits."""
    sigma = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64).sqrt()
    spectra = [{"k": [sigma], "v": [sigma]} for _ in range(2)]
    eps = [1.0, 0.75, 0.5, 0.25, 0.0]
    curves = [
        torch.tensor([eps, [0.0, 0.01, 0.05, 0.2, 1.0]], dtype=torch.float64),
        torch.tensor([eps, [0.0, 0.001, 0.002, 0.3, 1.0]], dtype=torch.float64),
    ]
    features = {"layer_errors": [{"k": [c], "v": [c]} for c in curves]}
    algorithm_1 = {"name": "eigen", "rule": "layerwise"}
    kw = dict(group_size=1, head_dim=4, rank_multiple=1, allocator=algorithm_1, features=features)
    # ratio 0.75 (12 of 16): e_b = 0.002 puts layer 0 at ε 1 (rank 4), layer 1 at ε 0.5 (rank 2): 12
    plan = allocate_ranks(spectra, ratio=0.75, **kw)
    assert plan.details["error_budget"] == 0.002 and plan.details["layer_epsilon"] == [1.0, 0.5]
    assert plan.ranks == {"k": [[4], [2]], "v": [[4], [2]]}
    # ratio 0.5 (8): 0.01 gives ranks 3 and 2 (10), too many; 0.05 gives 2 and 2: 8
    plan = allocate_ranks(spectra, ratio=0.5, **kw)
    assert plan.details["error_budget"] == 0.05 and plan.details["layer_epsilon"] == [0.5, 0.5]
    assert plan.ranks == {"k": [[2], [2]], "v": [[2], [2]]}


def _plain_factors(model, rows):
    """Both layers of a tiny 2-layer model (2 KV heads of 8) decomposed plainly, one head per group."""
    grams, _ = collect_gram(model, rows)
    return [
        decompose_layer(
            i, model_layer_weights(model, i), {"gram": grams[i]}, n_kv_heads=2, head_dim=8, group_size=1,
            decomposition="plain",
        )
        for i in range(2)
    ]  # fmt: skip


def test_layer_output_error_of_a_tiny_model(make_tiny, one_thread) -> None:
    """Measured on a model: no error at full rank (ε = 1), and the error of ε is the decoder layer's output
    moved by projections cut to Eq. 5's ranks, checked against cutting the weights by hand."""
    model = make_tiny("llama", 2)  # L=2, Hkv=2, D=8, d=32
    rows = torch.randint(3, 61, (6, 16), generator=torch.Generator().manual_seed(0))
    factors = _plain_factors(model, rows)
    grid = threshold_grid(0.25)
    curves = collect_layer_output_error(model, rows, factors, grid, batch_size=4)
    for curve in curves:
        assert curve["epsilon"].tolist() == grid.tolist()
        assert curve["error"][0] < 1e-12 and curve["error"][-1] > curve["error"][1] > 0
    # layer 1 at ε = 0.5, by hand: its k/v weights replaced by the groups' factors cut to Eq. 5's ranks
    layer = model.model.layers[1]
    inputs = {}
    handle = layer.register_forward_hook(lambda m, a, k, o: inputs.update(a=a, k=k, o=o), with_kwargs=True)
    with torch.no_grad():
        model(rows, use_cache=False)
    handle.remove()
    attn = layer.self_attn
    saved = attn.k_proj.weight.detach().clone(), attn.v_proj.weight.detach().clone()
    with torch.no_grad():
        for proj, kind in ((attn.k_proj, "k"), (attn.v_proj, "v")):
            blocks = [g.up[:, : energy_rank(g.sigma, 0.5)] @ g.down[: energy_rank(g.sigma, 0.5)]
                      for g in factors[1].groups[kind]]  # fmt: skip
            proj.weight.copy_(torch.cat(blocks).float())
        cut = layer(*inputs["a"], **inputs["k"])
        attn.k_proj.weight.copy_(saved[0])
        attn.v_proj.weight.copy_(saved[1])
    ref = inputs["o"][0] if isinstance(inputs["o"], tuple) else inputs["o"]
    cut = cut[0] if isinstance(cut, tuple) else cut
    expected = float((cut.double() - ref.double()).square().sum() / ref.double().square().sum())
    assert float(curves[1]["error"][2]) == pytest.approx(expected, rel=1e-5)
    assert torch.equal(attn.k_proj.weight, saved[0])  # the statistic restored the weights


def test_eigen_in_a_conversion_collects_the_statistic_and_meets_the_ratio(make_tiny, one_thread) -> None:
    model = make_tiny("llama", 2)
    rows = torch.randint(3, 61, (4, 16), generator=torch.Generator().manual_seed(1))
    algorithm_1 = {"name": "eigen", "rule": "layerwise"}
    config = CompressionConfig(ratio=0.5, group_size=1, rank_multiple=1, allocator=algorithm_1)
    assert [s.name for s in config.needed_statistics()].count("layer_output_error") == 1
    plan = plan_conversion(model, rows, config).plan
    assert plan.kept <= plan.budget_width and plan.details["error_budget"] >= 0
    assert len(plan.details["layer_epsilon"]) == 2
    global_rule = CompressionConfig(ratio=0.5, group_size=1, rank_multiple=1, allocator="eigen")  # default
    assert "layer_output_error" not in [s.name for s in global_rule.needed_statistics()]


def test_each_layer_of_a_tiny_model_lands_on_the_threshold_algorithm_1_gives_for_its_budget(
    make_tiny, one_thread
) -> None:
    """On a model: each layer's ε is where Algorithm 1's walk from 1 stops for the chosen e_b (its error
    within e_b there, beyond it one step lower), measured again from the conversion's own factors; each
    group keeps at least Eq. 5's rank at that ε (the leftover only widens); the layers' ε differ."""
    model = make_tiny("llama", 4)
    rows = torch.randint(3, 61, (6, 16), generator=torch.Generator().manual_seed(2))
    algorithm_1 = {"name": "eigen", "rule": "layerwise"}
    config = CompressionConfig(ratio=0.5, group_size=1, rank_multiple=1, allocator=algorithm_1)
    conversion = plan_conversion(model, rows, config)
    plan, budget = conversion.plan, conversion.plan.details["error_budget"]
    grid = threshold_grid(0.02)
    curves = collect_layer_output_error(model, rows, conversion.factors, grid, batch_size=4)
    chosen = plan.details["layer_epsilon"]
    assert len(set(chosen)) > 1 and 0 < budget
    for layer, (eps, curve) in enumerate(zip(chosen, curves, strict=True)):
        errors = dict(zip(grid.tolist(), curve["error"].tolist()))
        walked = [e for e in grid.tolist() if e >= eps - 1e-12]
        assert all(errors[e] <= budget * (1 + 1e-6) for e in walked)  # every step down to ε within e_b
        lower = [e for e in grid.tolist() if e < eps - 1e-12]
        assert not lower or errors[lower[0]] > budget * (1 - 1e-6)  # the next step would exceed it
        for kind in ("k", "v"):
            for group, rank in zip(conversion.factors[layer].groups[kind], plan.ranks[kind][layer]):
                assert rank >= energy_rank(group.sigma, eps)
    assert plan.kept <= plan.budget_width


def test_a_layer_summary_with_algorithm_1s_curves_saves_and_loads(make_tiny, one_thread, tmp_path) -> None:
    """Every group of a layer carries the layer's output-error curve, one tensor: saved per group all the
    same."""
    from lrkv_core.allocation.features import LayerSummary, summarize_layer

    model = make_tiny("llama", 2)
    rows = torch.randint(3, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    factors = _plain_factors(model, rows)
    curves = collect_layer_output_error(model, rows, factors, threshold_grid(0.25))
    summary = summarize_layer(factors[0], {"layer_output_error": curves[0]}, ["layer_errors"])
    summary.save(tmp_path / "layer0.safetensors")
    loaded = LayerSummary.load(tmp_path / "layer0.safetensors")
    for kind in ("k", "v"):
        given = summary.features["layer_errors"][kind]
        for saved, curve in zip(loaded.features["layer_errors"][kind], given, strict=True):
            assert torch.equal(saved, curve.to(torch.float64))
