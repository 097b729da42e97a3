"""The ``gear`` cache storage in lrkv's variant: a count of outliers per token and group, an exact SVD of the
residual and a chunk per full buffer (``LRKV``; the paper's rule, the default, is test_gear_paper.py).

The store's pieces are checked against their definitions (the outliers are the entries farthest from their
group's mean and come back exactly; the residual's factors are its truncated SVD), each correction must
lower the error of plain quantization, and the streaming buffer and every generic store operation must keep
chunks and their bases aligned. Inside compressed models the reference is, as for the ``quantized``
storage, the model with a dense cache whose latents are replaced by GEAR's reconstruction of each forward
call's tokens (``buffer: 0`` makes each call one chunk), which attention through the cache must reproduce
exactly (``torch.equal``), prefill, token-by-token decoding, generate() and beam search.
"""

from __future__ import annotations

import pytest
import torch

from lrkv_core import load_compressed, save_compressed
from lrkv_core.cache import (
    GearStorage,
    GearStore,
    QuantizedStorage,
    cache_nbytes,
)
from lrkv_core.cache.gear import low_rank, put_outliers, split_outliers
from lrkv_core.conversion.pipeline import use_cache_storage
from lrkv_core.format import LrkvFormat
from lrkv_core.quant import packed_width
from tests.support.inputs import greedy, ids_for, left_padded, max_diff
from tests.support.latents import (
    RANKS_K,
    RANKS_V,
    check_saved_with_cache,
    each_call,
    filled_store,
    replaced_latents,
    stepwise,
    store_view,
    tiny_compressed,
)
from tests.support.models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

LRKV = {"outlier_share": 0.0, "outliers": 1, "solver": "svd", "mode": "chunked"}  # lrkv's variant of GEAR


