"""Eigen Attention's non-RoPE path (OPT): one key basis from the joint K∪Q output covariance."""

import pytest
import torch
from transformers import OPTForCausalLM

from lrkv_core.allocation import allocate_ranks
from lrkv_core.conversion.pipeline import decompose_file
from lrkv_core.decompositions import load_layer_factors
from lrkv_core.model.adapters import get_adapter
from lrkv_core.model.fuse import compress_model
from lrkv_core.statistics import Gram, collect_gram, save_statistic
from tests.support.models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _opt(tmp_path):
    model = tiny_model("opt")
    model.save_pretrained(tmp_path / "opt")
    rows = torch.randint(3, 61, (8, 24), generator=torch.Generator().manual_seed(1))
    grams, n = collect_gram(model, rows)
    save_statistic(Gram(), grams, {"n_tokens": n}, tmp_path / "stats.safetensors")
    return model


def _top_eigvec(cov: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigh(cov)[1][:, -1]


def test_opt_pca_key_basis_is_the_joint_k_q_basis_and_exact(tmp_path):
    model = _opt(tmp_path)
    adapter = get_adapter(model.config)
    shape = adapter.shape(model.config)
    paths = []
    for layer in range(shape.L):
        out = tmp_path / f"f{layer}.safetensors"
        info = decompose_file(
            str(tmp_path / "opt"),
            {"gram": str(tmp_path / "stats.safetensors")},
            layer,
            str(out),
            group_size=1,
            decomposition="pca",
        )
        assert info["info"]["key_basis"] == "joint K and Q, shared per layer"
        paths.append(out)
    factors = [load_layer_factors(p) for p in paths]

    attn = adapter.attention(model, 0)
    gram = collect_gram(model, torch.randint(3, 61, (8, 24), generator=torch.Generator().manual_seed(1)))[0][
        0
    ]
    w_k = attn.k_proj.weight.detach().double().view(shape.H, shape.D, -1)
    w_q = attn.q_proj.weight.detach().double().view(shape.H, shape.D, -1)
    cov_k = torch.einsum("hik,kl,hjl->ij", w_k, gram, w_k)
    cov_q = torch.einsum("hik,kl,hjl->ij", w_q, gram, w_q)
    u = factors[0].groups["k"][0].up[:, 0]  # the most important shared key direction of head 0
    joint, k_only = _top_eigvec(cov_k + cov_q), _top_eigvec(cov_k)
    assert abs(float(u @ joint)) > 1 - 1e-8  # the joint basis (up to sign)
    assert abs(float(joint @ k_only)) < 0.999  # and not the K-only one: Q really enters
    for g in range(shape.Hkv):  # shared by every head
        torch.testing.assert_close(factors[0].groups["k"][g].up, factors[0].groups["k"][0].up)

    plan = allocate_ranks(
        [f.spectra() for f in factors], ratio=1.0, group_size=1, head_dim=shape.D, rank_multiple=1
    )
    original = OPTForCausalLM.from_pretrained(tmp_path / "opt").eval()
    compressed = compress_model(original, factors, plan, decomposition={"name": "pca"})
    ids = torch.randint(3, 61, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(ids).logits - compressed(ids).logits).abs().max() < 1e-4
