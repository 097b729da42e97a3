"""Activation PCA (Eigen Attention) for RoPE models: per-group value bases, one key basis per layer.

Math on a synthetic layer (Hkv=4 KV heads of D=4 rows, d=16 inputs, anisotropic activations X) in float64,
then end to end on tiny random Llamas through ``compress(..., method="pca")``.
"""

from __future__ import annotations

import pytest
import torch

from lrkv_core import load_compressed, save_compressed
from lrkv_core.cache import LatentCache, cache_kwargs
from lrkv_core.decompositions import LayerWeights, decompose_layer, load_layer_factors, save_layer_factors
from lrkv_core.linalg import GroupFactors, fit_shared_basis, group_slices, truncate, truncation_error
from lrkv_core.model.adapters import get_adapter

HKV, D, D_IN, N_TOKENS = 4, 4, 16, 600
GROUP_SIZES = (1, 2, HKV)


PALU = {
    "name": "whitened",
    "values": "projection",
    "keys": "projection",
}  # whitened SVD of the projections (Palu's)


def _activations(seed: int = 0) -> torch.Tensor:
    """(d, N) activations with per-direction scales spanning 3 decades, in a random basis."""
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(D_IN, D_IN, generator=gen, dtype=torch.float64))
    scales = torch.logspace(1, -2, D_IN, dtype=torch.float64)
    return basis @ (scales[:, None] * torch.randn(D_IN, N_TOKENS, generator=gen, dtype=torch.float64))