def _latents(batch: int = 2, tokens: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Heavy-tailed latents with decaying scales (whitened latents' energy falls along the rank)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(3.0)
    torch.manual_seed(seed)
    h_k = t.sample((batch, tokens, sum(RANKS_K))) * torch.linspace(2.0, 0.3, sum(RANKS_K))
    h_v = t.sample((batch, tokens, sum(RANKS_V))) + 0.1 * torch.randn(batch, tokens, 1, generator=gen)
    return h_k, h_v


def _nbytes(store) -> int:
    return sum(t.numel() * t.element_size() for t in store.tensors())


def test_outliers_are_the_entries_farthest_from_the_group_mean_and_come_back_exactly() -> None:
    x = torch.tensor([[0.0, 1.0, -9.0, 2.0, 5.0, 5.5, 4.5, 30.0]])
    filled, values, positions = split_outliers(x, (4, 4), 1)
    assert positions.tolist() == [[2, 3]] and values.tolist() == [[-9.0, 30.0]]
    assert filled.tolist() == [[0.0, 1.0, 1.0, 2.0, 5.0, 5.5, 4.5, 5.0]]  # the mean of the others
    assert torch.equal(put_outliers(filled, (4, 4), 1, values, positions), x)
    h_k, _ = _latents()
    filled, values, positions = split_outliers(h_k, (8, 8), 2)
    assert values.shape == positions.shape == (2, 24, 4) and positions.dtype == torch.uint8
    for g in range(2):  # every group's range now excludes its outliers
        xg, fg = h_k[..., 8 * g : 8 * g + 8], filled[..., 8 * g : 8 * g + 8]
        assert (fg.amax(-1) - fg.amin(-1) <= xg.amax(-1) - xg.amin(-1)).all()
    restored = put_outliers(filled, (8, 8), 2, values, positions)
    assert torch.equal(restored, torch.where(restored == filled, h_k, h_k.half().float()))


def test_the_residual_factors_are_its_truncated_svd() -> None:
    e = torch.randn(3, 20, 8, generator=torch.Generator().manual_seed(1))
    u, basis = low_rank(e, 3)
    assert u.dtype == basis.dtype == torch.float16 and u.shape == (3, 20, 3) and basis.shape == (3, 3, 8)
    U, S, Vh = torch.linalg.svd(e, full_matrices=False)
    best = U[..., :3] @ torch.diag_embed(S[:, :3]) @ Vh[:, :3]
    assert max_diff(u.float() @ basis.float(), best) < 1e-2  # float16 factors of the best rank-3 fit
    u, basis = low_rank(e, 8)  # full rank: the residual itself, up to float16
    assert max_diff(u.float() @ basis.float(), e) < 1e-2
    u, basis = low_rank(e[:, :2], 3)  # a chunk of 2 tokens has rank 2: the third component is zero
    assert (
        basis.shape == (3, 3, 8)
        and not basis[:, 2].any()
        and max_diff(u.float() @ basis.float(), e[:, :2]) < 1e-2
    )


def test_without_corrections_gear_is_the_quantized_storage() -> None:
    h_k, h_v = _latents()
    plain = filled_store(QuantizedStorage(bits=2), h_k, h_v, [10, 1, 1, 12])
    gear = filled_store(
        GearStorage(bits=2, outlier_share=0.0, rank=0, buffer=0, mode="chunked"), h_k, h_v, [10, 1, 1, 12]
    )
    assert all(torch.equal(a, b) for a, b in zip(store_view(plain), store_view(gear)))


@pytest.mark.parametrize("bits", [2, 4])
def test_each_correction_lowers_the_error_of_plain_quantization(bits: int) -> None:
    h_k, h_v = _latents(tokens=64)
    truth = torch.cat([h_k, h_v], dim=-1)

    def error(storage: dict) -> float:
        store = filled_store({"name": "gear", "bits": bits, "buffer": 0} | LRKV | storage, h_k, h_v, [64])
        got = torch.cat(store_view(store), -1)
        return ((got - truth).norm() / truth.norm()).item()

    quantized, outliers = error({"outliers": 0, "rank": 0}), error({"outliers": 1, "rank": 0})
    both, more = error({"outliers": 1, "rank": 2}), error({"outliers": 2, "rank": 4})
    assert quantized > outliers > both > more
    assert error({"outliers": 0, "rank": 16}) < 1e-3  # a full-rank residual: exact but for float16


def test_the_buffer_compresses_whole_buffers_and_keeps_the_rest_as_given() -> None:
    h_k, h_v = _latents(tokens=30)
    store = filled_store(GearStorage(bits=2, buffer=4, **LRKV), h_k, h_v, [10])
    assert store.chunk_sizes == [8] and store.recent["k"].shape[1] == 2 and len(store) == 10
    k, v = store_view(store)
    assert torch.equal(k[:, 8:], h_k[:, 8:10]) and torch.equal(v[:, 8:], h_v[:, 8:10])  # the buffer: as given
    one_chunk = filled_store(GearStorage(bits=2, buffer=0, **LRKV), h_k, h_v, [8])
    assert torch.equal(k[:, :8], store_view(one_chunk)[0])  # the 8 oldest: compressed together
    for t in range(10, 30):
        store.append(h_k[:, t : t + 1], h_v[:, t : t + 1])
    assert store.chunk_sizes == [8, 4, 4, 4, 4, 4] and store.recent["k"].shape[1] == 2 and len(store) == 30
    assert store.bases["k"][0].shape == (2, 6, 2, 8)  # (B, chunks, rank, r_g)


def test_crop_batch_operations_and_a_sliding_window_keep_chunks_aligned() -> None:
    h_k, h_v = _latents(batch=3, tokens=30)
    storage = GearStorage(bits=3, buffer=4, **LRKV)
    store = filled_store(storage, h_k, h_v, [10, *[1] * 20])
    full = store_view(store)
    nbytes = _nbytes(store)
    store.crop(9)  # 21 tokens left: chunks [8, 4, 4, 4, 1]
    assert store.chunk_sizes == [8, 4, 4, 4, 1] and len(store) == 21
    assert all(torch.equal(a, b[:, :21]) for a, b in zip(store_view(store), full))
    store.select(torch.tensor([2, 0]))
    assert all(torch.equal(a, b[[2, 0], :21]) for a, b in zip(store_view(store), full))
    store.reorder(torch.tensor([1, 1]))
    assert all(torch.equal(a, b[[0, 0], :21]) for a, b in zip(store_view(store), full))
    store.keep_last(6)  # the last 6: 1 of the third chunk, 4, 1
    assert store.chunk_sizes == [1, 4, 1] and store.bases["v"][0].shape[1] == 3
    assert all(torch.equal(a, b[[0, 0], 15:21]) for a, b in zip(store_view(store), full))
    assert _nbytes(store) < nbytes / 4  # the dropped chunks' bases are gone too
    store.reset()
    assert len(store) == 0 and store.chunk_sizes == [] and store.bases == {}


STORAGE = {"name": "gear", "bits": 2, "rank": 2, "buffer": 0} | LRKV


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
def test_gear_attention_equals_attention_over_the_reconstructed_latents(compress, arch) -> None:
    comp = tiny_compressed(compress, arch)
    ids = ids_for(2, 12)
    with torch.no_grad(), replaced_latents(comp, each_call(STORAGE)):
        ref = comp(ids, use_cache=False).logits
        ref_decoded = stepwise(comp, ids, 5)[0]
    with torch.no_grad():
        dense = comp(ids, use_cache=True).logits
        comp.config.lrkv["cache"] = STORAGE
        cached = comp(ids, use_cache=True)
    assert all(type(layer.store) is GearStore for layer in cached.past_key_values.layers)
    assert torch.equal(cached.logits, ref) and torch.equal(stepwise(comp, ids, 5)[0], ref_decoded)
    assert max_diff(ref, dense) > 1e-4  # compressed, really


def test_generate_and_beam_search_through_the_gear_cache(compress) -> None:
    comp = tiny_compressed(compress)
    ids, mask = left_padded((9, 5, 2))
    with torch.no_grad(), replaced_latents(comp, each_call(STORAGE)):
        ref_greedy, ref_beam = greedy(comp, ids, mask), greedy(comp, ids, mask, num_beams=2)
    comp.config.lrkv["cache"] = STORAGE
    got = greedy(comp, ids, mask, num_beams=2, return_dict_in_generate=True)
    assert torch.equal(greedy(comp, ids, mask), ref_greedy) and torch.equal(got.sequences, ref_beam)
    assert got.past_key_values.storage == GearStorage(bits=2, rank=2, buffer=0, **LRKV)
    comp.config.lrkv["cache"] = STORAGE | {"buffer": 3}  # with a streaming buffer: runs, beams included
    out = greedy(comp, ids, mask, num_beams=2, max_new_tokens=10, return_dict_in_generate=True)
    assert out.sequences.shape == (3, 19) and out.past_key_values.layers[0].store.chunk_sizes[0] == 9


def test_the_bytes_reported_are_the_tensors_held(compress) -> None:
    comp = tiny_compressed(compress)
    comp.config.lrkv["cache"] = {"name": "gear", "bits": 2, "rank": 2, "buffer": 4} | LRKV
    with torch.no_grad():
        cache = comp(ids_for(3, 11), use_cache=True).past_key_values  # 8 tokens compressed, 3 in the buffer
    fmt = LrkvFormat.of(comp.config)
    expected = 0
    for ranks in (*fmt.ranks_k, *fmt.ranks_v):  # per layer and kind: 2 groups of rank 4
        R, G = sum(ranks), len(ranks)
        per_token = packed_width(R, 2) + 2 * 2 * G + (2 + 1) * G + 2 * 2 * G  # codes, scale/zero, outliers, U
        expected += 3 * (8 * per_token + 3 * 4 * R) + 3 * 2 * 2 * R  # + buffer in fp32 + one chunk's bases
    expected += len(fmt.ranks_k) * 3 * 11 * 4  # int32 positions
    assert cache_nbytes(cache) == expected


def test_a_model_converted_with_the_gear_cache_saves_and_loads_it(tmp_path) -> None:
    check_saved_with_cache(GearStorage(bits=3, rank=1, buffer=4, **LRKV).to_dict(), tmp_path)


def test_a_compressed_model_evaluates_with_another_storage_after_loading(compress, tmp_path) -> None:
    comp = tiny_compressed(compress)
    out = save_compressed(comp, tmp_path / "m")
    loaded = load_compressed(out)
    storage = use_cache_storage(loaded, {"name": "gear", "bits": 2, "buffer": 0})
    assert storage == GearStorage(bits=2, buffer=0) and loaded.config.lrkv["cache"]["name"] == "gear"
    ids = ids_for(2, 10)
    with torch.no_grad(), replaced_latents(comp, each_call(storage.to_dict())):
        ref = comp(ids).logits
    with torch.no_grad():
        assert torch.equal(loaded(ids, use_cache=True).logits, ref)
    with pytest.raises(ValueError, match="leave nothing to quantize in a group of 4"):
        use_cache_storage(loaded, {"name": "gear", "outliers": 4, "outlier_share": 0})
    with pytest.raises(ValueError, match="gear cache bits must be one of"):
        use_cache_storage(loaded, {"name": "gear", "bits": 16})
    with pytest.raises(ValueError, match="dense KV cache"):
        use_cache_storage(tiny_model(), "gear")
