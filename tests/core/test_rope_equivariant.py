"""The RoPE-equivariant basis of a group's keys: complete at full rank, commuting with RoPE at every even
rank, the frequencies a hand-worked Gram says to keep, and the queries' weighting lowering the scores'
error."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import rotate_half

from lrkv_core.decompositions.rope_equivariant import rope_equivariant_factors

S, D = 3, 8  # a group of three heads of 8 dims


def _rope(k: torch.Tensor, position: float, rotary: int = D) -> torch.Tensor:
    """RoPE at one position on keys (N, S·D) laid out head after head (transformers' rotate_half pairs), on
    the first ``rotary`` dims of each head (the rest pass through, as partial rotary embeddings do)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
    angle = torch.cat([inv_freq, inv_freq]) * position  # (rotary,)
    x = k.view(-1, S, D)
    x_rot = x[..., :rotary] * angle.cos() + rotate_half(x[..., :rotary]) * angle.sin()
    return torch.cat([x_rot, x[..., rotary:]], dim=-1).reshape(k.shape)


def _grams(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(S * D, S * D, generator=gen, dtype=torch.float64)
    keys = torch.randn(400, S * D, generator=gen, dtype=torch.float64) @ mix * torch.linspace(3, 0.1, S * D)
    queries = torch.randn(400, S * D, generator=gen, dtype=torch.float64) * torch.linspace(0.2, 4, S * D)
    return keys, keys.T @ keys, (queries**2).sum(0)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "query-weighted"])
def test_full_rank_is_the_identity_and_every_even_rank_commutes_with_rope(weighted) -> None:
    keys, gram, q_energy = _grams()
    f = rope_equivariant_factors(gram, S, D, q_energy if weighted else None)
    assert torch.allclose(f.up @ f.down, torch.eye(S * D, dtype=torch.float64), atol=1e-9)
    for r in (2, 6, 12, 20):
        M = f.up[:, :r] @ f.down[:r]
        for position in (1.0, 37.0, 5000.0):
            assert torch.allclose(_rope(keys[:5] @ M.T, position), _rope(keys[:5], position) @ M.T, atol=1e-9)
    # an odd rank splits a complex latent: no longer equivariant
    M = f.up[:, :5] @ f.down[:5]
    assert not torch.allclose(_rope(keys[:5] @ M.T, 37.0), _rope(keys[:5], 37.0) @ M.T, atol=1e-6)
    assert torch.all(f.sigma[0::2] == f.sigma[1::2]) and torch.all(f.sigma[:-2:2] >= f.sigma[2::2])


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "query-weighted"])
def test_with_partial_rotary_embeddings_the_passing_dims_get_a_basis_of_their_own(weighted) -> None:
    """RoPE on the first 4 of each head's 8 dims: full rank is the identity, every even rank commutes with
    partial RoPE (not with RoPE over the whole head, which the basis mixes across), units stay whole."""
    keys, gram, q_energy = _grams(seed=3)
    f = rope_equivariant_factors(gram, S, D, q_energy if weighted else None, rotary_dim=4)
    assert torch.allclose(f.up @ f.down, torch.eye(S * D, dtype=torch.float64), atol=1e-9)
    for r in (2, 6, 12, 20):
        M = f.up[:, :r] @ f.down[:r]
        for position in (1.0, 37.0, 5000.0):
            want = _rope(keys[:5], position, rotary=4) @ M.T
            assert torch.allclose(_rope(keys[:5] @ M.T, position, rotary=4), want, atol=1e-9)
    M = f.up[:, :12] @ f.down[:12]
    assert not torch.allclose(_rope(keys[:5] @ M.T, 37.0), _rope(keys[:5], 37.0) @ M.T, atol=1e-6)
    assert torch.all(f.sigma[0::2] == f.sigma[1::2]) and torch.all(f.sigma[:-2:2] >= f.sigma[2::2])


def test_a_hand_worked_gram_with_a_passing_dim_pair_ranks_it_by_its_energy() -> None:
    """One head of 4 dims, RoPE on dims 0 and 1 (one frequency); dims 2 and 3 pass through with energies 9
    and 4. Their unit (13) outranks the frequency's (1 + 1 = 2): rank 2 keeps exactly dims 2 and 3."""
    gram = torch.diag(torch.tensor([1.0, 1.0, 9.0, 4.0], dtype=torch.float64))
    f = rope_equivariant_factors(gram, 1, 4, rotary_dim=2)
    P = f.up[:, :2] @ f.down[:2]
    assert torch.allclose(P, torch.diag(torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64)), atol=1e-12)
    assert torch.allclose(f.sigma, torch.tensor([6.5, 6.5, 1.0, 1.0], dtype=torch.float64).sqrt())


def test_the_frequencies_kept_are_those_a_hand_worked_gram_names() -> None:
    """One head of 4 dims: pairs (0, 2) and (1, 3). Energy 5 + 5 at the first frequency, 1 + 1 at the
    second: rank 2 keeps exactly the first pair, and its latents carry √5 each."""
    gram = torch.diag(torch.tensor([5.0, 1.0, 5.0, 1.0], dtype=torch.float64))
    f = rope_equivariant_factors(gram, 1, 4)
    P = f.up[:, :2] @ f.down[:2]
    assert torch.allclose(P, torch.diag(torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)), atol=1e-12)
    assert torch.allclose(f.sigma, torch.tensor([5.0, 5.0, 1.0, 1.0], dtype=torch.float64).sqrt())


def test_the_queries_weighting_lowers_the_scores_error() -> None:
    """The scores' error ``Σ (q·(k − M k))²`` over sampled queries and keys, at ranks 6 and 12: the weighted
    basis makes less of it than the unweighted one, which keeps more of the keys' energy."""
    keys, gram, q_energy = _grams(seed=1)
    gen = torch.Generator().manual_seed(2)
    queries = torch.randn(300, S * D, generator=gen, dtype=torch.float64) * q_energy.sqrt() / 20
    bases = {
        "plain": rope_equivariant_factors(gram, S, D),
        "weighted": rope_equivariant_factors(gram, S, D, q_energy),
    }

    def residual(name: str, r: int) -> torch.Tensor:
        f = bases[name]
        return keys - keys @ (f.up[:, :r] @ f.down[:r]).T

    for r in (6, 12):
        score_error = {name: float(((queries @ residual(name, r).T) ** 2).sum()) for name in bases}
        key_error = {name: float((residual(name, r) ** 2).sum()) for name in bases}
        assert score_error["weighted"] < score_error["plain"] and key_error["plain"] < key_error["weighted"]


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="even head dim"):
        rope_equivariant_factors(torch.eye(6, dtype=torch.float64), 2, 3)
    for rotary in (3, 10, 0):
        with pytest.raises(ValueError, match="even head dim and rotary dims"):
            rope_equivariant_factors(torch.eye(8, dtype=torch.float64), 1, 8, rotary_dim=rotary)
    with pytest.raises(ValueError, match="for 3 heads of 8"):
        rope_equivariant_factors(torch.eye(16, dtype=torch.float64), 3, 8)
