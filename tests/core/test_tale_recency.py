"""The ``tale`` cache's default rule, TALE's recency (§2.2.1), and its per-level bit widths (§2.3).

Hand-worked: with α = 2 sinks and p = 0.25, a prefill of 10 tokens holds tokens 0, 1 (the sinks) and 8, 9
(the last ⌊0.25 · 8⌋ = 2) at the full level; each new token enters at the full level and, whenever the
share would pass p, the oldest full-level token moves down to the low level. The bytes of each level are
the arithmetic of their bit widths; the energy rule stays selectable; with nothing cut the cache is exact;
a format recorded before these options loads with their defaults.
"""

from __future__ import annotations

import json

import pytest
import torch

from lrkv_core import load_compressed, save_compressed
from lrkv_core.cache import CACHE_STORAGES, TaleStorage, cache_nbytes
from lrkv_core.cache.tale import block_rotation, cut, low_ranks
from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from lrkv_core.format import LrkvFormat
from lrkv_core.quant import fake_quantize, packed_width
from tests.support.inputs import ids_for, max_diff
from tests.support.latents import (
    RANKS_K,
    RANKS_V,
    each_call,
    filled_store,
    replaced_latents,
    stepwise,
    store_view,
    tiny_compressed,
)
from tests.support.models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

HAND = {"name": "tale", "low": 0.5, "keep": 0.25, "sink": 2, "buffer": 0}  # the hand-worked example


def _latents(batch: int = 1, tokens: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, sum(RANKS_K), generator=gen), torch.randn(
        batch, tokens, sum(RANKS_V), generator=gen
    )


def _full_tokens(store, h_k: torch.Tensor, h_v: torch.Tensor, kind: str | None = None) -> list[int]:
    """The tokens (batch row 0) the store gives back whole, for keys and values alike (or for ``kind``);
    every other one must come back exactly cut to the low level (each group's first ⌊low · r_g⌋ latents,
    zeros after)."""
    got_k, got_v = store_view(store)
    found = {}
    for name, got, h, ranks in (("k", got_k, h_k, RANKS_K), ("v", got_v, h_v, RANKS_V)):
        lows = low_ranks(ranks, store.low)
        found[name] = [t for t in range(got.shape[1]) if torch.equal(got[0, t], h[0, t])]
        for t in set(range(got.shape[1])) - set(found[name]):
            (head, _), (got_head, got_tail) = cut(h[0, t], ranks, lows), cut(got[0, t], ranks, lows)
            assert torch.equal(got_head, head) and not got_tail.any(), f"{name} token {t} is neither level"
    if kind is not None:
        return found[kind]
    assert found["k"] == found["v"]
    return found["k"]


def _level_bytes(ranks: tuple[int, ...], bits: tuple[int, int] | None) -> tuple[int, int]:
    """Bytes per token of one kind's low level and of a full-level token (with its int32 index and float32
    rank key) at ``low: 0.5``: codes per block with a float16 scale and zero-point, a full-level token's
    latents whole (``bits`` = (low, full)); or float32 latents, a full-level token adding its tail."""
    R, low = sum(ranks), sum(low_ranks(ranks, 0.5))
    if bits is None:
        return 4 * low, 4 * (R - low) + 4 + 4
    return packed_width(low, bits[0]) + 2 * 2 * len(ranks), packed_width(R, bits[1]) + 2 * 2 * len(
        ranks
    ) + 4 + 4


def test_recency_is_the_default_with_the_papers_settings() -> None:
    storage = CACHE_STORAGES.create("tale")
    assert storage == TaleStorage(rule="recency", low=0.5, sink=4, low_bits=None, full_bits=None)
    assert (storage.share, storage.recent, storage.level_bits) == (0.1, None, (None, None))


