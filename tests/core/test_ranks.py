"""Uniform rank allocation: budget, rounding, errors, JSON round trip, determinism.

The other allocators and the shared budget rule are tested in test_allocators.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from lrkv_core.allocation import RankPlan, allocate_ranks, round_rank


def _spectra(n_layers: int, n_groups: int, width: int, seed: int = 0) -> list[dict[str, list[torch.Tensor]]]:
    """Descending fake spectra of full length ``width`` (d ≥ s·D, so the max rank is the group width)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            kind: [torch.rand(width, generator=gen).sort(descending=True).values for _ in range(n_groups)]
            for kind in "kv"
        }
        for _ in range(n_layers)
    ]


GEOMETRIES = [(4, 16, 1), (4, 16, 2), (4, 16, 4), (2, 32, 1), (8, 8, 2)]  # (Hkv, D, group size)
BUDGET_CASES = [  # every combination that does not round to rank 0 (that case has its own test)
    (ratio, *geometry, multiple)
    for ratio in (0.3, 0.5, 0.6, 0.77, 0.9, 1.0)
    for geometry in GEOMETRIES
    for multiple in (1, 8, 16)
    if ratio * geometry[1] * geometry[2] >= multiple
]


@pytest.mark.parametrize("ratio,hkv,head_dim,group_size,multiple", BUDGET_CASES)
def test_uniform_meets_the_budget_within_one_rounding_step(
    ratio: float, hkv: int, head_dim: int, group_size: int, multiple: int
) -> None:
    width = group_size * head_dim
    n_layers, n_groups = 3, hkv // group_size
    plan = allocate_ranks(
        _spectra(n_layers, n_groups, width),
        ratio=ratio,
        group_size=group_size,
        head_dim=head_dim,
        rank_multiple=multiple,
    )
    assert plan.full_width == 2 * n_layers * hkv * head_dim
    assert plan.achieved_ratio <= ratio
    assert 0 <= plan.budget_width - plan.kept < multiple  # less than one rounding step below, in total
    base = (int(ratio * width + 1e-9) // multiple) * multiple
    for kind in "kv":
        assert len(plan.ranks[kind]) == n_layers and all(len(layer) == n_groups for layer in plan.ranks[kind])
        for layer in plan.ranks[kind]:
            for r in layer:
                assert 1 <= r <= width and r % multiple == 0
                assert r in (base, base + multiple)  # uniform: one rank, leftover steps one per group


def test_full_ratio_keeps_everything() -> None:
    plan = allocate_ranks(_spectra(2, 2, 16), ratio=1.0, group_size=1, head_dim=16, rank_multiple=8)
    assert plan.achieved_ratio == 1.0 and plan.kept == plan.full_width == 2 * 2 * 2 * 16


def test_ranks_are_capped_by_the_spectrum_length() -> None:
    """A group wider than the hidden size (s·D > d) has only d directions."""
    spectra = [{kind: [torch.ones(24)] for kind in "kv"}]  # width 32, d = 24
    plan = allocate_ranks(spectra, ratio=1.0, group_size=2, head_dim=16, rank_multiple=8)
    assert plan.ranks == {"k": [[24]], "v": [[24]]}
    assert plan.achieved_ratio == 24 / 32


@pytest.mark.parametrize(
    "r,multiple,max_rank,expected",
    [
        (12.0, 8, 64, 8),
        (16.0, 8, 64, 16),
        (15.99, 8, 64, 8),
        (31.0, 16, 64, 16),
        (7.0, 1, 64, 7),
        (0.29 * 100, 1, 100, 29),  # 28.999999999999996 in binary: still 29
        (0.7 * 10, 1, 10, 7),  # 7.000000000000001
        (100.0, 8, 60, 60),  # capped at the group's max rank
        (7.9, 8, 64, 0),
    ],
)
def test_round_rank(r: float, multiple: int, max_rank: int, expected: int) -> None:
    assert round_rank(r, multiple, max_rank) == expected


def test_float_products_just_below_an_integer_round_to_it() -> None:
    spectra = [{kind: [torch.ones(100)] for kind in "kv"}]
    plan = allocate_ranks(spectra, ratio=0.29, group_size=1, head_dim=100, rank_multiple=1)
    assert plan.ranks == {"k": [[29]], "v": [[29]]} and plan.achieved_ratio == 0.29


def test_ratio_that_rounds_to_rank_zero_raises_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"leaves rank 0 .*group width 16.*rank.multiple"):
        allocate_ranks(_spectra(2, 2, 16), ratio=0.4, group_size=1, head_dim=16, rank_multiple=8)  # 6.4 → 0
    plan = allocate_ranks(_spectra(2, 2, 16), ratio=0.4, group_size=1, head_dim=16, rank_multiple=2)
    # 6.4 → 6 per group leaves 51 − 48 = 3 of the budget: one more step, to the first group
    assert plan.ranks == {"k": [[8, 6], [6, 6]], "v": [[6, 6], [6, 6]]} and plan.budget_width == 51


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.01, 2.0, float("nan")])
def test_bad_ratio_raises(ratio: float) -> None:
    with pytest.raises(ValueError, match="ratio must be in"):
        allocate_ranks(_spectra(1, 1, 16), ratio=ratio, group_size=1, head_dim=16)


def test_bad_allocator_and_multiple_raise() -> None:
    choices = "eigen, fisher, fisher-greedy, kl, lorc, uniform"
    with pytest.raises(ValueError, match=rf"unknown allocator 'fisher_typo'; choose from {choices}"):
        allocate_ranks(_spectra(1, 1, 16), ratio=0.5, group_size=1, head_dim=16, allocator="fisher_typo")
    with pytest.raises(ValueError, match="rank multiple"):
        allocate_ranks(_spectra(1, 1, 16), ratio=0.5, group_size=1, head_dim=16, rank_multiple=0)


def test_rank_plan_json_roundtrip(tmp_path) -> None:
    plan = allocate_ranks(_spectra(3, 2, 32), ratio=0.55, group_size=2, head_dim=16, rank_multiple=8)
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["achieved_ratio"] == plan.achieved_ratio and data["target_ratio"] == 0.55
    # 0.55·32 = 17.6 → 16 per group; ⌊0.55·384⌋ − 12·16 = 19 leaves two more steps of 8, to the first groups
    assert data["ranks"] == {"k": [[24, 24], [16, 16], [16, 16]], "v": [[16, 16]] * 3}
    assert data["kept"] == 208 and data["budget_width"] == 211 and data["details"] == {}
    assert data["allocator"] == {"name": "uniform"}
    back = RankPlan.load(path)
    assert back == plan and back.achieved_ratio == plan.achieved_ratio


def test_allocation_is_deterministic(tmp_path) -> None:
    plans = [
        allocate_ranks(_spectra(4, 2, 32, seed=s), ratio=0.6, group_size=2, head_dim=16, rank_multiple=8)
        for s in (0, 0)
    ]
    assert plans[0] == plans[1]
    plans[0].save(tmp_path / "a.json")
    plans[1].save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
