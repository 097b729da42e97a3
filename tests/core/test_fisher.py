"""Empirical Fisher of k/v_proj: brute-force references, the double-shift bug, grouping, error curves, I/O."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lrkv_core.allocation import summarize_layer
from lrkv_core.allocation.features import fisher_group_sums, weighted_error_curve
from lrkv_core.conversion.convert import model_layer_weights
from lrkv_core.decompositions import decompose_layer
from lrkv_core.linalg import fit_group, truncation_error
from lrkv_core.statistics import Fisher, collect_fisher, load_statistic, read_header, save_statistic

pytestmark = pytest.mark.usefixtures("one_thread")


def group_sensitivity(fisher, group_width: int) -> list[dict]:
    return [fisher_group_sums(layer, group_width) for layer in fisher]


def _rows(n: int = 6, t: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 61, (n, t), generator=torch.Generator().manual_seed(seed))  # no pad/bos/eos ids


def _kv_weights(model) -> list[torch.Tensor]:
    return [
        w
        for layer in model.model.layers
        for w in (layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight)
    ]


def _squared_grads(model, losses) -> list[torch.Tensor]:
    """Brute force: mean over ``losses`` (scalar losses, one per sample) of the squared k/v weight grads."""
    weights = _kv_weights(model)
    for p in model.parameters():
        p.requires_grad_(True)
    acc, n = [torch.zeros_like(w, dtype=torch.float64) for w in weights], 0
    for loss in losses:
        for a, g in zip(acc, torch.autograd.grad(loss, weights)):
            a += g.double() ** 2
        n += 1
    return [a / n for a in acc]


def _shifted_once(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss with the shift written out by hand: logits at t score token t+1."""
    logits = model(batch, use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())


def _flat(fisher) -> list[torch.Tensor]:
    return [layer[kind] for layer in fisher for kind in "kv"]


def _assert_close(got: list[torch.Tensor], ref: list[torch.Tensor], rtol: float = 1e-5) -> None:
    # HF's loss upcasts logits to float32 (even from float64): agreement is at float32 level
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape
        assert (a.double() - b).abs().max() <= rtol * b.abs().max(), (a.double() - b).abs().max()


def test_per_row_fisher_equals_the_brute_force_reference(make_tiny) -> None:
    model = make_tiny("llama", 2).double()  # GQA: 4 query heads, 2 KV heads
    rows = _rows()
    fisher, n = collect_fisher(model, rows, batch_size=4, dtype=torch.float64)  # batches of 4 and 2
    assert (
        n == 6
        and len(fisher) == 2
        and fisher[0]["k"].shape == (16, 32)
        and fisher[0]["k"].dtype == torch.float64
    )
    ref = _squared_grads(model, (_shifted_once(model, row[None]) for row in rows))
    _assert_close(_flat(fisher), ref)
    assert all(f.min() >= 0 and f.max() > 0 for f in _flat(fisher))


def test_per_batch_fisher_is_palus_accumulation_without_the_extra_shift(make_tiny) -> None:
    model = make_tiny("llama", 2).double()
    rows = _rows(7)
    fisher, n = collect_fisher(model, rows, batch_size=3, per_row=False, dtype=torch.float64)
    assert n == 3  # batches of 3, 3, 1
    ref = _squared_grads(model, (_shifted_once(model, rows[s : s + 3]) for s in range(0, 7, 3)))
    _assert_close(_flat(fisher), ref)
    one_row, _ = collect_fisher(model, rows, batch_size=1, per_row=True, dtype=torch.float64)
    one_batch, _ = collect_fisher(model, rows, batch_size=1, per_row=False, dtype=torch.float64)
    _assert_close(_flat(one_row), [f.double() for f in _flat(one_batch)], rtol=1e-12)


def test_double_shift_gives_a_measurably_different_fisher(make_tiny) -> None:
    """Palu shifted the labels itself and the HF model shifted them again: it scores x[t+2] given x[..t]."""
    model = make_tiny("llama", 2).double()
    rows = _rows(8, 16)
    fisher, _ = collect_fisher(model, rows, batch_size=4, dtype=torch.float64)
    ours = _flat(fisher)
    reference = _squared_grads(model, (_shifted_once(model, row[None]) for row in rows))
    double_shift = _squared_grads(
        model, (model(input_ids=row[None, :-1], labels=row[None, 1:]).loss for row in rows)
    )
    _assert_close(ours, reference)
    for a, bug in zip(ours, double_shift, strict=True):
        assert (a.double() - bug).norm() > 0.2 * a.double().norm()  # not a rounding effect: a different loss
    # and it moves the per-group shares of the Fisher that the fisher allocator turns into ranks
    shares = _shares(group_sensitivity(fisher, 8))
    bug = _shares(
        group_sensitivity([{"k": double_shift[2 * i], "v": double_shift[2 * i + 1]} for i in range(2)], 8)
    )
    assert (shares - bug).abs().max() > 0.01 and (shares / bug - 1).abs().max() > 0.1


def _shares(sens) -> torch.Tensor:
    flat = torch.tensor([v for layer in sens for kind in "kv" for v in layer[kind]], dtype=torch.float64)
    return flat / flat.sum()