def test_the_sinks_and_the_newest_share_are_at_the_full_level_and_the_oldest_move_down() -> None:
    h_k, h_v = _latents(tokens=16)
    store = filled_store(HAND, h_k, h_v, [10])
    assert _full_tokens(store, h_k, h_v) == [0, 1, 8, 9]  # ⌊0.25 · 8⌋ = 2 after the 2 sinks
    expected = {
        10: [0, 1, 9, 10],  # ⌊0.25 · 9⌋ = 2: token 8 moves down as token 10 arrives
        11: [0, 1, 10, 11],
        12: [0, 1, 11, 12],
        13: [0, 1, 11, 12, 13],  # ⌊0.25 · 12⌋ = 3: nothing moves down
        14: [0, 1, 12, 13, 14],
    }
    for t, full in expected.items():
        store.append(h_k[:, t : t + 1], h_v[:, t : t + 1])
        assert _full_tokens(store, h_k[:, : t + 1], h_v[:, : t + 1]) == full
    assert sorted(store.kept["k"]["significance"][0].tolist()) == [12.0, 13.0, 14.0] + [float("inf")] * 2


def test_a_count_of_recent_tokens_stays_the_same_however_long_the_sequence() -> None:
    h_k, h_v = _latents(tokens=40)
    count = {key: value for key, value in HAND.items() if key != "keep"} | {"recent": 3}
    store = filled_store(count, h_k, h_v, [4])
    assert _full_tokens(store, h_k[:, :4], h_v[:, :4]) == [0, 1, 2, 3]  # 2 sinks and the 2 cut so far
    store.append(h_k[:, 4:10], h_v[:, 4:10])
    assert _full_tokens(store, h_k[:, :10], h_v[:, :10]) == [0, 1, 7, 8, 9]  # the sinks and the newest 3
    for t in range(10, 40):  # a share would have grown (⌊0.25 · 36⌋ = 9); the count stays 3
        store.append(h_k[:, t : t + 1], h_v[:, t : t + 1])
    assert _full_tokens(store, h_k, h_v) == [0, 1, 37, 38, 39]
    assert store.kept["k"]["index"].shape[1] == 5
    energy = filled_store(count | {"rule": "energy"}, h_k, h_v, [40])
    tails = cut(h_k[0, 2:], RANKS_K, low_ranks(RANKS_K, 0.5))[1]  # the cut tokens' tails, sinks aside
    most = sorted((tails.pow(2).sum(-1).topk(3).indices + 2).tolist())
    assert _full_tokens(energy, h_k, h_v, "k") == [0, 1, *most]
    with pytest.raises(ValueError, match="never both"):
        TaleStorage(recent=3, keep=0.25)


def test_the_buffer_holds_its_tokens_as_computed_beside_the_share() -> None:
    h_k, h_v = _latents(tokens=16)
    store = filled_store(HAND | {"buffer": 4}, h_k, h_v, [10])  # 8 cut, 2 waiting
    assert store._encoded() == 8 and _full_tokens(store, h_k, h_v) == [0, 1, 7, 8, 9]  # ⌊0.25 · 6⌋ = 1
    for t in range(10, 12):  # the buffer fills: 12 cut, nothing waits; ⌊0.25 · 10⌋ = 2
        store.append(h_k[:, t : t + 1], h_v[:, t : t + 1])
    assert store._encoded() == 12 and _full_tokens(store, h_k[:, :12], h_v[:, :12]) == [0, 1, 10, 11]


def test_after_a_sliding_window_the_newest_stay_at_the_full_level() -> None:
    h_k, h_v = _latents(tokens=24)
    store = filled_store(HAND, h_k, h_v, [12, *[1] * 4])  # 16 tokens: ⌊0.25 · 14⌋ = 3 → 13, 14, 15
    store.keep_last(10)  # tokens 6..15: the sinks are gone
    assert _full_tokens(store, h_k[:, 6:16], h_v[:, 6:16]) == [7, 8, 9]
    for t in range(16, 20):  # 14 held, none a sink: ⌊0.25 · 14⌋ = 3
        store.append(h_k[:, t : t + 1], h_v[:, t : t + 1])
    held = torch.cat([torch.arange(6, 20)])
    assert _full_tokens(store, h_k[:, held], h_v[:, held]) == [11, 12, 13]


def test_the_energy_rule_stays_selectable() -> None:
    h_k, h_v = _latents(tokens=12)
    h_k[:, 4] *= 100.0  # an old token whose tail holds far more energy than any other
    h_v[:, 4] *= 100.0
    recency = filled_store(HAND, h_k, h_v, [12])
    energy = filled_store(HAND | {"rule": "energy"}, h_k, h_v, [12])
    assert _full_tokens(recency, h_k, h_v) == [0, 1, 10, 11]
    for kind in ("k", "v"):
        full = _full_tokens(energy, h_k, h_v, kind)
        assert 4 in full and len(full) == 2 + 3  # 0.25 · 10 rounded half up
    assert CACHE_STORAGES.create({"name": "tale", "rule": "energy"}).rule == "energy"


