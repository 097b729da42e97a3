"""The ``output_fisher`` statistic and the keys it weighs (``whitened`` with ``keys="fisher"``)."""

from __future__ import annotations

import pytest
import torch

from lrkv_core.decompositions import LayerWeights, decompose_layer
from lrkv_core.decompositions.whitened import KEY_FISHER_DAMPING, key_metric
from lrkv_core.statistics import STATISTICS, collect_output_fisher


def _direct(model, rows: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Σ_t g_t g_tᵀ by autograd, one row at a time: g_t the gradient of the row's summed next-token loss at
    each k/v_proj output at position t."""
    sums = [{} for _ in model.model.layers]
    for row in rows:
        outputs = {}
        handles = [
            getattr(layer.self_attn, f"{kind}_proj").register_forward_hook(
                lambda _m, _a, out, key=(i, kind), into=outputs: into.__setitem__(key, out)
            )
            for i, layer in enumerate(model.model.layers)
            for kind in "kv"
        ]
        try:
            logits = model(input_ids=row[None], use_cache=False).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum")
            keys = list(outputs)
            grads = torch.autograd.grad(loss, [outputs[k] for k in keys])
        finally:
            for h in handles:
                h.remove()
        for (i, kind), g in zip(keys, grads, strict=True):
            g = g[0].double()
            sums[i][kind] = sums[i].get(kind, 0) + g.T @ g
    return sums


def test_output_fisher_sums_each_positions_gradient_outer_product(make_tiny, one_thread) -> None:
    """With the rows' own tokens as targets, the statistic is the per-position outer products of the summed
    loss's gradient, whatever the batch size (gradients of the batch mean are rescaled to the rows' sums)."""
    model = make_tiny("llama", 2)  # L=2, Hkv=2, D=8
    rows = torch.randint(3, 61, (3, 12), generator=torch.Generator().manual_seed(0))
    expected = _direct(model, rows)
    for batch_size in (1, 2):
        sums, n = collect_output_fisher(model, rows, batch_size=batch_size, sampled=False)
        assert n == 3 * 11
        for got, want in zip(sums, expected, strict=True):
            for kind in "kv":
                assert got[kind].shape == (16, 16) and got[kind].dtype == torch.float64
                assert (got[kind] - want[kind]).abs().max() <= 1e-5 * want[kind].abs().max()
    assert all(p.requires_grad for p in model.parameters())  # flags restored


def test_output_fisher_sampled_targets_are_seeded(make_tiny, one_thread) -> None:
    model = make_tiny("llama", 2)
    rows = torch.randint(3, 61, (4, 10), generator=torch.Generator().manual_seed(1))
    stat = STATISTICS.create({"name": "output_fisher"})
    a, meta = stat.collect(model, rows, batch_size=2)
    b, _ = stat.collect(model, rows, batch_size=2)
    c, _ = STATISTICS.create({"name": "output_fisher", "seed": 1}).collect(model, rows, batch_size=2)
    assert meta == {"n_tokens": 4 * 9, "labels": "sampled"}
    assert torch.equal(a[0]["k"], b[0]["k"]) and not torch.equal(a[0]["k"], c[0]["k"])
    with pytest.raises(ValueError, match="output_fisher labels must be one of"):
        STATISTICS.create({"name": "output_fisher", "labels": "model"})


def test_output_fisher_reads_the_first_128_rows_by_default(make_tiny, one_thread) -> None:
    """By default the first 128 calibration rows (a smaller calibration whole, no error); ``None``: all."""
    stat = STATISTICS.create("output_fisher")
    assert stat.used_rows(256, 256) == 128 and stat.used_rows(64, 2048) == 64
    assert STATISTICS.create({"name": "output_fisher", "n_samples": None}).used_rows(256, 256) == 256
    model = make_tiny("llama", 2)
    rows = torch.randint(3, 61, (130, 4), generator=torch.Generator().manual_seed(1))
    values, meta = stat.collect(model, rows, batch_size=65)
    first, _ = STATISTICS.create({"name": "output_fisher", "n_samples": None}).collect(
        model, rows[:128], batch_size=64
    )
    assert meta["n_tokens"] == 128 * 3
    # float32 sums in batches of 65 and 64: equal to ~2e-7 of the matrix's scale (rows 129-130 would move it
    # by ~6e-3 of it); entries far below the scale differ relatively more (1.4e-4 measured with AVX-512)
    scale = first[0]["k"].abs().max()
    assert torch.allclose(values[0]["k"], first[0]["k"], rtol=1e-4, atol=1e-6 * scale)


def test_fisher_keys_minimise_the_kronecker_loss_proxy() -> None:
    """Keys cut to rank r with ``keys="fisher"`` minimise ``tr(δW G δWᵀ M)`` (the K-FAC loss change, G the
    input Gram, M the output Fisher scaled to mean eigenvalue 1 and damped by ``KEY_FISHER_DAMPING``): it
    equals the dropped squared singular values of ``R W S`` (``RᵀR = M``), and Palu's keys
    (``keys="projection"``) leave more of it, damped or not; the values are untouched by the option."""
    gen = torch.Generator().manual_seed(4)
    d, hkv, D, n = 12, 2, 4, 200
    x = (
        torch.randn(d, n, generator=gen, dtype=torch.float64)
        * torch.logspace(0, -2, d, dtype=torch.float64)[:, None]
    )
    g = (
        torch.randn(hkv * D, n, generator=gen, dtype=torch.float64)
        * torch.logspace(1, -1, hkv * D, dtype=torch.float64)[:, None]
    )
    w_k, w_v = (torch.randn(hkv * D, d, generator=gen, dtype=torch.float64) for _ in range(2))
    G, M = x @ x.T, g @ g.T
    stats = {"gram": G, "output_fisher": {"k": M, "v": torch.eye(hkv * D, dtype=torch.float64)}}
    kw = dict(n_kv_heads=hkv, head_dim=D, group_size=hkv)
    fisher = decompose_layer(
        0, LayerWeights(w_k, w_v), stats, decomposition={"name": "whitened", "values": "projection"}, **kw
    )
    palu = decompose_layer(
        0,
        LayerWeights(w_k, w_v),
        stats,
        decomposition={"name": "whitened", "values": "projection", "keys": "projection"},
        **kw,
    )
    damped = M / (M.trace() / M.shape[0]) + KEY_FISHER_DAMPING * torch.eye(M.shape[0], dtype=M.dtype)
    R = torch.linalg.cholesky(damped).T  # any square root: RᵀR = M
    sigma = torch.linalg.svdvals(R @ w_k @ torch.linalg.cholesky(G))
    for r in (2, 4, 6):

        def proxy(f, metric, r=r):
            dw = w_k - f.up[:, :r] @ f.down[:r]
            return float(torch.trace(dw @ G @ dw.T @ metric))

        (kf,), (kp,) = fisher.groups["k"], palu.groups["k"]
        assert proxy(kf, damped) == pytest.approx(float(sigma[r:].square().sum()), rel=1e-8)
        assert proxy(kf, damped) < proxy(kp, damped) and proxy(kf, M) < proxy(kp, M)
    assert torch.allclose(fisher.groups["k"][0].up @ fisher.groups["k"][0].down, w_k, atol=1e-10)
    assert torch.equal(fisher.groups["v"][0].down, palu.groups["v"][0].down)
    with pytest.raises(ValueError, match="keys='fisher' needs the output_fisher statistic"):
        decompose_layer(
            0,
            LayerWeights(w_k, w_v),
            {"gram": G},
            decomposition={"name": "whitened", "values": "projection"},
            **kw,
        )
    with pytest.raises(ValueError, match="keys must be one of projection, fisher, got 'loss'"):
        decompose_layer(
            0, LayerWeights(w_k, w_v), stats, decomposition={"name": "whitened", "keys": "loss"}, **kw
        )
    with pytest.raises(ValueError, match="output Fisher is zero or not finite: no gradient reached k_proj"):
        key_metric(torch.zeros(4, 4, dtype=torch.float64))