def _weights(n_kv: int = HKV, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(Hkv·D, d) k_proj and v_proj weights; heads differ, so their principal key directions differ."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n_kv * D, D_IN, generator=gen, dtype=torch.float64) for _ in range(2))


def _layer(method: str | dict, group_size: int, n_kv: int = HKV, x: torch.Tensor | None = None):
    x = _activations() if x is None else x
    w_k, w_v = _weights(n_kv)
    kw = dict(n_kv_heads=n_kv, head_dim=D, group_size=group_size, decomposition=method)
    return decompose_layer(0, LayerWeights(w_k, w_v), {"gram": x @ x.T}, **kw), w_k, w_v, x


def _product(f: GroupFactors, rank: int) -> torch.Tensor:
    a, b = truncate(f, rank)
    return b @ a  # (s·D, d)


def _act_err(w: torch.Tensor, f: GroupFactors, rank: int, x: torch.Tensor) -> float:
    """‖(W − W_r) X‖_F², the activation-weighted truncation error."""
    return float((((w - _product(f, rank)) @ x) ** 2).sum())


def _head_blocks(f: GroupFactors, s: int) -> list[torch.Tensor]:
    """Each head's block of ``up``: its rows, restricted to the columns that are nonzero there, in order."""
    blocks = []
    for h in range(s):
        rows = f.up[h * D : (h + 1) * D]  # (D, s·D)
        blocks.append(rows[:, rows.abs().sum(0) > 0])
    return blocks


# ------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_full_rank_factors_reproduce_every_group(group_size: int) -> None:
    layer, w_k, w_v, _ = _layer("pca", group_size)
    assert layer.method == "pca" and layer.info["key_basis"] == "shared per layer"
    eye = torch.eye(group_size * D, dtype=torch.float64)
    for kind, w in (("k", w_k), ("v", w_v)):
        for sl, f in zip(group_slices(HKV, D, group_size), layer.groups[kind], strict=True):
            assert f.max_rank == group_size * D and f.up.shape == (group_size * D,) * 2
            assert (f.up @ f.down - w[sl]).abs().max() <= 1e-10
            assert (f.up.T @ f.up - eye).abs().max() <= 1e-12  # orthonormal up: down = upᵀ W
            assert (f.sigma >= 0).all()


def test_singular_gram_needs_no_damping_and_stays_exact() -> None:
    """PCA never factors the Gram: a dead input feature and rank-deficient X change nothing at full rank."""
    x = _activations()[:, :6].clone()  # rank 6 < d
    x[3] = 0.0
    layer, w_k, w_v, _ = _layer("pca", 2, x=x)
    for kind, w in (("k", w_k), ("v", w_v)):
        for sl, f in zip(group_slices(HKV, D, 2), layer.groups[kind], strict=True):
            assert (f.up @ f.down - w[sl]).abs().max() <= 1e-10


def test_pca_needs_the_gram() -> None:
    w_k, w_v = _weights()
    with pytest.raises(ValueError, match="activation PCA needs the gram statistic"):
        decompose_layer(
            0, LayerWeights(w_k, w_v), n_kv_heads=HKV, head_dim=D, group_size=1, decomposition="pca"
        )
    with pytest.raises(ValueError, match="not finite"):
        zero = torch.zeros(D_IN, D_IN)
        decompose_layer(
            0,
            LayerWeights(w_k, w_v),
            {"gram": zero},
            n_kv_heads=HKV,
            head_dim=D,
            group_size=1,
            decomposition="pca",
        )


# ------------------------------------------------------------------------------------------------ values


@pytest.mark.parametrize("group_size", [1, 2])
def test_value_subspace_is_whitened_svds(group_size: int) -> None:
    """Eigenvectors of W G Wᵀ = left singular vectors of W S: the same product at every rank."""
    pca, _, w_v, _ = _layer("pca", group_size)
    whitened, *_ = _layer(PALU, group_size)
    for f, g in zip(pca.groups["v"], whitened.groups["v"], strict=True):
        assert torch.allclose(f.sigma, g.sigma, rtol=1e-9, atol=0)
        assert (f.sigma[:-1] >= f.sigma[1:]).all()
        for rank in range(1, f.max_rank + 1):
            assert (_product(f, rank) - _product(g, rank)).abs().max() <= 1e-9 * w_v.abs().max()


# -------------------------------------------------------------------------------------------------- keys


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_key_basis_is_shared_by_every_head(group_size: int) -> None:
    layer, w_k, _, x = _layer("pca", group_size)
    basis = fit_shared_basis(w_k, x @ x.T, D)  # (D, D)
    # U_k: eigenvectors of Σ_h W_h G W_hᵀ, largest first
    heads = w_k.view(HKV, D, D_IN)
    cov = sum(w @ x @ x.T @ w.T for w in heads)  # (D, D)
    evals = torch.linalg.eigvalsh(cov).flip(0)
    assert torch.allclose(cov @ basis, basis * evals, atol=1e-9 * evals[0])
    assert torch.allclose(basis.T @ basis, torch.eye(D, dtype=torch.float64), atol=1e-12)
    for f in layer.groups["k"]:
        blocks = _head_blocks(f, group_size)
        assert all(torch.equal(b, basis) for b in blocks)  # B_h = U_k, directions in order
        assert sum(b.shape[1] for b in blocks) == group_size * D  # block-diagonal: nothing off the blocks


@pytest.mark.parametrize("group_size", [2, HKV])
def test_key_latents_interleave_heads_direction_by_direction(group_size: int) -> None:
    """Latent j is direction j // s; within a direction, heads by captured variance (descending)."""
    layer, w_k, _, x = _layer("pca", group_size)
    basis = fit_shared_basis(w_k, x @ x.T, D)
    s = group_size
    for sl, f in zip(group_slices(HKV, D, s), layer.groups["k"], strict=True):
        heads = w_k[sl].view(s, D, D_IN)
        for j in range(s * D):
            h = int(f.up[:, j].abs().argmax()) // D  # the head whose block holds latent j
            i = j // s
            assert torch.equal(f.up[h * D : (h + 1) * D, j], basis[:, i])
            assert torch.allclose(f.down[j], basis[:, i] @ heads[h], atol=1e-12)
            captured = float(((basis[:, i] @ heads[h] @ x) ** 2).sum())  # v_{h,i}
            assert f.sigma[j] ** 2 == pytest.approx(captured, rel=1e-9)
        blocks = f.sigma.view(D, s)  # (direction, rank among heads)
        assert (blocks[:, :-1] >= blocks[:, 1:]).all()
        # each direction appears once per head: a prefix of k·s latents keeps k directions for every head
        assert sorted(int(f.up[:, j].abs().argmax()) // D for j in range(s)) == list(range(s))
    if s == HKV:  # one group holds every head: its direction energies are C_k's eigenvalues
        cov = sum(w @ x @ x.T @ w.T for w in w_k.view(HKV, D, D_IN))
        energy = (layer.groups["k"][0].sigma ** 2).view(D, s).sum(1)
        assert torch.allclose(energy, torch.linalg.eigvalsh(cov).flip(0), rtol=1e-9)


def test_single_head_key_error_is_the_sum_of_dropped_eigenvalues() -> None:
    """One KV head: the shared basis is that head's PCA; dropping directions costs their eigenvalues."""
    layer, w_k, _, x = _layer("pca", 1, n_kv=1)
    whitened, *_ = _layer(PALU, 1, n_kv=1)
    (f,) = layer.groups["k"]
    evals = torch.linalg.eigvalsh(w_k @ x @ x.T @ w_k.T).flip(0)  # (D,)
    for rank in range(1, D + 1):
        dropped = float(evals[rank:].sum())
        assert _act_err(w_k, f, rank, x) == pytest.approx(dropped, rel=1e-9, abs=1e-10 * float(evals[0]))
        assert truncation_error(f.sigma, rank) == pytest.approx(
            dropped, rel=1e-9, abs=1e-10 * float(evals[0])
        )
        assert torch.allclose(_product(f, rank), _product(whitened.groups["k"][0], rank), atol=1e-9)


@pytest.mark.parametrize("k", range(1, D))
def test_shared_key_basis_costs_at_least_the_per_head_optimum(k: int) -> None:
    """k shared directions per head ≥ each head's own best k (whitened, s=1) ≥ the joint best k·Hkv."""
    x = _activations()
    pca = {s: _layer("pca", s)[0] for s in GROUP_SIZES}
    per_head, w_k, _, _ = _layer(PALU, 1)
    joint, *_ = _layer(PALU, HKV)

    def total(layer, s: int, rank: int) -> float:
        slices = group_slices(HKV, D, s)
        return sum(_act_err(w_k[sl], f, rank, x) for sl, f in zip(slices, layer.groups["k"], strict=True))

    shared = total(pca[1], 1, k)
    optimum = total(per_head, 1, k)
    assert shared >= optimum * (1 - 1e-12)
    assert shared > 1.01 * optimum  # the heads' own principal directions really differ
    assert optimum >= total(joint, HKV, k * HKV) * (1 - 1e-12)
    # sigma keeps its meaning: the error of a prefix is the sum of the dropped σ²
    assert shared == pytest.approx(sum(truncation_error(f.sigma, k) for f in pca[1].groups["k"]), rel=1e-9)
    # ranks that are multiples of s keep the same k directions for every head, whatever the grouping
    for s in (2, HKV):
        assert total(pca[s], s, k * s) == pytest.approx(shared, rel=1e-9)
    # one more latent in a group of 2 adds direction k to the head that captures most along it
    basis = fit_shared_basis(w_k, x @ x.T, D)
    gains = [float(((basis[:, k] @ w @ x) ** 2).sum()) for w in w_k.view(HKV, D, D_IN)]
    expected = shared - max(gains[0:2]) - max(gains[2:4])
    assert total(pca[2], 2, 2 * k + 1) == pytest.approx(expected, rel=1e-9)


def test_layer_factors_roundtrip_through_safetensors(tmp_path) -> None:
    layer, *_ = _layer("pca", 2)
    save_layer_factors(layer, tmp_path / "pca.safetensors")
    back = load_layer_factors(tmp_path / "pca.safetensors")
    assert (back.method, back.group_size, back.info) == ("pca", 2, layer.info)
    for kind in ("k", "v"):
        for f, g in zip(layer.groups[kind], back.groups[kind], strict=True):
            assert torch.equal(f.sigma, g.sigma) and torch.equal(f.down, g.down) and torch.equal(f.up, g.up)


# ------------------------------------------------------------------------------------------ end to end


def _ids(batch: int, length: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(3, 61, (batch, length), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)


E2E = [("llama", 2, 1), ("llama", 2, 2), ("llama", 4, 2), ("llama", 4, 4), ("mistral", 2, 2)]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family,hkv,group_size", E2E, ids=[f"{f}-hkv{h}-s{s}" for f, h, s in E2E])
def test_full_rank_model_is_the_original(make_tiny, compress, family: str, hkv: int, group_size: int) -> None:
    ids = _ids(2, 12)
    model = make_tiny(family, hkv)
    comp, plan = compress(model, group_size, method="pca")
    assert plan.achieved_ratio == 1.0 and comp.config.lrkv["decomposition"] == {"name": "pca"}
    with torch.no_grad():
        assert (comp(ids).logits - model(ids).logits).abs().max() <= 1e-4
    model64 = make_tiny(family, hkv).double()
    comp64, _ = compress(model64, group_size, method="pca")
    with torch.no_grad():
        assert (comp64(ids).logits - model64(ids).logits).abs().max() <= 1e-10


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("group_size,multiple,ratio", [(1, 1, 0.5), (2, 2, 0.5), (2, 1, 0.5625)])
def test_truncated_model_runs_generates_and_roundtrips(
    make_tiny, compress, tmp_path, group_size: int, multiple: int, ratio: float
) -> None:
    """Ratio 0.5 (and an odd rank, 9 of 16, for a group of 2): decode through the cache, save, load."""
    model = make_tiny("llama", 2)
    comp, plan = compress(model, group_size, ratio=ratio, rank_multiple=multiple, method="pca")
    assert plan.achieved_ratio == ratio
    ids = _ids(2, 12)
    with torch.no_grad():
        full = comp(ids).logits
        out = comp(ids[:, :5], use_cache=True)
        steps = [out.logits]
        for t in range(5, 12):
            out = comp(ids[:, t : t + 1], **cache_kwargs(out.past_key_values), use_cache=True)
            steps.append(out.logits)
        ref = model(ids).logits
    assert isinstance(out.past_key_values, LatentCache)
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-5  # the cache path is exact
    assert (full - ref).abs().max() > 1e-2  # and truncation is real
    generated = _greedy(comp, ids[:, :5])
    assert generated.shape == (2, 13)
    loaded = load_compressed(save_compressed(comp, tmp_path / "m"))
    assert loaded.config.lrkv["decomposition"] == {"name": "pca"}
    assert loaded.config.lrkv["ranks_k"] == plan.ranks["k"]
    attn = get_adapter(loaded.config).attention(loaded, 0)
    assert attn.k_down.weight.shape[0] == sum(plan.ranks["k"][0])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, full)
    assert torch.equal(_greedy(loaded, ids[:, :5]), generated)