def test_each_level_is_quantized_at_its_own_bits() -> None:
    h_k, h_v = _latents(tokens=12)
    store = filled_store(HAND | {"low_bits": 2, "full_bits": 4}, h_k, h_v, [12])
    full = [0, 1, 10, 11]
    got = store_view(store)
    for kind, h, g, ranks in (("k", h_k, got[0], RANKS_K), ("v", h_v, got[1], RANKS_V)):
        lows = low_ranks(ranks, 0.5)
        head = cut(h, ranks, lows)[0]
        rot_low, rot_full = block_rotation(lows), block_rotation(ranks)
        want_low = fake_quantize(head @ rot_low, lows, 2) @ rot_low.T  # every token's low level, 2 bits
        want_full = fake_quantize(h @ rot_full, ranks, 4) @ rot_full.T  # full-level tokens whole, 4 bits
        got_head, got_tail = cut(g, ranks, lows)
        middle = [t for t in range(12) if t not in full]
        assert torch.equal(got_head[:, middle], want_low[:, middle]) and not got_tail[:, middle].any()
        assert torch.equal(g[:, full], want_full[:, full])
        # measured bytes per token of each level: the arithmetic of its bits
        low_bytes = sum(t[0, 0].nbytes for n, t in store.parts.items() if n.startswith(f"{kind}_low_"))
        assert low_bytes == packed_width(sum(lows), 2) + 2 * 2 * len(ranks)  # codes, fp16 scale and zero
        kept = store.kept[kind]
        assert sorted(kept) == ["index", "significance", "whole_codes", "whole_scale", "whole_zero"]
        full_bytes = sum(t[0, 0].nbytes for t in kept.values())
        assert full_bytes == packed_width(sum(ranks), 4) + 2 * 2 * len(ranks) + 4 + 4  # + int32, float32
    shared = filled_store(HAND | {"bits": 3}, h_k, h_v, [12])  # one width: full tokens add their tails
    assert "tail_codes" in shared.kept["k"] and shared.kept["k"]["tail_codes"].shape[-1] == packed_width(8, 3)


def test_the_bytes_reported_count_both_levels_at_their_bits(compress) -> None:
    comp = tiny_compressed(compress)
    storage = {"name": "tale", "keep": 0.25, "sink": 1, "buffer": 4, "low_bits": 2, "full_bits": 4}
    comp.config.lrkv["cache"] = storage
    with torch.no_grad():
        cache = comp(ids_for(3, 11), use_cache=True).past_key_values  # 8 tokens cut, 3 in the buffer
    fmt = LrkvFormat.of(comp.config)
    expected = 0
    for ranks in (*fmt.ranks_k, *fmt.ranks_v):  # per layer and kind: 2 groups of rank 4
        full = 1 + 1  # the sink and ⌊0.25 · 7⌋
        low_level, full_level = _level_bytes(ranks, (2, 4))
        expected += 3 * (8 * low_level + full * full_level + 3 * sum(ranks) * 4)  # the buffer in float32
    expected += len(fmt.ranks_k) * 3 * 11 * 4  # int32 positions
    assert cache_nbytes(cache) == expected


@pytest.mark.parametrize("levels", [{}, {"low_bits": 2, "full_bits": 4}])
def test_a_prefill_through_the_recency_cache_attends_over_the_cut_latents(compress, levels) -> None:
    comp = tiny_compressed(compress)
    ids = ids_for(2, 12)
    storage = {"name": "tale", "keep": 0.25, "sink": 1, "buffer": 0} | levels
    with torch.no_grad(), replaced_latents(comp, each_call(storage)):
        ref = comp(ids, use_cache=False).logits
    with torch.no_grad():
        dense = comp(ids, use_cache=True).logits
        comp.config.lrkv["cache"] = storage
        cached = comp(ids, use_cache=True).logits
    assert torch.equal(cached, ref) and max_diff(ref, dense) > 1e-4


