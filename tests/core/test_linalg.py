"""Whitening, per-group SVD factors and truncation on nn.Linear(7, 5)-sized problems, in float64."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lrkv_core.conversion.convert import CompressionConfig, decompose_model
from lrkv_core.conversion.pipeline import decompose_file
from lrkv_core.decompositions import (
    DECOMPOSITIONS,
    LayerWeights,
    decompose_layer,
    load_layer_factors,
    save_layer_factors,
)
from lrkv_core.linalg import (
    fit_group,
    fit_output_metric,
    fit_whitening,
    group_slices,
    truncate,
    truncation_error,
    value_output_metrics,
)
from lrkv_core.statistics import Gram, collect_gram, save_statistic
from tests.support.models import tiny_model_dir

D_IN, D_OUT, N_TOKENS = 7, 5, 400
PALU = {
    "name": "whitened",
    "values": "projection",
    "keys": "projection",
}  # whitened SVD of the projections (Palu's)
RANKS = range(1, D_OUT + 1)


def _activations(seed: int = 0) -> torch.Tensor:
    """(d, N) anisotropic activations: per-direction scales spanning 3 decades, in a random basis."""
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(D_IN, D_IN, generator=gen, dtype=torch.float64))
    scales = torch.logspace(1, -2, D_IN, dtype=torch.float64)
    return basis @ (scales[:, None] * torch.randn(D_IN, N_TOKENS, generator=gen, dtype=torch.float64))


def _weight(seed: int = 1) -> torch.Tensor:
    """(5, 7) the weight of an nn.Linear(7, 5), in float64."""
    torch.manual_seed(seed)
    return torch.nn.Linear(D_IN, D_OUT).weight.detach().to(torch.float64)


def _fro2(m: torch.Tensor) -> float:
    return float((m**2).sum())


@pytest.mark.parametrize("whitened", [True, False], ids=["whitened", "plain"])
def test_full_rank_factors_reproduce_the_weight(whitened: bool) -> None:
    w, x = _weight(), _activations()
    f = fit_group(w, fit_whitening(x @ x.T) if whitened else None)
    assert f.max_rank == D_OUT and f.down.shape == (D_OUT, D_IN) and f.up.shape == (D_OUT, D_OUT)
    assert (f.up @ f.down - w).abs().max() <= 1e-10
    assert (f.up.T @ f.up - torch.eye(D_OUT, dtype=torch.float64)).abs().max() <= 1e-12  # orthonormal up
    assert (f.sigma[:-1] >= f.sigma[1:]).all()  # descending: truncations are prefixes


def test_whitening_factor_reproduces_the_gram() -> None:
    x = _activations()
    gram = x @ x.T
    wh = fit_whitening(gram)
    assert wh.method == "cholesky" and wh.damping == 0
    assert torch.allclose(wh.S @ wh.S.T, gram, rtol=0, atol=1e-10 * gram.abs().max())
    assert torch.allclose(wh.S @ wh.S_inv, torch.eye(D_IN, dtype=torch.float64), atol=1e-10)


def test_fp32_gram_is_fitted_in_float64() -> None:
    x = _activations()
    wh = fit_whitening((x @ x.T).float())
    assert wh.S.dtype == torch.float64 and wh.S_inv.dtype == torch.float64


@pytest.mark.parametrize("rank", RANKS)
def test_whitened_truncation_error_is_the_eckart_young_bound(rank: int) -> None:
    """‖(W − B_r A_r) S‖_F² = Σ_{i>r} σ_i², and (S Sᵀ = X Xᵀ) it is the activation-weighted error."""
    w, x = _weight(), _activations()
    wh = fit_whitening(x @ x.T)
    f = fit_group(w, wh)
    a, b = truncate(f, rank)
    err = w - b @ a  # (5, 7)
    bound = truncation_error(f.sigma, rank)
    scale = _fro2(w @ wh.S)
    assert _fro2(err @ wh.S) == pytest.approx(bound, rel=1e-9, abs=1e-12 * scale)
    assert _fro2(err @ x) == pytest.approx(bound, rel=1e-9, abs=1e-12 * scale)
    assert torch.allclose(f.sigma, torch.linalg.svdvals(w @ wh.S), rtol=1e-12)


@pytest.mark.parametrize("rank", RANKS)
def test_plain_truncation_error_is_its_own_bound(rank: int) -> None:
    w = _weight()
    f = fit_group(w, None)
    a, b = truncate(f, rank)
    assert torch.allclose(f.sigma, torch.linalg.svdvals(w), rtol=1e-12)
    assert _fro2(w - b @ a) == pytest.approx(truncation_error(f.sigma, rank), rel=1e-9, abs=1e-24)


@pytest.mark.parametrize("rank", range(1, D_OUT))
def test_whitened_beats_plain_svd_on_anisotropic_activations(rank: int) -> None:
    """SVD-LLM Thm. 1: the whitened rank-r factors minimise ‖(W − W_r) X‖_F; plain SVD is measurably worse."""
    w, x = _weight(), _activations()
    a_w, b_w = truncate(fit_group(w, fit_whitening(x @ x.T)), rank)
    a_p, b_p = truncate(fit_group(w, None), rank)
    err_whitened = _fro2((w - b_w @ a_w) @ x)
    err_plain = _fro2((w - b_p @ a_p) @ x)
    assert err_whitened < 0.9 * err_plain, (err_whitened, err_plain)
    # and no other rank-r map does better: random rank-r products never beat it
    gen = torch.Generator().manual_seed(rank)
    for _ in range(20):
        q, _ = torch.linalg.qr(torch.randn(D_OUT, rank, generator=gen, dtype=torch.float64))  # (5, r)
        assert _fro2((w - q @ q.T @ w) @ x) >= err_whitened * (1 - 1e-12)


def _output_metric(seed: int = 4) -> torch.Tensor:
    """(5, 5) an anisotropic PSD metric on the outputs, as ``W̄ᵀ W̄`` of a (9, 5) map."""
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(9, D_OUT, generator=gen, dtype=torch.float64) * torch.logspace(0, -2, D_OUT)
    return o.T @ o


@pytest.mark.parametrize("rank", RANKS)
def test_output_metric_truncation_is_optimal_in_the_two_sided_error(rank: int) -> None:
    """With an output metric M = R², the rank-r factors minimise ‖R (W − W_r) X‖_F, which equals the tail
    Σ_{i>r} σ_i² of R W S's spectrum: below the whitened factors' error in that metric and below any other
    rank-r map's; exact at full rank."""
    w, x, metric = _weight(), _activations(), _output_metric()
    wh, out = fit_whitening(x @ x.T), fit_output_metric(metric)
    assert torch.allclose(out.root @ out.root, metric, rtol=1e-10, atol=1e-12 * float(metric.abs().max()))
    f = fit_group(w, wh, out)
    a, b = truncate(f, rank)

    def cost(err: torch.Tensor) -> float:
        return float(torch.einsum("in,ij,jn->", err @ x, metric, err @ x))

    err = cost(w - b @ a)
    assert err == pytest.approx(truncation_error(f.sigma, rank), rel=1e-9, abs=1e-12 * cost(w))
    assert torch.allclose(f.sigma, torch.linalg.svdvals(out.root @ w @ wh.S), rtol=1e-12)
    assert torch.allclose(b.T @ metric @ b, torch.eye(rank, dtype=torch.float64), atol=1e-9)
    if rank == D_OUT:
        assert (b @ a - w).abs().max() <= 1e-10
        return
    a_w, b_w = truncate(fit_group(w, wh), rank)
    assert err < cost(w - b_w @ a_w)  # the whitened factors minimise another error
    gen = torch.Generator().manual_seed(rank)
    for _ in range(20):  # no other rank-r map B' A' (least-squares A' for a random B') does better
        bq = torch.randn(D_OUT, rank, generator=gen, dtype=torch.float64)
        aq = torch.linalg.lstsq(out.root @ bq, out.root @ w).solution
        assert cost(w - bq @ aq) >= err * (1 - 1e-12)


