"""Calibration passes in bfloat16: the decoder stack's products under autocast, nothing else.

A float32 tiny Llama. Inside ``calibration_precision("bfloat16")`` the k/v projections of a pass compute in
bfloat16 while the residual stream, the logits and the statistics' sums keep their dtypes; the statistics
move by bfloat16 rounding (not more, not zero); a model that is not float32 runs as it is; a conversion
calibrated so is still exact at full rank.
"""

from __future__ import annotations

import pytest
import torch

from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from lrkv_core.model.adapters import get_adapter
from lrkv_core.statistics import STATISTICS, gradients
from lrkv_core.statistics.joint import attention_implementation, collect_joint
from lrkv_core.statistics.precision import calibration_precision, stack_precision
from tests.support.inputs import max_diff, max_relative_gap, statistic_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, T, BATCH = 4, 12, 2
# the output Fisher on the rows' own tokens: its targets drawn from a near-uniform tiny model's predictions
# would move with any rounding of the logits (docs: the same estimator, other draws)
JOINED = ("attention_gram", "gram", {"name": "output_fisher", "labels": "data"})


def _setup(make_tiny):
    model = make_tiny("llama", 2)  # float32; L=2, Hkv=2, D=8, d=32
    rows = torch.randint(3, 61, (ROWS, T), generator=torch.Generator().manual_seed(1))
    return model, rows


def _collect(model, rows, names=JOINED):
    stats = [STATISTICS.create(n) for n in names]
    return [values for values, _ in collect_joint(stats, model, rows, batch_size=BATCH)]


def test_an_unknown_precision_is_refused(make_tiny) -> None:
    with pytest.raises(ValueError, match="unknown calibration precision 'fp8'"):
        with calibration_precision("fp8"):
            pass
    model, rows = _setup(make_tiny)
    with pytest.raises(ValueError, match="calibration precision"):
        plan_conversion(model, rows, CompressionConfig(ratio=0.5, allocator="uniform"), precision="half")


def test_a_bfloat16_pass_runs_the_projections_in_bfloat16_and_keeps_the_residual_stream(make_tiny) -> None:
    model, rows = _setup(make_tiny)
    seen = []
    k_proj = get_adapter(model.config).attention(model, 0).k_proj
    handle = k_proj.register_forward_hook(lambda _m, args, out: seen.append((args[0].dtype, out.dtype)))
    try:
        with torch.no_grad():
            hidden = gradients.last_hidden(model, rows[:1])
            with calibration_precision("bfloat16"):
                low = gradients.last_hidden(model, rows[:1])
                logits = next(gradients.next_token_log_probs(model, low))[1]
            outside = model(rows[:1]).logits  # a plain forward in the block's thread, after it closed
    finally:
        handle.remove()
    assert seen == [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),  # the projection's product in bfloat16, its input as it was
        (torch.float32, torch.float32),
    ]
    assert hidden.dtype == low.dtype == logits.dtype == outside.dtype == torch.float32
    gap = max_diff(low, hidden) / float(hidden.abs().max())
    assert 1e-5 < gap < 5e-2  # bfloat16 rounding, not another computation


def test_statistics_in_bfloat16_move_by_its_rounding_and_float32_is_the_model_s_own(make_tiny) -> None:
    model, rows = _setup(make_tiny)
    own = _collect(model, rows)
    with calibration_precision("float32"):
        same = _collect(model, rows)
    with calibration_precision("bfloat16"):
        low = _collect(model, rows)
    for name, a, b, c in zip(JOINED, own, same, low, strict=True):
        assert max_relative_gap(b, a) == 0, name
        assert 1e-5 < max_relative_gap(c, a) < 5e-2, name  # float64 sums of bfloat16 products
        assert {t.dtype for t in statistic_tensors(c)} == {torch.float64}, name


def test_the_attention_gram_sums_a_bfloat16_pass_s_weights_in_float32(make_tiny) -> None:
    """The reference: the same autocast pass's attention weights and v_proj inputs, summed in float64; a sum
    taken under autocast (its products in bfloat16) would be ~1e-3 away."""
    model, rows = _setup(make_tiny)
    adapter = get_adapter(model.config)
    inputs, want = {}, [torch.zeros(32, 32, dtype=torch.float64) for _ in range(2)]
    hooks = []
    for i in range(2):
        attn = adapter.attention(model, i)

        def keep(_m, args, i=i):
            inputs[i] = args[0].double()

        def add(_m, _args, out, i=i):
            p = out[1].double()
            mix = torch.einsum("bhmt,bhms->bts", p, p)
            want[i] += torch.einsum("btd,bts,bse->de", inputs[i], mix, inputs[i])

        hooks += [attn.v_proj.register_forward_pre_hook(keep), attn.register_forward_hook(add)]
    try:
        with attention_implementation(model, "eager"), torch.no_grad(), calibration_precision("bfloat16"):
            for start in range(0, ROWS, BATCH):
                with stack_precision(model):
                    adapter.base_model(model)(input_ids=rows[start : start + BATCH], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    with calibration_precision("bfloat16"):
        [got] = _collect(model, rows, ("attention_gram",))
    assert max_relative_gap(got, want) < 1e-5


def test_a_model_that_is_not_float32_runs_as_it_is(make_tiny) -> None:
    model, rows = _setup(make_tiny)
    model = model.double()
    own = _collect(model, rows, ("gram", "output_fisher"))
    with calibration_precision("bfloat16"):
        low = _collect(model, rows, ("gram", "output_fisher"))
    for a, b in zip(own, low, strict=True):
        assert max_relative_gap(b, a) == 0


def test_a_conversion_calibrated_in_bfloat16_is_exact_at_full_rank_and_differs_below(make_tiny) -> None:
    model, rows = _setup(make_tiny)
    ids = rows[:2]
    with torch.no_grad():
        want = model(ids).logits
    config = CompressionConfig(ratio=1.0, group_size=2, allocator="uniform")
    full = plan_conversion(model, rows, config, batch_size=BATCH, precision="bfloat16").apply(model)
    with torch.no_grad():
        assert max_diff(full(ids).logits, want) < 1e-4
    # below full rank the bfloat16 statistics give other factors: the option reaches the conversion's passes
    # (how far they move depends on the spectrum's gaps: a random tiny model's are small)
    model, rows = _setup(make_tiny)
    half = CompressionConfig(ratio=0.5, group_size=2, allocator="uniform")
    a = plan_conversion(model, rows, half, batch_size=BATCH)
    b = plan_conversion(model, rows, half, batch_size=BATCH, precision="bfloat16")
    assert a.plan.ranks == b.plan.ranks
    r = a.plan.ranks["k"][0][0]
    ga, gb = a.factors[0].groups["k"][0], b.factors[0].groups["k"][0]
    wa, wb = ga.up[:, :r] @ ga.down[:r], gb.up[:, :r] @ gb.down[:r]  # the kept part of the group's weights
    assert float((wa - wb).norm() / wa.norm()) > 1e-6
