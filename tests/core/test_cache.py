"""The cache seam without a model: storage registry, the generic store operations, the window policies
(checked against transformers' ``DynamicSlidingWindowLayer`` update by update) and the layers' layouts."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from lrkv_core.cache import (
    CACHE_STORAGES,
    DenseStorage,
    DenseStore,
    FullWindow,
    LatentCache,
    LatentLayer,
    LatentStore,
    SlidingWindow,
    cache_nbytes,
    split_groups,
)
from lrkv_core.format import LrkvFormat
from tests.support.models import tiny_config


def _latents(first: int, n: int, width: int, batch: int = 1) -> torch.Tensor:
    """(batch, n, width) latents whose every entry is its token index (first .. first + n − 1)."""
    return torch.arange(first, first + n, dtype=torch.float32)[None, :, None].expand(batch, n, width).clone()


def _positions(first: int, n: int) -> torch.Tensor:
    return torch.arange(first, first + n)[None]  # (1, n)


# ------------------------------------------------------------------------------------------ the registry


def _section(**overrides) -> dict:
    """A complete format-1 ``lrkv`` section (as lrkv 0.1 wrote it: no "cache" entry) of a 2-layer model."""
    section = {
        "version": "0.1.0", "method": "palu", "decomposition": "whitened", "allocator": "uniform",
        "group_size": 1, "ranks_k": [[2, 3], [4, 1]], "ranks_v": [[1, 1], [2, 2]], "rank_multiple": 1,
        "target_ratio": 0.5, "achieved_ratio": 0.5, "rope": "reconstruct-then-rope", "qkv_bias": False,
        "o_bias": False, "rotation": None, "bits": None,
    }  # fmt: skip
    return section | overrides


def test_unknown_storage_or_option_is_refused_with_the_choices() -> None:
    assert "dense" in CACHE_STORAGES and CACHE_STORAGES.create("dense") == DenseStorage()
    with pytest.raises(ValueError, match=r"unknown cache storage 'nope'; choose from .*dense"):
        LatentCache(2, storage="nope")
    with pytest.raises(ValueError, match=r"unknown cache storage 'nope'; choose from .*dense"):
        section = LrkvFormat.from_dict(_section()).to_dict() | {"cache": {"name": "nope"}}
        LatentCache.from_config(tiny_config("llama", lrkv=section))
    with pytest.raises(ValueError, match=r"'dense' has no option\(s\) \['bits'\]"):
        LatentCache(2, storage={"name": "dense", "bits": 4})


def test_from_config_reads_ranks_and_storage_from_the_lrkv_section() -> None:
    config = tiny_config("llama")
    config.lrkv = _section()
    cache = LatentCache.from_config(config)  # a section without "cache" (saved before storages): dense
    assert cache.storage == DenseStorage() and all(layer.storage == DenseStorage() for layer in cache.layers)
    assert [layer.ranks for layer in cache.layers] == [((2, 3), (1, 1)), ((4, 1), (2, 2))]
    config.lrkv = LrkvFormat.from_dict(_section()).to_dict() | {"cache": {"name": "dense"}}
    assert LatentCache.from_config(config).storage == DenseStorage()


# -------------------------------------------------------------------------------------------- the store


def test_store_appends_and_applies_every_generic_operation_to_every_part_and_the_positions() -> None:
    store = DenseStore((2, 1), (3,))
    store.append(_latents(0, 4, 3, batch=3), _latents(0, 4, 3, batch=3), _positions(0, 4))
    store.append(_latents(4, 2, 3, batch=3), _latents(4, 2, 3, batch=3), _positions(4, 2))
    assert len(store) == 6 and store.positions.dtype == torch.int32 and store.positions.shape == (3, 6)
    view = store.view()
    assert [k.shape for k in view.keys] == [(3, 6, 2), (3, 6, 1)] and [v.shape for v in view.values] == [
        (3, 6, 3)
    ]
    assert torch.equal(view.keys[1][0, :, 0], torch.arange(6.0))

    def tokens() -> list[torch.Tensor]:  # the token index every per-token tensor holds, (B, S) each
        return [store.parts["k"][..., 0], store.parts["v"][..., -1], store.positions.float()]

    store.keep_last(4)
    assert len(store) == 4 and all(torch.equal(t[0], torch.arange(2.0, 6.0)) for t in tokens())
    store.crop(1)
    assert len(store) == 3 and all(torch.equal(t[0], torch.arange(2.0, 5.0)) for t in tokens())
    rows = torch.arange(3.0)[:, None]  # mark the rows
    store.parts = {name: t + 100 * rows[..., None] for name, t in store.parts.items()}
    store.positions = store.positions + 100 * rows.int()
    store.select(torch.tensor([2, 0]))
    assert all(torch.equal(t[:, 0], torch.tensor([202.0, 2.0])) for t in tokens())
    store.reorder(torch.tensor([1, 1, 0]))
    assert all(torch.equal(t[:, 0], torch.tensor([2.0, 2.0, 202.0])) for t in tokens())
    store.repeat_interleave(2)
    assert all(torch.equal(t[:, 0], torch.tensor([2.0, 2.0, 2.0, 2.0, 202.0, 202.0])) for t in tokens())
    assert {id(t) for t in store.tensors()} == {
        id(store.parts["k"]),
        id(store.parts["v"]),
        id(store.positions),
    }
    store.reset()
    assert len(store) == 0 and store.positions is None and store.tensors() == []
    store.append(_latents(0, 2, 3), _latents(0, 2, 3))  # after a reset, positions are decided again
    assert store.positions is None and len(store) == 2


def test_a_residual_window_and_the_encoded_tokens_are_one_token_sequence() -> None:
    """The newest ``residual`` tokens stay as given; every generic operation spans both segments."""
    store = DenseStore((2,), (1,), residual=3)
    store.append(_latents(0, 4, 2, batch=2), _latents(0, 4, 1, batch=2), _positions(0, 4))
    assert store._encoded() == 1 and store.recent["k"].shape[1] == 3 and len(store) == 4
    store.append(_latents(4, 2, 2, batch=2), _latents(4, 2, 1, batch=2), _positions(4, 2))

    def tokens() -> list[torch.Tensor]:  # the token index of every stored token, per tensor kind, (B, S)
        view = store.view()
        return [view.keys[0][..., 0], view.values[0][..., 0], store.positions.float()]

    def segments() -> tuple[list[float], list[float]]:  # row 0's encoded tokens, then the window's
        return store.parts["k"][0, :, 0].tolist(), store.recent["k"][0, :, 0].tolist()

    assert segments() == ([0.0, 1.0, 2.0], [3.0, 4.0, 5.0])
    assert all(torch.equal(t[0], torch.arange(6.0)) for t in tokens())
    store.keep_last(4)
    assert segments() == ([2.0], [3.0, 4.0, 5.0])
    store.crop(2)
    assert segments() == ([2.0], [3.0]) and all(torch.equal(t[0], torch.tensor([2.0, 3.0])) for t in tokens())
    store.append(_latents(6, 3, 2, batch=2), _latents(6, 3, 1, batch=2), _positions(6, 3))
    assert segments() == ([2.0, 3.0], [6.0, 7.0, 8.0])
    assert torch.equal(store.positions[0], torch.tensor([2, 3, 6, 7, 8], dtype=torch.int32))
    store.parts = {name: t + 100 * torch.arange(2.0)[:, None, None] for name, t in store.parts.items()}
    store.recent = {name: t + 100 * torch.arange(2.0)[:, None, None] for name, t in store.recent.items()}
    store.positions = store.positions + 100 * torch.arange(2, dtype=torch.int32)[:, None]
    store.reorder(torch.tensor([1, 0]))
    assert all(torch.equal(t[:, -1], torch.tensor([108.0, 8.0])) for t in tokens())
    store.repeat_interleave(2)
    store.select(torch.tensor([3, 0]))
    assert all(torch.equal(t[:, 0], torch.tensor([2.0, 102.0])) for t in tokens())
    assert {id(t) for t in store.tensors()} == {
        id(t) for t in (*store.parts.values(), *store.recent.values())
    } | {id(store.positions)}
    store.reset()
    assert len(store) == 0 and store.recent == {} and store.tensors() == []


def test_store_refuses_mixing_updates_with_and_without_positions() -> None:
    layer = LatentLayer(ranks_k=(3,), ranks_v=(3,))
    h = torch.zeros(1, 2, 3)
    view = layer.update_latents(h, h)
    assert view.positions is None and layer.store.positions is None and layer.get_seq_length() == 2
    with pytest.raises(ValueError, match="positions"):
        layer.update_latents(h, h, torch.arange(2)[None])


class _Broken(LatentStore):
    """A strategy that breaks the contract: parts of the wrong length, views of the wrong widths."""

    def encode(self, h_k: torch.Tensor, h_v: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"k": h_k, "v": h_v[:, :1]}

    def decode(self, parts: Mapping[str, torch.Tensor]):
        return (parts["k"],), split_groups(parts["v"], self.ranks_v)


def test_store_checks_widths_and_what_a_strategy_returns() -> None:
    h = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match=r"widths \(3, 3\) for a layer of ranks \(2, 2\)"):
        DenseStore((2, 2), (3,)).append(h, h)
    with pytest.raises(ValueError, match=r"_Broken.encode must return \(B, T, \.\.\.\)"):
        _Broken((3,), (3,)).append(h, h)
    broken = _Broken((1, 2), (3,))
    broken.encode = lambda h_k, h_v: {"k": h_k, "v": h_v}
    broken.append(h, h)
    with pytest.raises(ValueError, match=r"_Broken.decode gave groups of widths"):
        broken.view()
    with pytest.raises(ValueError, match="cannot hold groups of ranks"):
        split_groups(h, (1, 1))


# ------------------------------------------------------------------------------------------ the windows


@pytest.mark.parametrize("window", [2, 4, 5])
def test_sliding_layer_mirrors_transformers_update_by_update(window: int) -> None:
    """Same chunks into a latent layer and a ``DynamicSlidingWindowLayer``: same tokens returned and kept,
    same sequence length, mask sizes and max length, and the same crops allowed and refused."""
    ours = LatentLayer(sliding_window=window, ranks_k=(1, 2), ranks_v=(3,))
    theirs = DynamicSlidingWindowLayer(window)
    assert ours.is_sliding and isinstance(ours.window, SlidingWindow)
    assert ours.get_max_length() == theirs.get_max_length() == window
    seen = 0
    for step, n in enumerate([3, 2, 1, 1, 4, 1, 2]):
        if step == 1 and seen < window:  # below the window a crop is an ordinary one
            ours.crop(-1)
            theirs.crop(-1)
            seen -= 1
            assert ours.get_seq_length() == theirs.get_seq_length() == seen
        for q in (1, 3):
            assert ours.get_mask_sizes(q) == theirs.get_mask_sizes(q)
        k = _latents(seen, n, 3)
        view = ours.update_latents(k, k, _positions(seen, n))
        hf_keys, _ = theirs.update(k[:, None, :, :1], k[:, None, :, :1])  # (B, 1, S, 1)
        seen += n
        assert torch.equal(view.keys[0][0, :, 0], hf_keys[0, 0, :, 0])  # returned: kept + new
        assert torch.equal(view.positions[0].float(), hf_keys[0, 0, :, 0])
        assert torch.equal(ours.store.positions[0].float(), theirs.keys[0, 0, :, 0])  # kept
        assert torch.equal(ours.store.parts["v"][0, :, 0], theirs.keys[0, 0, :, 0])
        assert ours.get_seq_length() == theirs.get_seq_length() == seen
    with pytest.raises(RuntimeError, match="window is full"):
        ours.crop(-1)
    with pytest.raises(RuntimeError):
        theirs.crop(-1)
    with pytest.raises(NotImplementedError, match="sliding window"):
        ours.activate_past_recording()


def test_cache_layers_follow_the_configs_layer_types() -> None:
    config = tiny_config(
        "qwen2", num_hidden_layers=3, sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    )  # fmt: skip
    cache = LatentCache.from_config(config)
    assert [type(layer.window) for layer in cache.layers] == [FullWindow, SlidingWindow, SlidingWindow]
    assert cache.is_sliding == [False, True, True] and cache.layers[1].window.sliding_window == 4
    assert [type(layer.window) for layer in LatentCache.from_config(tiny_config("gpt2")).layers] == [
        FullWindow
    ] * 2
    layer = LatentLayer(sliding_window=4, ranks_k=(3,), ranks_v=(3,))
    h = torch.zeros(1, 2, 3)
    layer.update_latents(h, h, torch.arange(2)[None])
    layer.crop(-1)  # below the window a crop is an ordinary one
    assert layer.get_seq_length() == len(layer.store) == layer.store.positions.shape[1] == 1
    assert layer.get_mask_sizes(3) == (4, 0)
    view = layer.update_latents(torch.ones(1, 5, 3), torch.ones(1, 5, 3), torch.arange(1, 6)[None])
    assert view.keys[0].shape[1] == 6 and len(layer.store) == 3
    assert torch.equal(layer.store.positions[0], torch.tensor([3, 4, 5], dtype=torch.int32))
    assert layer.get_mask_sizes(1) == (4, 3)  # the mask sees the 3 kept tokens + the query, from position 3


def test_full_layer_keeps_everything_and_crops_like_a_dynamic_layer() -> None:
    layer = LatentLayer(ranks_k=(2,), ranks_v=(2,))
    assert not layer.is_sliding and layer.get_max_length() == -1 and layer.get_seq_length() == 0
    for first, n in [(0, 5), (5, 1), (6, 3)]:
        layer.update_latents(_latents(first, n, 2), _latents(first, n, 2), _positions(first, n))
    assert layer.get_seq_length() == len(layer.store) == 9 and layer.get_mask_sizes(2) == (11, 0)
    layer.crop(-4)
    assert layer.get_seq_length() == 5 and torch.equal(
        layer.store.positions[0], torch.arange(5, dtype=torch.int32)
    )
    with pytest.raises(ValueError, match="negative"):
        layer.crop(2)
    layer.activate_past_recording()  # a full layer keeps every token already
    layer.reset()
    assert layer.get_seq_length() == 0 and cache_nbytes(LatentCache(1)) == 0


# ------------------------------------------------------------------------------------------- the layout


def test_a_layer_learns_its_ranks_from_the_first_update_or_checks_them() -> None:
    h = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="needs its per-group ranks"):
        LatentCache(1).update_latents(h, h, None, 0)
    cache = LatentCache(1)
    view = cache.update_latents(h, h, None, 0, ranks=((1, 2), (3,)))
    assert cache.layers[0].ranks == ((1, 2), (3,)) and [k.shape[-1] for k in view.keys] == [1, 2]
    with pytest.raises(ValueError, match="latents of ranks"):
        cache.update_latents(h, h, None, 0, ranks=((3,), (3,)))
    declared = LatentCache(1, ranks_k=[[2, 1]], ranks_v=[[3]])
    with pytest.raises(ValueError, match="latents of ranks"):
        declared.update_latents(h, h, None, 0, ranks=((1, 2), (3,)))
    with pytest.raises(ValueError, match="ranks for 1/1 layers, the cache has 2"):
        LatentCache(2, ranks_k=[[3]], ranks_v=[[3]])