def test_value_output_metric_is_what_o_proj_makes_of_a_value_error() -> None:
    """GQA, 6 query heads on 2 KV heads of D = 3: a change δ of KV head j's value moves the attention output
    (heads weighing the row alike) by Σ_h W_o,h δ over j's query heads; its squared norm is δᵀ M_j δ."""
    gen = torch.Generator().manual_seed(5)
    d, h, hkv, head_dim = 8, 6, 2, 3
    o_weight = torch.randn(d, h * head_dim, generator=gen, dtype=torch.float64)
    metrics = value_output_metrics(o_weight.float(), hkv, head_dim)
    assert metrics.shape == (hkv, head_dim, head_dim) and metrics.dtype == torch.float64
    for j in range(hkv):
        delta = torch.randn(head_dim, generator=gen, dtype=torch.float64)
        heads = torch.zeros(h, head_dim, dtype=torch.float64)
        heads[j * 3 : (j + 1) * 3] = delta  # query heads 3j..3j+2 read KV head j
        moved = o_weight @ heads.flatten()
        assert float(delta @ metrics[j] @ delta) == pytest.approx(float(moved @ moved), rel=1e-5)
    with pytest.raises(ValueError, match="not a multiple of Hkv·D"):
        value_output_metrics(o_weight[:, :-1], hkv, head_dim)


