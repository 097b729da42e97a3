"""The latent cache inside a compressed model: storages chosen by the ``lrkv`` section, generate's operations
on the cache (crop, batch select / reorder / repeat), and how the model takes or refuses a cache.

A storage registered from this module alone (``test-cast``: latents kept in another dtype, decoded back to the
model's) runs end to end: float16 gives the logits of a dense model whose latents were rounded to float16;
float64 is lossless for an fp32 model, so everything generate does must come out exactly as with ``dense``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from transformers import DynamicCache

from lrkv_core.cache import (
    CACHE_STORAGES,
    CacheStorage,
    LatentCache,
    LatentStore,
    cache_kwargs,
    cache_nbytes,
    output_cache,
    pop_cache,
    split_groups,
)
from lrkv_core.evaluation.metrics import kv_bytes_per_token
from lrkv_core.model.adapters import get_adapter
from lrkv_core.model.fuse import _latent_cache_pre_hook, enable_latent_cache
from tests.support.inputs import greedy, ids_for, left_padded, max_diff, positions_for
from tests.support.models import SLIDING_WINDOW, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread", "cast_storage")

LOSSLESS = {"name": "test-cast", "dtype": "float64"}


class CastStore(LatentStore):
    """Keeps H_k, H_v in ``stored_dtype``; decodes them to the dtype they came in."""

    def __init__(self, ranks_k: tuple[int, ...], ranks_v: tuple[int, ...], stored_dtype: torch.dtype) -> None:
        super().__init__(ranks_k, ranks_v)
        self.stored_dtype = stored_dtype

    def encode(self, h_k: torch.Tensor, h_v: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"k": h_k.to(self.stored_dtype), "v": h_v.to(self.stored_dtype)}

    def decode(self, parts: Mapping[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], ...]:
        keys, values = parts["k"].to(self.dtype), parts["v"].to(self.dtype)  # (B, S, R)
        return split_groups(keys, self.ranks_k), split_groups(values, self.ranks_v)


@dataclass(frozen=True)
class CastStorage(CacheStorage):
    """Latents kept in another dtype (a test strategy)."""

    name: ClassVar[str] = "test-cast"
    dtype: str = "float16"

    def create_store(self, ranks_k: tuple[int, ...], ranks_v: tuple[int, ...]) -> CastStore:
        return CastStore(ranks_k, ranks_v, getattr(torch, self.dtype))


@pytest.fixture(scope="module")
def cast_storage() -> Iterator[None]:
    CACHE_STORAGES.register(CastStorage)
    yield
    CACHE_STORAGES.unregister(CastStorage.name)


def _compressed(compress, arch: str = "llama", storage: dict | None = None, **kwargs):
    """A compressed tiny model (GQA, groups of one KV head: two groups per layer) using ``storage``."""
    comp, plan = compress(tiny_model(arch, 4 if arch == "opt" else 2), 1, **kwargs)
    if storage is not None:
        comp.config.lrkv["cache"] = storage
    return comp, plan


# ------------------------------------------------------------------------------------ storage end to end


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_a_registered_storage_is_chosen_by_the_lrkv_section_and_used_end_to_end(compress, arch) -> None:
    comp, plan = _compressed(compress, arch, ratio=0.5)
    ids = ids_for(2, 12)
    with torch.no_grad():
        dense = comp(ids).logits
        adapter = get_adapter(comp.config)  # the reference: a dense cache of latents rounded to float16
        handles = [
            getattr(adapter.attention(comp, i), proj).register_forward_hook(
                lambda _m, _a, out: out.half().to(out.dtype)
            )
            for i in range(2)
            for proj in ("k_down", "v_down")
        ]
        rounded = comp(ids).logits
        for h in handles:
            h.remove()
        comp.config.lrkv["cache"] = {"name": "test-cast"}
        out = comp(ids, use_cache=True)
        steps = [comp(ids[:, :5], use_cache=True)]
        for t in range(5, 12):
            steps.append(comp(ids[:, t : t + 1], **cache_kwargs(steps[-1].past_key_values), use_cache=True))
    cache = out.past_key_values
    assert cache.storage == CastStorage() and all(type(layer.store) is CastStore for layer in cache.layers)
    assert all(t.dtype == torch.float16 for layer in cache.layers for t in layer.store.parts.values())
    assert max_diff(out.logits, rounded) <= 1e-5  # exactly the float16 rounding of the latents
    assert 0 < max_diff(out.logits, dense) <= 1e-2  # which is small, and really happened
    decoded = torch.cat([s.logits for s in steps], dim=1)  # float32 sums in another order: 1.2e-5 seen on opt
    assert max_diff(decoded, out.logits) <= 1e-4

    # the bytes are the toy's tensors: float16 latents (+ int32 positions with RoPE), nothing else
    tensors = [t for layer in cache.layers for t in layer.store.tensors()]
    assert cache_nbytes(cache) == sum(t.numel() * t.element_size() for t in tensors)
    ranks = [sum(rk) + sum(rv) for rk, rv in zip(plan.ranks["k"], plan.ranks["v"])]
    position_bytes = 4 if arch == "llama" else 0
    assert cache_nbytes(cache) == sum(2 * 12 * (r * 2 + position_bytes) for r in ranks)
    assert kv_bytes_per_token(comp, ids, n_rows=2)["kv_bytes_per_token"] == cache_nbytes(cache) / 24


def test_a_lossless_storage_generates_exactly_as_dense(compress) -> None:
    """Greedy and beam search (reorder, batch expansion) through float64 latents: the dense tokens."""
    comp, _ = _compressed(compress, ratio=0.5)
    ids, mask = left_padded((9, 5, 2))
    dense_greedy, dense_beam = greedy(comp, ids, mask), greedy(comp, ids, mask, num_beams=2)
    comp.config.lrkv["cache"] = LOSSLESS
    got = greedy(comp, ids, mask, num_beams=2, return_dict_in_generate=True)
    assert torch.equal(got.sequences, dense_beam) and torch.equal(greedy(comp, ids, mask), dense_greedy)
    assert got.past_key_values.storage == CastStorage("float64")


def test_a_storage_composes_with_the_sliding_window(compress) -> None:
    """The window is a policy of the layer, not of the storage: float64 latents slide like dense ones."""
    model = tiny_model("mistral", 2, sliding_window=SLIDING_WINDOW)
    comp, _ = compress(model, 2)
    comp.config.lrkv["cache"] = LOSSLESS
    ids = ids_for(2, 3 * SLIDING_WINDOW)
    with torch.no_grad():
        full = model(ids).logits
        out = comp(ids[:, :2], use_cache=True)
        steps = [out.logits]
        for t in range(2, ids.shape[1]):
            out = comp(ids[:, t : t + 1], **cache_kwargs(out.past_key_values), use_cache=True)
            steps.append(out.logits)
            for layer in out.past_key_values.layers:  # window − 1 tokens: float64 latents, int32 positions
                kept = min(t + 1, SLIDING_WINDOW - 1)
                assert type(layer.store) is CastStore and len(layer.store) == kept
                assert all(
                    p.dtype == torch.float64 and p.shape[1] == kept for p in layer.store.parts.values()
                )
                assert torch.equal(
                    layer.store.positions[0], torch.arange(t + 1 - kept, t + 1, dtype=torch.int32)
                )
    assert max_diff(torch.cat(steps, dim=1), full) <= 1e-4


# --------------------------------------------------------------------------- generate's cache operations


def _prefilled(compress, storage: dict | None):
    """A compressed model, a left-padded batch of 3 rows (lengths 10, 7, 4) plus 3 more tokens each, its
    full-forward logits (the reference), and a LatentCache prefilled with all 13 tokens."""
    comp, _ = _compressed(compress, storage=storage, ratio=0.5)
    prompt, prompt_mask = left_padded((10, 7, 4))
    ids = torch.cat([prompt, ids_for(3, 3, seed=5)], dim=1)  # (3, 13)
    mask = torch.cat([prompt_mask, torch.ones(3, 3, dtype=torch.long)], dim=1)
    pos = positions_for(mask)
    with torch.no_grad():
        ref = comp(ids, attention_mask=mask, position_ids=pos).logits  # (3, 13, V)
        cache = comp(ids, attention_mask=mask, position_ids=pos, use_cache=True).past_key_values
    return comp, ids, mask, pos, ref, cache


def _continue(comp, cache, ids, mask, pos, rows: torch.Tensor) -> torch.Tensor:
    """Feed tokens 10..12 of ``rows`` through ``cache`` (holding tokens 0..9 of those rows)."""
    with torch.no_grad():
        return comp(
            ids[rows, 10:], attention_mask=mask[rows], position_ids=pos[rows, 10:], **cache_kwargs(cache)
        ).logits


STORAGES = pytest.mark.parametrize("storage", [None, LOSSLESS], ids=["dense", "test-cast-float64"])


@STORAGES
def test_crop_keeps_latents_and_positions_consistent(compress, storage) -> None:
    comp, ids, mask, pos, ref, cache = _prefilled(compress, storage)
    cache.crop(-3)
    rows = torch.arange(3)
    for layer in cache.layers:
        assert len(layer.store) == 10 and all(t.shape[1] == 10 for t in layer.store.parts.values())
        assert torch.equal(layer.store.positions, pos[:, :10].int())
    assert max_diff(_continue(comp, cache, ids, mask, pos, rows), ref[:, 10:]) <= 1e-5


@STORAGES
@pytest.mark.parametrize(
    "op,rows",
    [
        ("batch_select_indices", [2, 0]),
        ("reorder_cache", [1, 1, 0]),
        ("batch_repeat_interleave", [0, 0, 1, 1, 2, 2]),
    ],
)
def test_batch_operations_keep_positions_with_their_rows(compress, storage, op, rows) -> None:
    """Rows have different left padding, hence different positions: a position left behind changes RoPE."""
    comp, ids, mask, pos, ref, cache = _prefilled(compress, storage)
    cache.crop(-3)
    rows = torch.tensor(rows)
    if op == "batch_repeat_interleave":
        cache.batch_repeat_interleave(2)
    else:
        getattr(cache, op)(rows)
    for layer in cache.layers:
        assert all(t.shape[0] == len(rows) for t in layer.store.parts.values())
        assert torch.equal(layer.store.positions, pos[rows, :10].int())
    valid = _continue(comp, cache, ids, mask, pos, rows)
    assert max_diff(valid, ref[rows, 10:]) <= 1e-5


def test_reset_empties_the_cache_for_a_new_prompt(compress) -> None:
    comp, ids, mask, pos, ref, cache = _prefilled(compress, None)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache_nbytes(cache) == 0
    with torch.no_grad():
        again = comp(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache)).logits
    assert max_diff(again, ref) <= 1e-5 and cache.get_seq_length() == 13


# ------------------------------------------------------------------------------- taking or refusing a cache


def test_filled_dynamic_cache_is_refused(compress) -> None:
    model = tiny_model("llama", 2)
    comp, _ = compress(model, 1)
    with torch.no_grad():
        filled = model(ids_for(1, 5), use_cache=True).past_key_values
        assert type(filled) is DynamicCache and filled.get_seq_length() == 5
        with pytest.raises(TypeError, match="LatentCache"):
            comp(ids_for(1, 1), **cache_kwargs(filled), use_cache=True)


@pytest.mark.parametrize(
    "empty",
    [DynamicCache, lambda: None, lambda: LatentCache(2)],
    ids=["empty-DynamicCache", "none", "LatentCache-learning-its-ranks"],
)
def test_empty_or_missing_cache_becomes_a_latent_cache(compress, empty) -> None:
    comp, _ = compress(tiny_model("llama", 2), 1)
    ids = ids_for(2, 6)
    with torch.no_grad():
        out = comp(ids, **cache_kwargs(empty()), use_cache=True)
        no_cache = comp(ids, use_cache=False)
    assert isinstance(out.past_key_values, LatentCache) and out.past_key_values.get_seq_length() == 6
    assert no_cache.past_key_values is None
    assert torch.equal(out.logits, no_cache.logits)


@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_the_cache_is_used_under_either_keyword_on_the_installed_transformers(compress, keyword) -> None:
    """transformers 5.24 renamed forward's ``past_key_values`` to ``cache`` (dropping the old name when both
    are set): a compressed model decodes through the cache it gets under either name, on any release."""
    comp, _ = compress(tiny_model("llama", 2), 1)
    ids = ids_for(2, 9)
    with torch.no_grad():
        full = comp(ids, use_cache=False).logits
        cache = comp(ids[:, :6], use_cache=True).past_key_values
        for t in range(6, 9):
            step = comp(ids[:, t : t + 1], **{keyword: cache}, use_cache=True)
            assert output_cache(step) is cache and cache.get_seq_length() == t + 1
            assert max_diff(step.logits[:, -1], full[:, t]) <= 1e-5


def test_pop_cache_takes_either_name_and_refuses_two_caches() -> None:
    one, other = LatentCache(2), LatentCache(2)
    for kwargs in ({"cache": one}, {"past_key_values": one}, {"cache": one, "past_key_values": one}):
        assert pop_cache(kwargs) is one and kwargs == {}
    assert pop_cache({"use_cache": True}) is None
    with pytest.raises(TypeError, match="two caches"):
        pop_cache({"cache": one, "past_key_values": other})


def test_unknown_storage_in_the_lrkv_section_is_named(compress) -> None:
    comp, _ = _compressed(compress, storage={"name": "nope"})
    with pytest.raises(ValueError, match=r"unknown cache storage 'nope'; choose from .*dense.*test-cast"):
        comp(ids_for(1, 3), use_cache=True)


def test_latent_cache_hook_is_installed_once(compress) -> None:
    comp, _ = compress(tiny_model("llama", 2), 1)
    enable_latent_cache(comp)
    enable_latent_cache(comp)
    hooks = list(get_adapter(comp.config).base_model(comp)._forward_pre_hooks.values())
    assert hooks.count(_latent_cache_pre_hook) == 1
