"""The ``tale`` cache storage: token-adaptive ranks (significant tokens whole, the rest a prefix), lazily.

The store is checked against its definition: every token comes back as its latents cut to its level (a
prefix, zeros after it), the tokens kept whole are the sinks and the most significant by the energy the low
level drops, re-ranked over the whole cache as tokens come in, and every generic store operation keeps the
kept tails aligned with their tokens. Inside compressed models, a prefill through the cache must equal
attention over the cut latents (``torch.equal``); with nothing cut it must equal the dense cache, prefill,
token-by-token decoding, generate() and beam search.
"""

from __future__ import annotations

import pytest
import torch

from lrkv_core.cache import TaleStorage, TaleStore, cache_nbytes
from lrkv_core.cache.tale import block_rotation, cut, low_ranks
from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from lrkv_core.conversion.pipeline import use_cache_storage
from lrkv_core.format import LrkvFormat
from lrkv_core.quant import fake_quantize, packed_width
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


def _latents(batch: int = 2, tokens: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h_k = torch.randn(batch, tokens, sum(RANKS_K), generator=gen) * torch.linspace(2.0, 0.3, sum(RANKS_K))
    h_v = torch.randn(batch, tokens, sum(RANKS_V), generator=gen)
    return h_k, h_v


def _low_only(h: torch.Tensor, ranks, low: float) -> torch.Tensor:
    """Every token cut to the low level: each group's first ⌊low · r_g⌋ latents, zeros after."""
    out = torch.zeros_like(h)
    start = 0
    for r, lo in zip(ranks, low_ranks(ranks, low)):
        out[..., start : start + lo] = h[..., start : start + lo]
        start += r
    return out


def _whole_tokens(got: torch.Tensor, truth: torch.Tensor, ranks, low: float) -> list[set[int]]:
    """Per batch row, the tokens that came back whole; every other token must be exactly cut to the low
    level."""
    cut_only = _low_only(truth, ranks, low)
    rows = []
    for b in range(truth.shape[0]):
        whole = {t for t in range(truth.shape[1]) if torch.equal(got[b, t], truth[b, t])}
        rest = [t for t in range(truth.shape[1]) if t not in whole]
        assert torch.equal(got[b, rest], cut_only[b, rest])
        rows.append(whole)
    return rows


def test_low_ranks_and_cut() -> None:
    assert low_ranks((8, 16, 24), 0.5) == (4, 8, 12) and low_ranks((8, 10), 0.3) == (2, 3)
    assert low_ranks((8,), 0.0) == (0,) and low_ranks((8, 3), 1.0) == (8, 3)
    h = torch.arange(12.0).view(1, 1, 12)
    head, tail = cut(h, (8, 4), (3, 1))
    assert head.flatten().tolist() == [0, 1, 2, 8] and tail.flatten().tolist() == [3, 4, 5, 6, 7, 9, 10, 11]


@pytest.mark.parametrize("options", [{"low": 1.0}, {"keep": 1.0}, {"low": 0.0, "keep": 1.0, "sink": 0}])
def test_with_nothing_cut_the_store_gives_back_the_latents_exactly(options: dict) -> None:
    h_k, h_v = _latents(tokens=30)
    store = filled_store({"name": "tale", "buffer": 4} | options, h_k, h_v, [10, *[1] * 20])
    k, v = store_view(store)
    assert torch.equal(k, h_k) and torch.equal(v, h_v)


def test_values_keep_their_own_low_level_share() -> None:
    h_k, h_v = _latents(tokens=24)
    store = filled_store(TaleStorage(low=0.25, value_low=0.75, keep=0.0, sink=0, buffer=0), h_k, h_v, [24])
    assert store.lows == {"k": low_ranks(RANKS_K, 0.25), "v": low_ranks(RANKS_V, 0.75)}
    k, v = store_view(store)
    assert torch.equal(k, _low_only(h_k, RANKS_K, 0.25)) and torch.equal(v, _low_only(h_v, RANKS_V, 0.75))
    for bits in (None, 3):
        same = filled_store(TaleStorage(low=0.25, keep=0.0, sink=0, buffer=0, bits=bits), h_k, h_v, [24])
        wider = filled_store(
            TaleStorage(low=0.25, value_low=0.75, keep=0.0, sink=0, buffer=0, bits=bits), h_k, h_v, [24]
        )
        held = [sum(t.numel() * t.element_size() for t in s.tensors()) for s in (same, wider)]
        assert held[1] > held[0]  # the values' wider level is held
        assert torch.equal(store_view(wider)[0], store_view(same)[0])  # the keys are as before


def test_the_tokens_kept_whole_are_the_sinks_and_the_most_significant() -> None:
    h_k, h_v = _latents(tokens=24)
    store = filled_store(TaleStorage(rule="energy", low=0.5, keep=0.25, sink=2, buffer=0), h_k, h_v, [24])
    k, v = store_view(store)
    for got, truth, ranks in ((k, h_k, RANKS_K), (v, h_v, RANKS_V)):
        tail = (truth - _low_only(truth, ranks, 0.5)).pow(2).sum(-1)  # (B, T): what the low level drops
        for b, whole in enumerate(_whole_tokens(got, truth, ranks, 0.5)):
            top = set((tail[b, 2:].topk(6).indices + 2).tolist())  # round(0.25 · 22) = 6, beside the 2 sinks
            assert whole == {0, 1} | top
    assert store.kept["k"]["index"].shape == (2, 8) and store.kept["k"]["index"].dtype == torch.int32


def test_the_whole_cache_is_re_ranked_as_tokens_come_in() -> None:
    h_k, h_v = _latents(batch=1, tokens=16)
    h_k[:, 12:] *= 10.0  # the last chunk's tokens are far more significant than any before
    store = filled_store(TaleStorage(rule="energy", low=0.5, keep=0.25, sink=0, buffer=4), h_k, h_v, [8])
    assert len(store.kept["k"]["index"][0]) == 2  # 8 compressed: 2 kept whole
    first = set(store.kept["k"]["index"][0].tolist())
    for t in range(8, 16):
        store.append(h_k[:, t : t + 1], h_v[:, t : t + 1])
    k, _ = store_view(store)
    whole = _whole_tokens(k, h_k, RANKS_K, 0.5)[0]
    assert whole == {12, 13, 14, 15} and not first & whole  # round(0.25 · 16) = 4: all of the last chunk


def test_the_buffer_keeps_the_newest_tokens_as_computed_until_whole_buffers_are_cut() -> None:
    h_k, h_v = _latents(tokens=30)
    store = filled_store(TaleStorage(low=0.25, keep=0.0, sink=0, buffer=4), h_k, h_v, [10])
    assert store._encoded() == 8 and store.recent["k"].shape[1] == 2 and len(store) == 10
    k, v = store_view(store)
    assert torch.equal(k[:, 8:], h_k[:, 8:10]) and torch.equal(v[:, :8], _low_only(h_v[:, :8], RANKS_V, 0.25))
    for t in range(10, 13):
        store.append(h_k[:, t : t + 1], h_v[:, t : t + 1])
    assert store._encoded() == 12 and store.recent["k"].shape[1] == 1


@pytest.mark.parametrize("bits", [None, 3])
def test_crop_batch_operations_and_a_sliding_window_keep_the_kept_tails_aligned(bits) -> None:
    h_k, h_v = _latents(batch=3, tokens=40, seed=3)
    storage = TaleStorage(rule="energy", low=0.5, keep=0.25, sink=2, buffer=4, bits=bits)
    store = filled_store(storage, h_k, h_v, [12, *[1] * 18])
    full = store_view(store)  # 28 compressed, 2 in the buffer
    store.crop(7)  # 23 tokens left
    assert len(store) == 23 and all(torch.equal(a, b[:, :23]) for a, b in zip(store_view(store), full))
    assert (store.kept["k"]["index"] < 23).all()
    store.select(torch.tensor([2, 0]))
    assert all(torch.equal(a, b[[2, 0], :23]) for a, b in zip(store_view(store), full))
    store.reorder(torch.tensor([1, 1, 0]))
    assert all(torch.equal(a, b[[0, 0, 2], :23]) for a, b in zip(store_view(store), full))
    store.keep_last(9)  # tokens 14..22 of the sequence: the sinks are gone
    assert store.offset == 14 and len(store) == 9
    assert all(torch.equal(a, b[[0, 0, 2], 14:23]) for a, b in zip(store_view(store), full))
    spare = store.kept["v"]["significance"] == float("-inf")
    assert spare.any() and all(  # a row's spare slots hold zeros (quantized: zero scale and zero-point)
        not t[spare].any() for name, t in store.kept["v"].items() if name.startswith("tail_")
    )
    for t in range(30, 40):  # new tokens after the slide: none is a sink, every row re-ranks
        store.append(h_k[[0, 0, 2], t : t + 1], h_v[[0, 0, 2], t : t + 1])
    held = torch.cat([torch.arange(14, 23), torch.arange(30, 40)])  # the sequence's tokens the store holds
    k, v = store_view(store)
    assert store._encoded() == 17 and torch.equal(k[:, -2:], h_k[[0, 0, 2], 38:40])  # 2 in the buffer
    assert (
        store.kept["k"]["index"].shape[1] >= 4
        and (store.kept["k"]["significance"] > float("-inf")).sum(1).tolist() == [4] * 3
    )
    for got, truth, ranks in ((k, h_k, RANKS_K), (v, h_v, RANKS_V)) if bits is None else ():
        truth = truth[[0, 0, 2]][:, held]
        for whole in _whole_tokens(got[:, :17], truth[:, :17], ranks, 0.5):
            assert len(whole) == 4  # round(0.25 · 17), no sink left
    store.reset()
    assert len(store) == 0 and store.kept == {} and store.offset == 0


def test_after_a_crop_that_took_the_whole_tokens_new_ones_are_ranked_among_what_is_left() -> None:
    h_k, h_v = _latents(batch=1, tokens=40, seed=5)
    h_k[:, 20:30] *= 10.0  # the whole tokens are all among the last ones
    store = filled_store(TaleStorage(rule="energy", low=0.5, keep=0.25, sink=0, buffer=0), h_k, h_v, [30])
    assert set(store.kept["k"]["index"][0].tolist()) >= {20, 21}
    store.crop(12)  # 18 left: the kept keys went with the crop (spare slots or none)
    for t in range(30, 40):
        store.append(h_k[:, t : t + 1], h_v[:, t : t + 1])
    k, _ = store_view(store)
    truth = torch.cat([h_k[:, :18], h_k[:, 30:40]], dim=1)
    (whole,) = _whole_tokens(k, truth, RANKS_K, 0.5)
    # only new tokens could be kept whole: the old tails are gone
    assert whole and whole <= set(range(18, 28))


def test_quantized_levels_are_each_block_rotated_then_quantized() -> None:
    h_k, h_v = _latents(tokens=24)
    exact = filled_store(TaleStorage(rule="energy", low=0.5, keep=0.25, sink=2, buffer=0), h_k, h_v, [24])
    store = filled_store(
        TaleStorage(rule="energy", low=0.5, keep=0.25, sink=2, buffer=0, bits=3), h_k, h_v, [24]
    )
    for kind, h, ranks in (("k", h_k, RANKS_K), ("v", h_v, RANKS_V)):
        assert torch.equal(store.kept[kind]["index"], exact.kept[kind]["index"])  # ranked on exact tails
        head, tail = cut(h, ranks, low_ranks(ranks, 0.5))
        lows = low_ranks(ranks, 0.5)
        tails = tuple(r - lo for r, lo in zip(ranks, lows))
        rot_h, rot_t = block_rotation(lows), block_rotation(tails)
        want_head = fake_quantize(head @ rot_h, lows, 3) @ rot_h.T
        want_tail = fake_quantize(tail @ rot_t, tails, 3) @ rot_t.T
        got_head, got_tail = cut(
            torch.cat(getattr(store.view(), "keys" if kind == "k" else "values"), -1), ranks, lows
        )
        assert torch.equal(got_head, want_head)
        whole = torch.zeros(h.shape[:2], dtype=torch.bool)
        whole.scatter_(1, store.kept[kind]["index"].long(), True)
        assert torch.equal(got_tail[whole], want_tail[whole]) and not got_tail[~whole].any()
        assert store.parts[f"{kind}_low_codes"].shape[-1] == packed_width(sum(lows), 3)
    for a, b in ((block_rotation((8, 4)), torch.eye(12)), (block_rotation((6,)), torch.eye(6))):
        assert max_diff(a @ a.T, b) < 1e-6  # orthogonal (6: a random orthogonal block, no Hadamard of 6)
    truth = torch.cat([h_k, h_v], dim=-1)

    def error(bits):
        store = filled_store(TaleStorage(keep=1.0, buffer=0, bits=bits), h_k, h_v, [24])
        got = torch.cat(store_view(store), -1)
        return ((got - truth).norm() / truth.norm()).item()

    assert error(2) > error(3) > error(4) > error(8) > 0 == error(None)


def test_options_are_checked() -> None:
    for options, message in (
        ({"low": 1.5}, "tale cache low must be between 0 and 1"),
        ({"value_low": -0.5}, "tale cache value_low must be between 0 and 1"),
        ({"keep": -0.1}, "tale cache keep must be between 0 and 1"),
        ({"buffer": -1}, "tale cache buffer must be ≥ 0"),
        ({"sink": -2}, "tale cache sink must be ≥ 0"),
        ({"recent": -1}, "tale cache recent must be ≥ 0"),
        ({"recent": 8, "keep": 0.2}, "give keep .* or recent .*, never both"),
        ({"bits": 16}, "tale cache bits must be null or one of"),
    ):
        with pytest.raises(ValueError, match=message):
            TaleStorage(**options)
    with pytest.raises(ValueError, match="needs them in spectral order"):
        CompressionConfig(cache="tale", rotation="auto")


STORAGE = {"name": "tale", "rule": "energy", "low": 0.5, "keep": 0.25, "sink": 1, "buffer": 0}


@pytest.mark.parametrize("arch, bits", [("llama", None), ("qwen2", None), ("opt", None), ("llama", 2)])
def test_a_prefill_through_the_tale_cache_attends_over_the_cut_latents(compress, arch, bits) -> None:
    comp = tiny_compressed(compress, arch)
    ids = ids_for(2, 12)
    storage = STORAGE | {"bits": bits}
    with torch.no_grad(), replaced_latents(comp, each_call(storage)):
        ref = comp(ids, use_cache=False).logits
    with torch.no_grad():
        dense = comp(ids, use_cache=True).logits
        comp.config.lrkv["cache"] = storage
        cached = comp(ids, use_cache=True)
    assert all(type(layer.store) is TaleStore for layer in cached.past_key_values.layers)
    assert torch.equal(cached.logits, ref)
    assert max_diff(ref, dense) > 1e-4  # cut, really


def test_with_nothing_cut_decoding_and_generate_equal_the_dense_cache(compress) -> None:
    comp = tiny_compressed(compress)
    ids = ids_for(2, 14)
    prompts, mask = left_padded((9, 5, 2))
    with torch.no_grad():
        ref = stepwise(comp, ids, 5)[0]
    ref_greedy, ref_beam = greedy(comp, prompts, mask), greedy(comp, prompts, mask, num_beams=2)
    comp.config.lrkv["cache"] = {"name": "tale", "keep": 1.0, "buffer": 3}
    assert torch.equal(stepwise(comp, ids, 5)[0], ref)
    assert torch.equal(greedy(comp, prompts, mask), ref_greedy)
    got = greedy(comp, prompts, mask, num_beams=2, return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref_beam) and got.past_key_values.storage == TaleStorage(
        keep=1.0, buffer=3
    )
    comp.config.lrkv["cache"] = STORAGE | {"buffer": 3}  # cutting: runs, beams included, and cuts
    out = greedy(comp, prompts, mask, num_beams=2, max_new_tokens=10, return_dict_in_generate=True)
    store = out.past_key_values.layers[0].store
    assert (
        out.sequences.shape == (3, 19) and store._encoded() == 18 and store.kept["k"]["index"].shape[1] == 5
    )


@pytest.mark.parametrize("bits", [None, 4])
def test_the_bytes_reported_are_the_tensors_held(compress, bits) -> None:
    comp = tiny_compressed(compress)
    comp.config.lrkv["cache"] = {
        "name": "tale",
        "rule": "energy",
        "low": 0.5,
        "keep": 0.25,
        "sink": 1,
        "buffer": 4,
        "bits": bits,
    }
    with torch.no_grad():
        cache = comp(ids_for(3, 11), use_cache=True).past_key_values  # 8 tokens cut, 3 in the buffer
    fmt = LrkvFormat.of(comp.config)

    def stored(width: int, blocks: int) -> int:  # one token's block of latents: float32, or codes + fp16 s, z
        return width * 4 if bits is None else packed_width(width, bits) + 2 * 2 * blocks

    expected = 0
    for ranks in (*fmt.ranks_k, *fmt.ranks_v):  # per layer and kind: 2 groups of rank 4
        R, low, G = sum(ranks), sum(low_ranks(ranks, 0.5)), len(ranks)
        whole = 1 + 2  # the sink and round(0.25 · 7)
        per_row = (
            8 * stored(low, G) + whole * (stored(R - low, G) + 4 + 4) + 3 * R * 4
        )  # heads, tails, buffer
        expected += 3 * per_row  # int32 indices, float32 significance; the buffer in float32
    expected += len(fmt.ranks_k) * 3 * 11 * 4  # int32 positions
    assert cache_nbytes(cache) == expected


def test_a_model_converted_with_the_tale_cache_saves_and_loads_it(tmp_path) -> None:
    storage = TaleStorage(rule="energy", low=0.25, keep=0.5, sink=2, buffer=4, low_bits=2, full_bits=4)
    check_saved_with_cache(storage.to_dict(), tmp_path)


def test_a_rotated_model_refuses_the_tale_cache(tmp_path) -> None:
    model = tiny_model("llama", 2)
    rows = torch.randint(3, 61, (8, 24), generator=torch.Generator().manual_seed(1))
    config = CompressionConfig(ratio=0.5, group_size=1, rank_multiple=4, allocator="uniform", rotation="auto")
    comp = plan_conversion(model, rows, config).apply(model)
    with pytest.raises(ValueError, match="fused rotation \\('auto'\\); convert with rotation none"):
        use_cache_storage(comp, "tale")
    assert comp.config.lrkv["cache"] == {"name": "dense"}