def test_output_metric_rejects_a_zero_metric_and_stays_invertible_when_singular() -> None:
    with pytest.raises(ValueError, match="output metric is zero"):
        fit_output_metric(torch.zeros(3, 3))
    singular = torch.diag(torch.tensor([4.0, 1.0, 0.0], dtype=torch.float64))
    out = fit_output_metric(singular)
    assert torch.isfinite(out.inv_root).all()
    assert torch.allclose(out.root @ out.inv_root, torch.eye(3, dtype=torch.float64), atol=1e-9)
    w, x = _weight()[:3], _activations()
    f = fit_group(w, fit_whitening(x @ x.T), out)  # exact at full rank, though M ignores a direction
    assert (f.up @ f.down - w).abs().max() <= 1e-8


def test_error_is_monotone_in_rank_and_zero_at_full_rank() -> None:
    x = _activations()
    f = fit_group(_weight(), fit_whitening(x @ x.T))
    errors = [truncation_error(f.sigma, r) for r in RANKS]
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] == 0.0
    assert truncation_error(f.sigma, 0) == pytest.approx(float((f.sigma**2).sum()))


def test_singular_gram_takes_the_damping_path_and_stays_exact_at_full_rank() -> None:
    """A dead input feature and rank-deficient activations: plain Cholesky fails, damping succeeds."""
    x = _activations()[:, :3].clone()  # rank 3 < d
    x[2] = 0.0  # feature 2 is never active: an exactly zero pivot
    gram = x @ x.T
    assert not int(torch.linalg.cholesky_ex(gram).info) == 0  # the premise: plain Cholesky fails
    wh = fit_whitening(gram)
    assert wh.method == "cholesky+damping" and wh.damping > 0
    w = _weight()
    f = fit_group(w, wh)
    assert (f.up @ f.down - w).abs().max() <= 1e-10
    kw = dict(n_kv_heads=1, head_dim=D_OUT, group_size=1, decomposition=PALU)
    layer = decompose_layer(0, LayerWeights(w, w), {"gram": gram}, **kw)
    assert layer.info == {"whitening": "cholesky+damping", "damping": wh.damping}


def test_indefinite_gram_falls_back_to_eigh() -> None:
    gram = torch.diag(torch.tensor([10.0] * (D_IN - 1) + [-5.0], dtype=torch.float64))  # beyond any damping
    wh = fit_whitening(gram)
    assert wh.method == "eigh"
    assert torch.allclose(wh.S @ wh.S_inv, torch.eye(D_IN, dtype=torch.float64), atol=1e-8)
    w = _weight()
    f = fit_group(w, wh)
    assert (f.up @ f.down - w).abs().max() <= 1e-10