def test_only_kv_weights_get_gradients_and_the_model_is_restored(make_tiny) -> None:
    model = make_tiny("mistral", 1)  # MQA, the other adapter
    model.train()
    model.lm_head.weight.requires_grad_(False)
    before = {name: p.requires_grad for name, p in model.named_parameters()}
    seen = {}

    def spy(module, args, output):  # records, during collection, which parameters require grad
        seen.update({name: p.requires_grad for name, p in model.named_parameters()})
        seen["training"] = model.training

    handle = model.model.layers[1].mlp.register_forward_hook(spy)
    fisher, _ = collect_fisher(model, _rows(3), batch_size=2)
    handle.remove()
    assert seen.pop("training") is False  # eval mode (no dropout) while collecting
    assert {n for n, flag in seen.items() if flag} == {
        f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "kv"
    }
    assert {name: p.requires_grad for name, p in model.named_parameters()} == before
    assert model.training and all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())
    assert fisher[0]["v"].dtype == torch.float32 and fisher[0]["v"].shape == (8, 32)


def test_float32_accumulator_matches_float64(make_tiny) -> None:
    model = make_tiny("llama", 2)
    rows = _rows(4)
    f32, _ = collect_fisher(model, rows, batch_size=2, dtype=torch.float32)
    f64, _ = collect_fisher(model, rows, batch_size=2, dtype=torch.float64)
    _assert_close(_flat(f32), [f.double() for f in _flat(f64)], rtol=1e-5)
    with pytest.raises(ValueError, match="float32 or float64"):
        collect_fisher(model, rows, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="negative ids"):
        collect_fisher(model, torch.full((2, 5), -100))


def test_group_sensitivity_sums_each_groups_rows() -> None:
    fisher = [{"k": torch.arange(32.0).reshape(8, 4), "v": torch.ones(8, 4)}]
    sens = group_sensitivity(fisher, group_width=4)
    assert sens == [{"k": [float(sum(range(16))), float(sum(range(16, 32)))], "v": [16.0, 16.0]}]
    assert group_sensitivity(fisher, 8) == [{"k": [float(sum(range(32)))], "v": [32.0]}]
    with pytest.raises(ValueError, match="not a multiple of the group width"):
        group_sensitivity(fisher, 3)


def test_save_load_roundtrip(make_tiny, tmp_path) -> None:
    stat = Fisher(per_row=True)
    fisher, meta = stat.collect(make_tiny("llama", 2), _rows(2), batch_size=2)
    path = tmp_path / "fisher.safetensors"
    save_statistic(stat, fisher, meta, path)
    header = read_header(path)
    assert header["meta"] == {"n_samples": 2, "per_row": True} and header["layers"] == 2
    assert header["statistic"] == {"name": "fisher", "n_samples": None, "per_row": True}
    back = load_statistic(path)
    assert all(torch.equal(a, b) for a, b in zip(_flat(back), _flat(fisher), strict=True))
    assert torch.equal(load_statistic(path, layer=1)["v"], fisher[1]["v"])


def test_unit_fisher_error_curve_is_the_eckart_young_tail() -> None:
    w = torch.randn(12, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    factors = fit_group(w)  # plain SVD: Σ (W − W_r)² = Σ_{j≥r} σ_j²
    curve = weighted_error_curve(factors, torch.ones_like(w))
    expected = torch.tensor([truncation_error(factors.sigma, r) for r in range(13)], dtype=torch.float64)
    assert torch.allclose(curve, expected, rtol=1e-10, atol=1e-10) and curve[12] == 0


def test_weighted_error_curve_matches_direct_truncation_at_every_rank() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 24, generator=gen, dtype=torch.float64)
    weight = torch.rand(16, 24, generator=gen, dtype=torch.float64)
    factors = fit_group(w)
    curve = weighted_error_curve(factors, weight)
    assert curve.shape == (17,)
    for r in range(17):
        direct = (weight * (w - factors.up[:, :r] @ factors.down[:r]) ** 2).sum()
        assert curve[r] == pytest.approx(float(direct), rel=1e-10, abs=1e-10)


def test_fisher_error_curves_follow_the_group_slices(make_tiny) -> None:
    model = make_tiny("llama", 2)
    fisher, _ = collect_fisher(model, _rows(2), batch_size=2)
    kw = dict(n_kv_heads=2, head_dim=8, group_size=1, decomposition="plain")
    factors = decompose_layer(0, model_layer_weights(model, 0), **kw)
    summary = summarize_layer(factors, {"fisher": fisher[0]}, ["error_curves", "fisher_sums"])
    curves = summary.features["error_curves"]
    assert [len(curves[k]) for k in "kv"] == [2, 2]
    assert summary.features["fisher_sums"] == group_sensitivity(fisher[:1], 8)[0]
    g1 = factors.groups["v"][1]
    assert torch.equal(curves["v"][1], weighted_error_curve(g1, fisher[0]["v"][8:16]))
    assert curves["v"][1][0] == pytest.approx(
        float((fisher[0]["v"][8:16].double() * (g1.up @ g1.down) ** 2).sum())
    )
