"""Plan refinement on the measured KL (lrkv_core.conversion.refine): the cut weights are the deployed model,
the step's estimates predict measured moves, and refining a poor plan lowers the KL on its rows and on other
rows."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from lrkv_core.conversion.refine import (
    ORIGINAL_BYTES,
    REFINE_RADIUS,
    OriginalHidden,
    PlanWeights,
    RefineConfig,
    measured_kl,
    measured_nll,
    refine_plan,
    step_costs,
)
from lrkv_core.data.datasets import calibration_windows
from lrkv_core.model.loading import load_model

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
SHAKESPEARE = SHARED / "models" / "shakespeare-llama"
TRAIN = SHARED / "data" / "shakespeare" / "train.txt"

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(n: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 61, (n, length), generator=torch.Generator().manual_seed(seed))


def test_cut_weights_give_the_fused_models_logits_and_restore_the_original(make_tiny) -> None:
    model = make_tiny("llama", 2).double()
    rows = _rows(6, 16)
    conv = plan_conversion(model, rows, CompressionConfig(ratio=0.5, group_size=1, rank_multiple=1))
    fused = conv.apply(copy.deepcopy(model))
    with torch.no_grad():
        original = model(input_ids=rows).logits
        weights = PlanWeights(model, conv.factors)
        weights.cut(conv.plan.ranks)
        cut = model(input_ids=rows).logits
        assert (cut - fused(input_ids=rows).logits).abs().max() < 1e-9
        assert (cut - original).abs().max() > 1e-3  # the plan does cut something
        weights.restore()
        assert torch.equal(model(input_ids=rows).logits, original)


def test_measured_loss_and_kl_are_the_whole_rows_in_chunks(make_tiny, monkeypatch) -> None:
    """The measured NLL and KL, taken a few positions at a time, are those of the models' whole-row
    log-probabilities."""
    from lrkv_core.statistics import gradients

    model = make_tiny("llama", 2).double()
    rows = _rows(5, 23)
    conv = plan_conversion(model, rows, CompressionConfig(ratio=0.5, group_size=1, rank_multiple=1))
    weights = PlanWeights(model, conv.factors)
    with torch.no_grad():
        p = torch.log_softmax(model(input_ids=rows).logits[:, :-1], -1)
        weights.cut(conv.plan.ranks)
        q = torch.log_softmax(model(input_ids=rows).logits[:, :-1], -1)
        weights.restore()
    nll = -float(q.gather(-1, rows[:, 1:, None]).mean())
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    monkeypatch.setattr(gradients, "LOSS_CHUNK", 5)
    assert measured_nll(model, weights, conv.plan.ranks, rows, 2) == pytest.approx(nll, rel=1e-10)
    assert measured_kl(model, weights, conv.plan.ranks, rows, 2) == pytest.approx(kl, rel=1e-8)
    assert kl > 1e-4


def test_refine_inputs_are_checked_and_no_steps_keep_the_plan(make_tiny) -> None:
    model = make_tiny("llama", 2)
    rows = _rows(4, 12)
    conv = plan_conversion(model, rows, CompressionConfig(ratio=0.5, group_size=1, rank_multiple=1))
    assert refine_plan(model, conv.factors, conv.plan, rows, {"steps": 0}) is conv.plan
    full = plan_conversion(model, rows, CompressionConfig(ratio=1.0, group_size=1, rank_multiple=1))
    assert refine_plan(model, full.factors, full.plan, rows, {"steps": 2}) is full.plan  # nothing to move
    with pytest.raises(ValueError, match="T ≥ 2"):
        refine_plan(model, conv.factors, conv.plan, rows[:, :1], {"steps": 1})
    with pytest.raises(ValueError, match="needs a number of steps"):
        refine_plan(model, conv.factors, conv.plan, rows, {})
    for bad in ({"steps": -1}, {"rows": 0}, {"radius": 0}):
        with pytest.raises(ValueError, match="refine steps must be ≥ 0, refine rows and radius ≥ 1"):
            CompressionConfig(refine=bad)
        with pytest.raises(ValueError, match="refine steps must be ≥ 0, refine rows and radius ≥ 1"):
            refine_plan(model, conv.factors, conv.plan, rows, {"steps": 1} | bad)
    with pytest.raises(ValueError, match="refine objective must be one of kl, nll, got 'ppl'"):
        refine_plan(model, conv.factors, conv.plan, rows, {"steps": 1, "objective": "ppl"})
    with pytest.raises(ValueError, match="refine objective must be one of kl, nll, got 'ppl'"):
        CompressionConfig(refine={"objective": "ppl"})
    with pytest.raises(ValueError, match=r"unknown refine option\(s\) step$"):
        CompressionConfig(refine={"step": 1})
    assert CompressionConfig().refine.steps == 3  # kl's default
    assert CompressionConfig(allocator="uniform").refine.steps == 0  # the others keep their plans
    assert CompressionConfig(allocator="uniform", refine={"steps": 2}).refine.steps == 2
    assert CompressionConfig(refine=RefineConfig(steps=0)).refine.steps == 0
    with pytest.raises(ValueError, match="pass calibration rows"):
        plan_conversion(
            model, None, CompressionConfig(decomposition="plain", allocator="uniform", refine={"steps": 1})
        )
    refined = plan_conversion(
        model, rows, CompressionConfig(ratio=0.5, group_size=1, rank_multiple=1, refine={"steps": 1})
    )
    steps = refined.plan.details["refine"]["steps"]
    record = refined.plan.details["refine"]
    assert (record["rows"], record["accept_rows"]) == (2, 2)  # 4 rows: half price, half accept (the default)
    assert steps[0]["nll"] > 0  # the default objective
    assert refined.plan.kept <= refined.plan.budget_width


@pytest.fixture(scope="module")
def shakespeare(one_thread):
    missing = [str(p) for p in (SHAKESPEARE, TRAIN) if not p.exists()]
    if missing:
        pytest.skip(f"shared pretrained assets absent: {', '.join(missing)}")
    model, tok = load_model(SHAKESPEARE)
    rows = calibration_windows(f"text:{TRAIN}", tok, n_samples=64, seq_len=128, seed=0)
    # Palu's decomposition (values measured at v_proj): uniform's plan then leaves the refinement room to
    # show. On the default (values="attention") uniform is already closer; measured there: the nll step
    # estimates correlate 0.80 with the measured changes (kl 0.95+), and 2 nll steps leave the loss of
    # unseen rows where it was (2.66713 against 2.66709).
    decomposition = {"name": "whitened", "values": "projection", "keys": "projection"}
    config = CompressionConfig(ratio=0.5, allocator="uniform", decomposition=decomposition)
    conv = plan_conversion(model, rows, config)
    return model, rows, conv


@pytest.mark.parametrize("objective", ["kl", "nll"])
def test_step_estimates_predict_the_measured_objective_of_moving_one_group(shakespeare, objective) -> None:
    """From uniform's plan, each group one rank step down or up: the estimate vs the change really measured
    (the KL to the original, or the loss of the rows' own next tokens)."""
    model, rows, conv = shakespeare
    ranks, rows = conv.plan.ranks, rows[:16]
    measure = {"kl": measured_kl, "nll": measured_nll}[objective]
    weights = PlanWeights(model, conv.factors)
    try:
        base = measure(model, weights, ranks, rows, 8)
        costs, _ = step_costs(
            model,
            weights,
            ranks,
            rows,
            batch_size=8,
            seed=0,
            objective=objective,
        )
        estimated, measured = [], []
        for (layer, kind), cost in costs.items():
            for g, row in enumerate(cost):
                r = ranks[kind][layer][g]
                assert row[r] == 0
                for moved in (r - 8, r + 8):
                    if 8 <= moved < row.numel():
                        other = copy.deepcopy(ranks)
                        other[kind][layer][g] = moved
                        estimated.append(float(row[moved]))
                        measured.append(measure(model, weights, other, rows, 8) - base)
    finally:
        weights.restore()
    assert len(measured) == 16
    corr = torch.corrcoef(torch.tensor([estimated, measured]))[0, 1]
    assert corr > {"kl": 0.95, "nll": 0.9}[objective], (estimated, measured)  # measured: 0.99, 0.94


def test_refining_uniforms_plan_lowers_the_kl_on_its_rows_and_on_others(shakespeare) -> None:
    model, rows, conv = shakespeare
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    plan = refine_plan(model, conv.factors, conv.plan, rows[:16], {"steps": 3, "objective": "kl"})
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # left as it was
    history = plan.details["refine"]["steps"]
    kept = [history[0]["kl"]] + [s["kl"] for s in history[1:] if s["kept"]]
    assert kept == sorted(kept, reverse=True) and kept[-1] < 0.5 * kept[0]  # measured: 0.022 -> 0.007
    assert plan.kept <= plan.budget_width and plan.ranks != conv.plan.ranks
    weights = PlanWeights(model, conv.factors)
    try:
        other = rows[16:48]  # rows the refinement never saw
        assert measured_kl(model, weights, plan.ranks, other, 8) < measured_kl(
            model, weights, conv.plan.ranks, other, 8
        )
    finally:
        weights.restore()


def test_the_radius_bounds_each_groups_move(shakespeare) -> None:
    """From uniform's plan (rank 32 of 64 everywhere), one step may move a group by at most ``radius`` rank
    steps of 8: radius 1 moves groups by one step at most; the default's step moves some farther."""
    model, rows, conv = shakespeare
    start = [r for kind in ("k", "v") for layer in conv.plan.ranks[kind] for r in layer]
    moves = {}
    for radius in (1, REFINE_RADIUS):
        refined = refine_plan(model, conv.factors, conv.plan, rows[:16], {"steps": 1, "radius": radius})
        step = refined.details["refine"]["steps"][1]
        assert step["radius"] == radius and step["kept"]
        after = [r for kind in ("k", "v") for layer in refined.ranks[kind] for r in layer]
        moves[radius] = [abs(a - b) for a, b in zip(after, start)]
    assert max(moves[1]) == 8 and max(moves[REFINE_RADIUS]) > 8, moves


def test_refining_on_the_rows_own_tokens_lowers_their_loss(shakespeare) -> None:
    """``objective="nll"``: the kept plans' measured loss of the rows' own next tokens falls step by step,
    and the refined plan has the lower loss on rows it never saw too."""
    model, rows, conv = shakespeare
    plan = refine_plan(
        model, conv.factors, conv.plan, rows[:16], {"steps": 2, "objective": "nll", "accept_rows": 0}
    )
    refine = plan.details["refine"]
    kept = [refine["steps"][0]["nll"]] + [s["nll"] for s in refine["steps"][1:] if s["kept"]]
    assert refine["objective"] == "nll" and len(kept) > 1 and kept == sorted(kept, reverse=True)
    assert plan.kept <= plan.budget_width
    weights = PlanWeights(model, conv.factors)
    try:
        assert measured_nll(model, weights, conv.plan.ranks, rows[:16], 8) == pytest.approx(kept[0], rel=1e-6)
        other = rows[16:48]
        assert measured_nll(model, weights, plan.ranks, other, 8) < measured_nll(
            model, weights, conv.plan.ranks, other, 8
        )
    finally:
        weights.restore()


def test_the_default_prices_on_32_rows_and_accepts_on_the_32_after_them_or_on_half_of_fewer() -> None:
    """``RefineConfig.split``: how many calibration rows price each step and how many after them accept it."""
    default = RefineConfig()
    assert [default.split(n) for n in (256, 64, 48, 3, 1)] == [(32, 32), (32, 32), (24, 24), (2, 1), (1, 0)]
    assert RefineConfig(rows=128).split(256) == (128, 32)
    assert RefineConfig(rows=128).split(140) == (108, 32)  # the accepting rows first, the pricing ones fewer
    assert RefineConfig(accept_rows=0).split(256) == (32, 0)  # accepted on the rows that priced it
    assert RefineConfig(rows=16, accept_rows=8).split(24) == (16, 8)
    with pytest.raises(ValueError, match="it needs 24 calibration rows, got 23"):
        RefineConfig(rows=16, accept_rows=8).split(23)


def test_long_rows_price_and_accept_on_the_tokens_of_32_rows_of_256() -> None:
    """``tokens`` caps each set of rows by what it holds (8,192 by default: 32 rows of 256, 4 of 2,048):
    long calibration rows cost a step what short ones do; ``tokens: null`` counts rows alone."""
    default = RefineConfig()
    assert [default.split(64, t) for t in (256, 1024, 2048, 16384)] == [(32, 32), (8, 8), (4, 4), (1, 1)]
    assert default.split(64) == (32, 32)  # the rows' length unknown: rows alone
    assert RefineConfig(tokens=None).split(64, 2048) == (32, 32)
    assert RefineConfig(accept_rows=0).split(64, 2048) == (4, 0)
    assert RefineConfig(rows=16, accept_rows=8).split(9, 2048) == (4, 4)  # capped first, so they fit
    with pytest.raises(ValueError, match="tokens must be ≥ 1 or null"):
        RefineConfig(tokens=0)


def test_steps_are_accepted_on_the_rows_after_those_that_priced_them(shakespeare) -> None:
    """``accept_rows``: steps priced on the first ``rows`` rows are kept or rejected by the objective measured
    on the next ``accept_rows``; the plan's record says so, and too few calibration rows is an error."""
    model, rows, conv = shakespeare
    config = {"steps": 2, "rows": 16, "accept_rows": 16, "objective": "nll"}
    plan = refine_plan(model, conv.factors, conv.plan, rows[:32], config)
    refine = plan.details["refine"]
    assert (refine["rows"], refine["accept_rows"]) == (16, 16)
    kept = [refine["steps"][0]["nll"]] + [s["nll"] for s in refine["steps"][1:] if s["kept"]]
    weights = PlanWeights(model, conv.factors)
    try:
        priced, accepting = rows[:16], rows[16:32]
        assert measured_nll(model, weights, conv.plan.ranks, accepting, 8) == pytest.approx(kept[0], rel=1e-6)
        assert measured_nll(model, weights, conv.plan.ranks, priced, 8) != pytest.approx(kept[0], rel=1e-3)
        assert measured_nll(model, weights, plan.ranks, accepting, 8) == pytest.approx(kept[-1], rel=1e-6)
    finally:
        weights.restore()
    with pytest.raises(ValueError, match="needs 48 calibration rows, got 32"):
        refine_plan(model, conv.factors, conv.plan, rows[:32], config | {"accept_rows": 32})
    with pytest.raises(ValueError, match="accept_rows must be ≥ 0"):
        CompressionConfig(refine={"accept_rows": -1})


def test_the_micro_batch_size_does_not_change_the_refined_plan(shakespeare) -> None:
    """Rows per pass (one row of a long window, or eight short ones) change only the order of float sums:
    the curvature's draws are seeded per row, so the step costs agree and the plan is the same."""
    model, rows, conv = shakespeare
    plans = {
        b: refine_plan(model, conv.factors, conv.plan, rows[:8], {"steps": 2}, batch_size=b) for b in (1, 8)
    }
    assert plans[1].ranks == plans[8].ranks
    for one, eight in zip(
        plans[1].details["refine"]["steps"], plans[8].details["refine"]["steps"], strict=True
    ):
        assert one["nll"] == pytest.approx(eight["nll"], rel=1e-5)
        if "estimate" in one:
            assert one["estimate"] == pytest.approx(eight["estimate"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("accept_rows", [0, 4])
def test_kept_original_states_give_the_same_plan_with_one_original_forward_per_batch(
    shakespeare, monkeypatch, accept_rows
) -> None:
    """The KL objective reads the original's hidden states of every row at each step (pricing and
    accepting); kept once, they give the very same values (bitwise) and plan, and the original's decoder
    stack runs once per micro-batch of each row set instead of at every use."""
    from lrkv_core.conversion import refine

    model, rows, conv = shakespeare
    made: list = []
    monkeypatch.setattr(
        refine, "OriginalHidden", lambda *a, **k: made.append(OriginalHidden(*a, **k)) or made[-1]
    )
    config = {"steps": 2, "objective": "kl", "rows": 8, "accept_rows": accept_rows, "radius": 2}
    runs = {}
    for budget in (0, ORIGINAL_BYTES):
        made.clear()
        plan = refine_plan(
            model, conv.factors, conv.plan, rows[:12], config, batch_size=4, original_bytes=budget
        )
        runs[budget] = (plan, [m.computed for m in dict.fromkeys(made)])
    (plain, recomputed), (kept, once) = runs[0], runs[ORIGINAL_BYTES]
    assert kept.ranks == plain.ranks and kept.ranks != conv.plan.ranks  # a step was taken
    assert kept.details["refine"] == plain.details["refine"]  # the same measured values, exactly
    batches = [2, 1] if accept_rows else [2]  # micro-batches of 4: the 8 pricing rows (and 4 accepting)
    assert once == batches  # each computed once, at its first use
    assert all(r >= 2 * b for r, b in zip(recomputed, batches))  # the first value and a step's, at least


@pytest.mark.parametrize("objective", ["kl", "nll"])
def test_the_pass_that_prices_a_plan_measures_it(shakespeare, objective) -> None:
    """The objective added up by the pricing pass's loss is the one a forward pass of its own measures."""
    model, rows, conv = shakespeare
    measure = {"kl": measured_kl, "nll": measured_nll}[objective]
    weights = PlanWeights(model, conv.factors)
    try:
        _, value = step_costs(
            model, weights, conv.plan.ranks, rows[:6], batch_size=4, seed=3, objective=objective
        )
        assert value > 0
        assert value == pytest.approx(measure(model, weights, conv.plan.ranks, rows[:6], 4), rel=1e-6)
    finally:
        weights.restore()


def _refined_with_forwards(model, conv, rows, config) -> dict[bool, tuple]:
    """Each way of measuring candidates: (the refined plan, forwards of the decoder stack run, the progress
    reports)."""
    forwards = [0]
    hook = model.model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    runs = {}
    try:
        for shared in (False, True):
            forwards[0], reports = 0, []
            plan = refine_plan(
                model,
                conv.factors,
                conv.plan,
                rows,
                config,
                batch_size=4,
                measure_while_pricing=shared,
                progress=lambda done, total, seen=reports: seen.append((done, total)),
            )
            runs[shared] = (plan, forwards[0], reports)
    finally:
        hook.remove()
    return runs


@pytest.mark.parametrize("objective", ["kl", "nll"])
def test_candidates_measured_while_pricing_give_the_same_plan_in_fewer_forwards(
    shakespeare, objective
) -> None:
    """Where every step is kept, measuring each candidate in the pass that prices the next step gives the plan
    and measured values that a forward pass of their own gives, in fewer decoder-stack forwards: two steps on
    four micro-batches take 3 passes each (the start and the first candidate, priced and measured; the last
    measured) instead of 5 (the start, then each step priced and its candidate measured)."""
    model, rows, conv = shakespeare
    runs = _refined_with_forwards(
        model, conv, rows[:16], {"steps": 2, "objective": objective, "rows": 16, "accept_rows": 0}
    )
    (alone, n_alone, _), (shared, n_shared, _) = runs[False], runs[True]
    steps = alone.details["refine"]["steps"]
    assert len(steps) == 3 and all(s["kept"] for s in steps[1:])  # the premise: every step kept
    assert shared.ranks == alone.ranks and shared.ranks != conv.plan.ranks
    for a, s in zip(steps, shared.details["refine"]["steps"], strict=True):
        assert s[objective] == pytest.approx(a[objective], rel=1e-6)
        assert {k: v for k, v in s.items() if k != objective} == {
            k: v for k, v in a.items() if k != objective
        }
    original = 4 if objective == "kl" else 0  # the original's hidden states, kept: once per micro-batch
    assert (n_alone, n_shared) == (4 * 5 + original, 4 * 3 + original)
    # progress after each micro-batch of 4 rows of each pass, over the 16 rows × the passes of both steps
    assert runs[True][2] == [(4 * i, 48) for i in range(1, 13)]
    assert runs[False][2] == [(4 * i, 80) for i in range(1, 21)]


def test_a_step_after_a_rejection_is_solved_again_on_the_same_prices(shakespeare) -> None:
    """The nll's second step from uniform's plan on these rows is rejected: measured while pricing, the third
    step halves the radius on the prices it already has (no pass); each candidate priced and measured alone,
    it prices the plan again (7 passes per micro-batch instead of 4)."""
    model, rows, conv = shakespeare
    runs = _refined_with_forwards(
        model, conv, rows[:8], {"steps": 3, "objective": "nll", "rows": 8, "accept_rows": 0}
    )
    for plan, _, _ in runs.values():
        steps = plan.details["refine"]["steps"]
        assert [s.get("kept") for s in steps[1:3]] == [True, False] and steps[3]["radius"] == 2
    assert (runs[False][1], runs[True][1]) == (2 * 7, 2 * 4)
    # progress: the rows of every pass, one report per micro-batch of 4 rows, up to the rows all passes hold
    assert runs[True][2] == [(4 * i, 32) for i in range(1, 9)]  # 4 passes over 8 rows
    assert runs[False][2] == [(4 * i, 56) for i in range(1, 15)]  # 7 passes