@pytest.mark.parametrize(
    "gram",
    [
        torch.zeros(D_IN, D_IN),
        torch.full((D_IN, D_IN), float("nan")),
        torch.eye(D_IN).index_put_((torch.tensor([1]), torch.tensor([3])), torch.tensor(float("inf"))),
    ],
    ids=["zero", "nan", "inf"],
)
def test_empty_or_non_finite_gram_raises(gram: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="not finite"):
        fit_whitening(gram)


def test_group_slices_split_rows_per_group_of_kv_heads() -> None:
    assert group_slices(4, 3, 1) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
    assert group_slices(4, 3, 2) == [slice(0, 6), slice(6, 12)]
    assert group_slices(4, 3, 4) == [slice(0, 12)]


@pytest.mark.parametrize("group_size", [0, 3, 5, -1])
def test_group_size_must_divide_kv_heads(group_size: int) -> None:
    with pytest.raises(ValueError, match=r"must divide the number of KV heads \(4\).*valid: \[1, 2, 4\]"):
        group_slices(4, 8, group_size)


def test_truncate_bounds() -> None:
    f = fit_group(_weight(), None)
    a, b = truncate(f, 2)
    assert a.shape == (2, D_IN) and b.shape == (D_OUT, 2)
    assert torch.equal(a, f.down[:2]) and torch.equal(b, f.up[:, :2])  # a prefix of the full spectrum
    truncate(f, D_OUT)
    for bad in (0, -1, D_OUT + 1):
        with pytest.raises(ValueError, match=f"rank {bad} outside 1..{D_OUT}"):
            truncate(f, bad)


@pytest.mark.parametrize(
    "method",
    [*sorted(DECOMPOSITIONS.names()), PALU, {"name": "whitened", "values": "output", "keys": "projection"}],
    ids=str,
)
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_decompose_layer_factors_each_group_exactly(method: str | dict, group_size: int) -> None:
    """Hkv=4 heads of D=3 rows from d=7 inputs (8 query heads for o_proj); group width s·D may exceed d
    (then the SVDs' max rank is d; pca's factors stay square, max rank s·D, the extra directions carrying
    zero variance)."""
    gen = torch.Generator().manual_seed(2)
    w_k, w_v = (torch.randn(12, D_IN, generator=gen) for _ in range(2))
    w_o = torch.randn(D_IN, 24, generator=gen)
    x, mixed = _activations(), _activations(seed=5)
    g = torch.randn(12, 40, generator=gen, dtype=torch.float64)  # stands in for the k/v output gradients
    stats = {
        "gram": x @ x.T,
        "attention_gram": mixed @ mixed.T,
        "output_fisher": {"k": g @ g.T, "v": g @ g.T},
    }
    layer = decompose_layer(
        3, LayerWeights(w_k, w_v, o=w_o), stats, n_kv_heads=4, head_dim=3, group_size=group_size,
        decomposition=method,
    )  # fmt: skip
    name = method if isinstance(method, str) else method["name"]
    assert layer.layer == 3 and layer.group_size == group_size and layer.method == name
    for kind, w in (("k", w_k), ("v", w_v)):
        groups = layer.groups[kind]
        assert len(groups) == 4 // group_size
        for sl, f in zip(group_slices(4, 3, group_size), groups, strict=True):
            assert f.max_rank == (group_size * 3 if name == "pca" else min(group_size * 3, D_IN))
            assert (f.up @ f.down - w[sl].double()).abs().max() <= 1e-10


