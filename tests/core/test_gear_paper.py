"""The ``gear`` storage's default is GEAR's own rule (Kang et al., 2024): a share of outliers (Eq. 4), the
residual's low-rank part by power iteration (appendix A, Algorithm 2), and streaming that appends each full
buffer to the cache and compresses the whole cache again (Algorithm 1). The bytes it reports during a long
decode are the bytes of what it holds, buffer included.
"""

from __future__ import annotations

import json

import pytest
import torch

from lrkv_core import load_compressed, save_compressed
from lrkv_core.cache import GearStorage, LatentCache
from lrkv_core.cache.gear import power_iteration, put_share, split_share
from lrkv_core.quant import packed_width
from tests.support.inputs import ids_for, max_diff
from tests.support.latents import (
    RANKS_K,
    RANKS_V,
    each_call,
    filled_store,
    replaced_latents,
    store_view,
    tiny_compressed,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _latents(batch: int = 2, tokens: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h_k = torch.randn(batch, tokens, sum(RANKS_K), generator=gen) * torch.linspace(2.0, 0.3, sum(RANKS_K))
    return h_k, torch.randn(batch, tokens, sum(RANKS_V), generator=gen)


def test_the_defaults_are_the_papers() -> None:
    storage = GearStorage()
    assert (storage.outlier_share, storage.outliers, storage.solver, storage.mode, storage.buffer) == (
        0.02, None, "power", "whole", 20,
    )  # fmt: skip


def test_a_share_of_outliers_is_half_the_largest_and_half_the_smallest_entries_of_the_matrix() -> None:
    # one batch row, 2 tokens × 5 latents = 10 entries; share 0.4: the 2 largest and the 2 smallest
    x = torch.tensor([[[0.0, 1.0, -9.0, 2.0, 5.0], [5.5, 4.5, 30.0, -1.0, 3.0]]])
    filled, values, index = split_share(x, (5,), 0.4)
    assert index.tolist() == [[2, 5, 7, 8]] and index.dtype == torch.int32  # -9, 5.5, 30, -1 (token·5 + col)
    assert values.tolist() == [[-9.0, 5.5, 30.0, -1.0]] and values.dtype == torch.float16
    # each is replaced by the mean of the rest of its token's row, so the grid spans only the rest
    assert filled.tolist() == [[[0.0, 1.0, 2.0, 2.0, 5.0], [3.75, 4.5, 3.75, 3.75, 3.0]]]
    assert torch.equal(put_share(filled, values, index), x)
    # the share is of the whole matrix, not per token: 5 is the 3rd largest, yet the largest of token 0
    assert 4 not in index.tolist()[0]
    assert split_share(x, (5,), 0.19)[2].shape == (1, 0)  # ⌊0.095 · 10⌋ = 0 per side


def test_the_share_outliers_come_back_exactly_through_the_store() -> None:
    h_k, h_v = _latents(tokens=50)
    store = filled_store({"name": "gear", "bits": 2, "rank": 0, "buffer": 0}, h_k, h_v, [50])
    k, v = store_view(store)
    for kind, h, got in (("k", h_k, k), ("v", h_v, v)):
        index = store.sparse[f"{kind}_index"].long()
        assert index.shape == (2, 2 * int(0.01 * 50 * 16))  # 8 per side and batch row
        want = h.reshape(2, -1).gather(1, index).half().float()
        assert torch.equal(got.reshape(2, -1).gather(1, index), want)


def test_power_iteration_recovers_a_known_low_rank_residual() -> None:
    gen = torch.Generator().manual_seed(1)
    e = torch.randn(3, 40, 3, generator=gen) @ torch.randn(3, 3, 16, generator=gen)  # rank 3
    u, basis = power_iteration(e, 3, iterations=3)
    assert u.shape == (3, 40, 3) and basis.shape == (3, 3, 16) and u.dtype == basis.dtype == torch.float16
    assert max_diff(u.float() @ basis.float(), e) < 1e-2 * e.abs().max()
    again = power_iteration(e, 3, iterations=3)  # seeded: the same factors every time
    assert torch.equal(again[0], u) and torch.equal(again[1], basis)
    # a decaying spectrum: close to the best rank-3 fit (Eckart–Young), never better
    q_u = torch.linalg.qr(torch.randn(2, 64, 16, generator=gen)).Q
    q_v = torch.linalg.qr(torch.randn(2, 16, 16, generator=gen)).Q
    sigma = torch.tensor([2.0**-i for i in range(16)])
    e = q_u * sigma @ q_v.mT
    best = sigma[3:].norm() * 2**0.5  # both batch rows
    u, basis = power_iteration(e, 3, iterations=3)
    error = (u.float() @ basis.float() - e).norm()
    assert best * 0.999 < error < best * 1.05  # measured: 1.034
    u, basis = power_iteration(e[:, :2], 3, iterations=3)  # 2 tokens: rank 2, the third component zero
    assert not basis[:, 2].any() and max_diff(u.float() @ basis.float(), e[:, :2]) < 1e-2


def test_streaming_appends_the_full_buffer_and_compresses_the_whole_cache_again() -> None:
    h_k, h_v = _latents(tokens=30)
    store = filled_store(GearStorage(bits=2, buffer=4), h_k, h_v, [10])
    assert store.chunk_sizes == [10] and store.recent["k"].shape[1] == 0  # the prompt: compressed at once
    for t in range(10, 13):
        store.append(h_k[:, t : t + 1], h_v[:, t : t + 1])
    assert store.chunk_sizes == [10] and store.recent["k"].shape[1] == 3  # waiting in the buffer
    k, v = store_view(store)
    assert torch.equal(k[:, 10:], h_k[:, 10:13])
    store.append(h_k[:, 13:14], h_v[:, 13:14])  # the buffer is full: all 14 tokens are compressed again
    assert store.chunk_sizes == [14] and store.recent["k"].shape[1] == 0
    assert store.bases["k"][0].shape == (2, 1, 2, 8)  # one segment, one basis
    # Algorithm 1: the reconstruction of the cache, the buffer appended, compressed as one matrix
    again = filled_store(
        GearStorage(bits=2, buffer=0),
        torch.cat([k[:, :10], h_k[:, 10:14]], 1),
        torch.cat([v[:, :10], h_v[:, 10:14]], 1),
        [14],
    )
    assert all(torch.equal(a, b) for a, b in zip(store_view(store), store_view(again)))
    chunked = filled_store(GearStorage(bits=2, buffer=4, mode="chunked"), h_k, h_v, [10, 1, 1, 1, 1])
    assert chunked.chunk_sizes == [8, 4] and chunked.recent["k"].shape[1] == 2  # lrkv's variant


def test_the_rank_share_gives_each_segment_the_papers_rank() -> None:
    """GEAR's r = max(1, ρ · min(n, d)): ρ = 0.25 on key groups of 8 and a value group of 16 gives ranks 2, 2
    and 4 to a segment of 64 tokens, 1, 1 and 1 to one of 4 tokens (stored padded to 2, 2 and 4); ρ = 0.02
    gives rank 1 everywhere."""
    h_k, h_v = _latents(tokens=72)
    storage = GearStorage(bits=2, rank=None, rank_share=0.25, solver="svd", mode="chunked", buffer=4)
    store = filled_store(storage, h_k, h_v, [64, 4, 4])
    assert store.chunk_sizes == [64, 4, 4]
    assert [b.shape for b in store.bases["k"]] == [(2, 3, 2, 8)] * 2
    assert [b.shape for b in store.bases["v"]] == [(2, 3, 4, 16)]
    for kind, widths in (("k", (2, 2)), ("v", (4,))):
        assert store.parts[f"{kind}_lowrank"].shape == (2, 72, sum(widths))
        for basis, width in zip(store.bases[kind], widths):
            nonzero = basis.float().norm(dim=-1).ne(0).sum(-1)  # (B, segments): components in use
            assert nonzero.tolist() == [[width, 1, 1]] * 2
    # a 4-token chunk is compressed as a store with a fixed rank 1 compresses the same 4 tokens (exact SVD)
    fixed = GearStorage(bits=2, rank=1, solver="svd", mode="chunked", buffer=4)
    k, v = store_view(store)
    for got, want in zip(
        (k[:, 64:68], v[:, 64:68]), store_view(filled_store(fixed, h_k[:, 64:68], h_v[:, 64:68], [4]))
    ):
        assert torch.equal(got, want)
    tiny = GearStorage(bits=2, rank=None, rank_share=0.02).create_store(RANKS_K, RANKS_V)
    assert [tiny.segment_rank(1000, r) for r in (8, 16)] == [1, 1] and tiny.lowrank_width(16) == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rank_share": 0.05}, "give either rank"),
        ({"rank": None}, "give either rank"),
        ({"rank": None, "rank_share": 0.0}, r"rank_share must be in \(0, 1\]"),
        ({"rank": None, "rank_share": 1.5}, r"rank_share must be in \(0, 1\]"),
        ({"rank": -1}, "rank must be ≥ 0"),
    ],
)
def test_rank_and_rank_share_are_one_or_the_other(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GearStorage(**options)


def test_crop_and_batch_operations_keep_the_share_outliers_aligned() -> None:
    h_k, h_v = _latents(batch=3, tokens=40)
    store = filled_store(GearStorage(bits=2, buffer=4), h_k, h_v, [36, *[1] * 4])  # one segment of 40
    full = store_view(store)
    store.crop(5)
    assert len(store) == 35 and all(torch.equal(a, b[:, :35]) for a, b in zip(store_view(store), full))
    store.keep_last(20)
    assert all(torch.equal(a, b[:, 15:35]) for a, b in zip(store_view(store), full))
    assert ((store.sparse["k_index"] >= -1) & (store.sparse["k_index"] < 20 * 16)).all()
    store.reorder(torch.tensor([2, 0, 0]))
    assert all(torch.equal(a, b[[2, 0, 0], 15:35]) for a, b in zip(store_view(store), full))


def _expected_bytes(store, bits: int, rank: int, batch: int) -> int:
    """The bytes of what a ``whole``-mode store holds, from its token counts and the layout alone."""
    s_e, s_r = store._encoded(), store.recent["k"].shape[1] if store.recent else 0
    total = batch * (s_e + s_r) * 4  # int32 positions
    for ranks in (RANKS_K, RANKS_V):
        width, groups = sum(ranks), len(ranks)
        ks = [min(rank, r) for r in ranks]
        per_token = packed_width(width, bits) + 2 * 2 * groups + 2 * sum(ks)  # codes, scale/zero, A
        outliers = 2 * int(0.02 * s_e * width / 2 + 1e-9)  # the share of the whole matrix
        bases = sum(k * r for k, r in zip(ks, ranks)) * 2  # one segment: Bᵀ per group, float16
        total += batch * (s_e * per_token + outliers * (2 + 4) + bases + s_r * width * 4)  # buffer in fp32
    return total


def test_the_bytes_after_a_long_decode_are_the_bytes_held_buffer_included() -> None:
    h_k, h_v = _latents(tokens=300)
    store = GearStorage(bits=3, rank=2, buffer=20).create_store(RANKS_K, RANKS_V)
    positions = torch.arange(300)[None].expand(2, -1)
    store.append(h_k[:, :64], h_v[:, :64], positions[:, :64])
    seen = set()
    for t in range(64, 300):
        store.append(h_k[:, t : t + 1], h_v[:, t : t + 1], positions[:, t : t + 1])
        held = sum(x.numel() * x.element_size() for x in store.tensors())
        assert held == _expected_bytes(store, 3, 2, 2)
        seen.add(store.recent["k"].shape[1])
    assert seen == set(range(20)) and store.chunk_sizes == [64 + 220]  # every buffer fill, one segment


def test_attention_through_the_default_gear_cache_is_attention_over_its_reconstruction(compress) -> None:
    comp = tiny_compressed(compress)
    ids = ids_for(2, 12)
    storage = GearStorage(bits=2).to_dict()
    with torch.no_grad(), replaced_latents(comp, each_call(storage)):
        ref = comp(ids, use_cache=False).logits
    with torch.no_grad():
        dense = comp(ids, use_cache=True).logits
        comp.config.lrkv["cache"] = storage
        assert torch.equal(comp(ids, use_cache=True).logits, ref)  # a prompt: one compression, as the paper
    # no setting is lossless (integer bits only, float16 factors); a full-rank residual comes close
    comp.config.lrkv["cache"] = GearStorage(bits=8, outlier_share=0.0, rank=4, solver="svd").to_dict()
    with torch.no_grad():
        assert max_diff(comp(ids, use_cache=True).logits, dense) < 1e-2 < max_diff(ref, dense)


def test_an_older_gear_record_loads_with_the_defaults_or_fails_clearly(compress, tmp_path) -> None:
    comp = tiny_compressed(compress)
    comp.config.lrkv["cache"] = GearStorage(bits=2).to_dict()
    out = save_compressed(comp, tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    ids = ids_for(1, 6)
    config["lrkv"]["cache"] = {"name": "gear", "bits": 2}  # no option past bits: today's defaults
    (out / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        cache = load_compressed(out)(ids, use_cache=True).past_key_values
    assert cache.storage == GearStorage(bits=2)
    # the count-of-outliers form records outliers: N; with the default share it is refused, by name
    config["lrkv"]["cache"] = {"name": "gear", "bits": 2, "quant_group_size": None, "outliers": 1,
                               "rank": 2, "buffer": 32}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="outlier_share: 0, solver: svd, mode: chunked"):
        with torch.no_grad():
            load_compressed(out)(ids, use_cache=True)
    with pytest.raises(ValueError, match="replaces outlier_share"):
        LatentCache(1, storage={"name": "gear", "outliers": 1})