@pytest.mark.parametrize("options", [{"low": 1.0}, {"keep": 1.0}])
def test_with_every_token_at_full_rank_decoding_equals_the_dense_cache(compress, options) -> None:
    comp = tiny_compressed(compress)
    ids = ids_for(2, 14)
    ref = stepwise(comp, ids, 5)[0]
    comp.config.lrkv["cache"] = {"name": "tale", "buffer": 3} | options
    assert torch.equal(stepwise(comp, ids, 5)[0], ref)


def test_options_are_checked() -> None:
    for options, message in (
        ({"rule": "attention"}, "tale cache rule must be one of"),
        ({"low_bits": 5}, "tale cache low_bits must be null or one of"),
        ({"bits": 4, "full_bits": 4}, "give bits \\(both levels\\) or low_bits/full_bits, not both"),
        ({"low_bits": 4, "full_bits": 2}, "at least the low level's precision"),
    ):
        with pytest.raises(ValueError, match=message):
            TaleStorage(**options)
    assert TaleStorage(low_bits=2).level_bits == (2, None) and TaleStorage(bits=3).level_bits == (3, 3)
    with pytest.raises(ValueError, match="at least the low level's precision"):
        TaleStorage(full_bits=4)  # the low level in the model's dtype, the full one at 4 bits


def test_a_format_recorded_before_rule_and_level_bits_loads_with_their_defaults(tmp_path) -> None:
    model = tiny_model("llama", 2)
    rows = torch.randint(3, 61, (8, 24), generator=torch.Generator().manual_seed(1))
    old = {"name": "tale", "low": 0.5, "keep": 0.25, "sink": 2, "buffer": 4, "bits": 4}  # the old fields
    config = CompressionConfig(ratio=0.5, group_size=1, rank_multiple=4, allocator="uniform", cache=old)
    comp = plan_conversion(model, rows, config).apply(model)
    out = save_compressed(comp, tmp_path / "m")
    path = out / "config.json"
    saved = json.loads(path.read_text())
    saved["lrkv"]["cache"] = old  # as a model saved before these options records it
    path.write_text(json.dumps(saved))
    loaded = load_compressed(out)
    ids = ids_for(2, 10)
    with torch.no_grad():
        got = loaded(ids, use_cache=True)
        want = comp(ids, use_cache=True)
    storage = got.past_key_values.storage
    assert storage == TaleStorage(**{k: v for k, v in old.items() if k != "name"})
    assert storage.rule == "recency" and storage.level_bits == (4, 4)
    assert torch.equal(got.logits, want.logits)


@pytest.mark.parametrize("bits", [(2, 4), None], ids=["2-4-bit", "float"])
def test_the_bytes_held_through_a_long_decode_are_both_levels_and_the_buffer(bits) -> None:
    # a prefill of 40, then 200 one-token steps: the buffer fills and empties 25 times, and tokens keep
    # moving down; at every step the store holds exactly what the levels' arithmetic says
    batch, sink, buffer = 2, 2, 8
    h_k, h_v = _latents(batch=batch, tokens=240)
    levels = {} if bits is None else {"low_bits": bits[0], "full_bits": bits[1]}
    storage = TaleStorage(low=0.5, keep=0.25, sink=sink, buffer=buffer, **levels)
    store = storage.create_store(RANKS_K, RANKS_V)
    positions = torch.arange(240)[None].expand(batch, -1)
    store.append(h_k[:, :40], h_v[:, :40], positions[:, :40])
    fills = set()
    for t in range(40, 240):
        store.append(h_k[:, t : t + 1], h_v[:, t : t + 1], positions[:, t : t + 1])
        s_e, s_r = store._encoded(), store.recent["k"].shape[1]
        full = min(s_e, int(0.25 * (s_e - min(sink, s_e)) + 1e-9) + min(sink, s_e))
        expected = (s_e + s_r) * 4  # int32 positions
        for ranks in (RANKS_K, RANKS_V):
            low_level, full_level = _level_bytes(ranks, bits)
            expected += s_e * low_level + full * full_level + s_r * sum(ranks) * 4  # the buffer in float32
        assert sum(x.nbytes for x in store.tensors()) == batch * expected
        assert s_e + s_r == t + 1 and s_e % buffer == 0
        fills.add(s_r)
    assert fills == set(range(buffer))