def test_decompose_layer_rejects_unknown_method_and_missing_gram() -> None:
    w = _weight()
    kw = dict(n_kv_heads=1, head_dim=D_OUT, group_size=1)
    with pytest.raises(ValueError, match="unknown decomposition 'palu'"):
        decompose_layer(0, LayerWeights(w, w), decomposition="palu", **kw)
    with pytest.raises(ValueError, match="whitened SVD needs the gram statistic"):
        decompose_layer(0, LayerWeights(w, w), decomposition="whitened", **kw)
    output = {"name": "whitened", "values": "output", "keys": "projection"}
    with pytest.raises(ValueError, match="values must be one of projection, output, attention, got 'o_proj'"):
        decompose_layer(0, LayerWeights(w, w), decomposition={"name": "whitened", "values": "o_proj"}, **kw)
    x = _activations()
    with pytest.raises(ValueError, match="reads o_proj's weight"):
        decompose_layer(0, LayerWeights(w, w), {"gram": x @ x.T}, decomposition=output, **kw)
    attention = {"name": "whitened", "values": "attention", "keys": "projection"}
    with pytest.raises(ValueError, match="values='attention' needs the attention_gram statistic"):
        decompose_layer(0, LayerWeights(w, w, o=w.T), {"gram": x @ x.T}, decomposition=attention, **kw)
    plain = decompose_layer(0, LayerWeights(w, w), decomposition="plain", **kw)
    assert plain.info == {"whitening": "none", "damping": 0}


def test_layer_factors_roundtrip_through_safetensors(tmp_path) -> None:
    gen = torch.Generator().manual_seed(3)
    w_k, w_v = (torch.randn(8, D_IN, generator=gen) for _ in range(2))
    x = _activations()
    kw = dict(n_kv_heads=2, head_dim=4, group_size=1, decomposition=PALU)
    layer = decompose_layer(1, LayerWeights(w_k, w_v), {"gram": x @ x.T}, **kw)
    save_layer_factors(layer, tmp_path / "layer1.safetensors")
    back = load_layer_factors(tmp_path / "layer1.safetensors")
    assert (back.layer, back.group_size, back.method, back.info) == (1, 1, "whitened", layer.info)
    for kind in ("k", "v"):
        for f, g in zip(layer.groups[kind], back.groups[kind], strict=True):
            assert torch.equal(f.sigma, g.sigma) and torch.equal(f.down, g.down) and torch.equal(f.up, g.up)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_the_pipeline_reads_o_proj_for_values_measured_after_it(tmp_path, arch) -> None:
    """``decompose_file`` (the flow's path, weights read from safetensors) gives the factors the in-memory
    ``decompose_model`` gives, for a decomposition that reads o_proj (GQA: 4 query heads, 2 KV heads; Phi-3:
    k and v read as rows of the fused qkv_proj)."""
    model_dir = tiny_model_dir(tmp_path, arch, 2)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = torch.randint(3, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    grams, n = collect_gram(model, rows)
    save_statistic(Gram(), grams, {"n_tokens": n}, tmp_path / "gram.safetensors")
    method = {"name": "whitened", "values": "output", "keys": "projection"}
    config = CompressionConfig(group_size=2, decomposition=method)
    in_memory, _ = decompose_model(model, statistics={"gram": grams}, config=config)
    for layer, expected in enumerate(in_memory):
        out = tmp_path / f"f{layer}.safetensors"
        decompose_file(
            str(model_dir), {"gram": str(tmp_path / "gram.safetensors")}, layer, str(out), group_size=2,
            decomposition=method,
        )  # fmt: skip
        got = load_layer_factors(out)
        for kind in ("k", "v"):
            for a, b in zip(got.groups[kind], expected.groups[kind], strict=True):
                torch.testing.assert_close(a.up, b.up, rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(a.down, b.down, rtol=1e-9, atol=1e-9)
    config = CompressionConfig(group_size=2, decomposition=PALU)
    projection = decompose_model(model, statistics={"gram": grams}, config=config)[0]
    assert not torch.allclose(projection[0].groups["v"][0].up, in_memory[0].groups["v"][0].up)
    torch.testing.assert_close(projection[0].groups["k"][0].up, in_memory[0].groups["k"][0].up)
