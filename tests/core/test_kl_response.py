"""kl_response: every group's second-order KL curve from one gradient pass, checked against autograd and
against the KL measured by actually cutting a group; kl plans from it."""

from __future__ import annotations

import pytest
import torch

from lrkv_core.conversion.convert import CompressionConfig, decompose_model, plan_conversion
from lrkv_core.model.adapters import get_adapter
from lrkv_core.statistics import STATISTICS, KLResponse, collect_kl_response


def _factors(model, rows, **config):
    return decompose_model(model, rows, CompressionConfig(**config))[0]


def _proj(model, layer: int, kind: str):
    adapter = get_adapter(model.config)
    return getattr(adapter.attention(model, layer), adapter.k_name if kind == "k" else adapter.v_name)


def test_data_label_curves_are_the_squared_first_order_loss_change_of_each_row(make_tiny, one_thread) -> None:
    """KL[r] = (T − 1)/2 · mean_rows ⟨∇_W ℓ_row, W − B_r A_r⟩², the row gradients taken by autograd."""
    model = make_tiny("llama", 2)  # L=2, Hkv=2, D=8, d=32
    rows = torch.randint(3, 61, (5, 12), generator=torch.Generator().manual_seed(1))
    factors = _factors(model, rows, group_size=1, rank_multiple=1, decomposition="plain")
    curves, n = collect_kl_response(model, rows, factors, batch_size=2, sampled=False)
    assert n == 5 and len(curves) == 2

    grads = []  # per row: {(layer, kind): ∂ℓ_row/∂W}
    for row in rows:
        model.zero_grad()
        with torch.enable_grad():
            for p in model.parameters():
                p.requires_grad_(True)
            loss = model(input_ids=row[None], labels=row[None], use_cache=False).loss
            keys = [(i, kind) for i in range(2) for kind in "kv"]
            weights = [_proj(model, i, kind).weight for i, kind in keys]
            grads.append(dict(zip(keys, torch.autograd.grad(loss, weights))))
    for i, f in enumerate(factors):
        for kind in "kv":
            for g, group in enumerate(f.groups[kind]):
                m, w = group.max_rank, group.up.shape[0]
                assert curves[i][kind].shape == (2, m + 1) and curves[i][kind].dtype == torch.float64
                assert curves[i][kind][g, m] == 0  # nothing cut
                for r in range(m):
                    cut = (group.up[:, r:].double() @ group.down[r:].double()).float()  # W − B_r A_r
                    change = torch.stack(
                        [(grad[(i, kind)][g * w : (g + 1) * w] * cut).sum() for grad in grads]
                    )
                    expected = 11 / 2 * float(change.double().square().mean())
                    assert float(curves[i][kind][g, r]) == pytest.approx(expected, rel=1e-3, abs=1e-12)


def test_kl_response_options_and_inputs_are_checked(make_tiny) -> None:
    for bad, match in (
        ({"labels": "gold"}, "labels must be one of"),
        ({"draws": 0}, "draws must be ≥ 1"),
        ({"labels": "data", "draws": 2}, "only makes sense with sampled"),
        ({"n_samples": 0}, "n_samples must be ≥ 1"),
        ({"tokens": 0}, "tokens must be ≥ 1 or null"),
    ):
        with pytest.raises(ValueError, match=match):
            STATISTICS.create({"name": "kl_response", **bad})
    assert KLResponse.uses_factors and not STATISTICS.create("gram").uses_factors
    model = make_tiny("llama", 2)
    rows = torch.randint(3, 61, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="collect it after decomposing"):
        KLResponse().collect(model, rows)
    factors = _factors(model, rows, group_size=1, rank_multiple=1, decomposition="plain")
    with pytest.raises(ValueError, match="factors of layers 0..1"):
        collect_kl_response(model, rows, factors[:1])


def test_the_curves_read_the_first_64_rows_by_default_and_all_of_fewer(make_tiny, one_thread) -> None:
    """``n_samples`` caps the rows (64 by default; a calibration with fewer is used whole, not refused, as a
    statistic that asks for more rows than there are is); ``None`` reads every row."""
    rows = torch.arange(70 * 4).reshape(70, 4)
    assert KLResponse().n_samples == 64 and KLResponse.caps_rows
    assert torch.equal(KLResponse().rows(rows), rows[:64])
    assert torch.equal(KLResponse().rows(rows[:5]), rows[:5])
    assert torch.equal(KLResponse(n_samples=None).rows(rows), rows)
    with pytest.raises(ValueError, match="asks for 64 calibration rows, the calibration has 5"):
        STATISTICS.create({"name": "gram", "n_samples": 64}).rows(rows[:5])
    model = make_tiny("llama", 2)
    calib = torch.randint(3, 61, (6, 8), generator=torch.Generator().manual_seed(0))
    factors = _factors(model, calib, group_size=1, rank_multiple=1, decomposition="plain")
    capped, meta = KLResponse(n_samples=4).collect(model, calib, factors=factors)
    first, _ = KLResponse(n_samples=None).collect(model, calib[:4], factors=factors)
    assert meta["n_rows"] == 4
    assert all(torch.equal(a[k], b[k]) for a, b in zip(capped, first) for k in "kv")


def test_long_rows_are_capped_at_the_tokens_of_64_rows_of_256() -> None:
    """``tokens`` caps the rows by what they hold: 64 rows of 256 tokens, 8 of 2,048, one row at least; the
    shards a conversion cuts the curves' pass into count the rows it reads."""
    assert KLResponse().tokens == 64 * 256
    assert [KLResponse().used_rows(64, t) for t in (256, 512, 2048, 8192, 32768)] == [64, 32, 8, 2, 1]
    assert KLResponse().used_rows(64) == 64  # the rows' length unknown: no cap
    assert KLResponse(tokens=None).used_rows(64, 2048) == 64
    assert KLResponse(n_samples=4).used_rows(64, 512) == 4
    rows = torch.arange(16 * 2048).reshape(16, 2048)
    assert torch.equal(KLResponse().rows(rows), rows[:8])
    assert KLResponse().max_shards(64, 2, 2048) == 8 and KLResponse().max_shards(64, 2) == 64


def test_kl_plans_from_the_curves_it_collected_after_decomposing(make_tiny, one_thread) -> None:
    """In memory: kl_response is collected after the factors (it reads them) and kl meets the budget,
    keeping the ranks whose cut the curves price highest."""
    model = make_tiny("llama", 2)
    rows = torch.randint(3, 61, (8, 16), generator=torch.Generator().manual_seed(0))
    conversion = plan_conversion(
        model,
        rows,
        CompressionConfig(ratio=0.5, group_size=1, rank_multiple=2, allocator="kl", refine={"steps": 0}),
    )  # the knapsack's own plan, before kl's default refinement
    plan = conversion.plan
    assert plan.kept == plan.budget_width == 32
    curves = [s.features["kl_curves"] for s in conversion.summaries]
    chosen = sum(
        float(c[kind][g][r])
        for c, layer in zip(curves, range(2))
        for kind in "kv"
        for g, r in enumerate(plan.ranks[kind][layer])
    )
    assert plan.details["kl_estimate"] == pytest.approx(chosen)
    uniform = sum(float(c[kind][g][4]) for c in curves for kind in "kv" for g in range(2))  # 4 of 8 each
    assert chosen <= uniform
