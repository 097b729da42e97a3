"""The transformers ``Cache`` of an lrkv-compressed model, and the bytes a cache really holds.

Per layer the cache holds whatever its storage strategy keeps for every past token (``dense``: the key latents
H_k = x A_kᵀ (B, S, R_k), *before* RoPE, and the value latents H_v = x A_vᵀ (B, S, R_v)), plus, for RoPE
models, the (B, S) int32 position ids, so RoPE can be applied to rebuilt keys at any later step (left padding
gives rows different positions; they come from the cache, never from ``arange``). Models without RoPE (OPT)
append latents without positions and their layers hold none.

``LatentCache`` subclasses ``DynamicCache``, so everything ``generate()`` does with a cache (beam reordering,
cropping, batch expansion) goes through the same methods. Layers that the model's config makes sliding-window
layers (Mistral, Qwen2's ``layer_types``) keep only the last ``window − 1`` tokens, exactly as transformers'
``DynamicSlidingWindowLayer`` does for the original model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, get_layer_types_and_kwargs

from ..format import LrkvFormat
from .layer import LatentLayer
from .storage import CACHE_STORAGES, CacheStorage, LatentView


class LatentUpdates:
    """What a compressed model's attention calls on its cache, dynamic (:class:`LatentCache`) or static
    (``StaticLatentCache``): one layer's update. A compressed model takes any cache of this kind."""

    layers: list

    def update_latents(
        self,
        h_k: torch.Tensor,
        h_v: torch.Tensor,
        position_ids: torch.Tensor | None,
        layer_idx: int,
        ranks: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> LatentView:
        """Store layer ``layer_idx``'s new latents (B, T, R); the view attention reads (see the layer's
        ``update_latents``: :meth:`LatentLayer.update_latents`, ``StaticLatentLayer.update_latents``)."""
        return self.layers[layer_idx].update_latents(h_k, h_v, position_ids, ranks)


class LatentCache(LatentUpdates, DynamicCache):
    """Cache for an lrkv-compressed model: one :class:`LatentLayer` per decoder layer.

    Parameters
    ----------
    num_layers : number of decoder layers.
    sliding_windows : per layer, the sliding window or None (every token kept); default: no sliding layers.
    ranks_k, ranks_v : per layer, the per-group ranks (as in the ``lrkv`` section); default: each layer learns
        them from its first update (the latent attentions pass their layout).
    storage : the storage strategy of every layer: a registered name, ``{"name": ..., **options}`` or a
        :class:`CacheStorage`; default ``"dense"``.

    :meth:`from_config` reads all of these off a compressed model's config.
    """

    def __init__(
        self,
        num_layers: int,
        sliding_windows: Sequence[int | None] | None = None,
        *,
        ranks_k: Sequence[Sequence[int]] | None = None,
        ranks_v: Sequence[Sequence[int]] | None = None,
        storage: str | dict | CacheStorage = "dense",
    ) -> None:
        windows, ranks = check_layer_args(num_layers, sliding_windows, ranks_k, ranks_v)
        self.storage = CACHE_STORAGES.create(storage)
        layers = [LatentLayer(self.storage, w, rk, rv) for w, (rk, rv) in zip(windows, ranks)]
        Cache.__init__(self, layers=layers)

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> LatentCache:
        """The layers transformers' ``DynamicCache(config=...)`` would make, as latent layers.

        The ranks and the storage come from the ``lrkv`` section (``ranks_k``, ``ranks_v``, and ``cache``:
        ``{"name": ..., **options}``, dense when absent, as in models saved before storages existed). A config
        without the section gives layers that learn their ranks from their first update.
        """
        num_layers, windows, options = layer_args(config)
        return cls(num_layers, windows, **options)


def check_layer_args(
    num_layers: int,
    sliding_windows: Sequence[int | None] | None,
    ranks_k: Sequence[Sequence[int]] | None,
    ranks_v: Sequence[Sequence[int]] | None,
) -> tuple[list[int | None], list[tuple[Sequence[int] | None, Sequence[int] | None]]]:
    """Per layer, the sliding window and the (key, value) ranks a latent cache's layers are built with
    (no windows: none slides; no ranks: each layer learns them from its first update)."""
    windows = list(sliding_windows) if sliding_windows is not None else [None] * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"{len(windows)} sliding windows for {num_layers} layers")
    if (ranks_k is None) != (ranks_v is None):
        raise ValueError("give both ranks_k and ranks_v, or neither")
    if ranks_k is not None and not len(ranks_k) == len(ranks_v) == num_layers:
        raise ValueError(f"ranks for {len(ranks_k)}/{len(ranks_v)} layers, the cache has {num_layers}")
    ranks = list(zip(ranks_k, ranks_v)) if ranks_k is not None else [(None, None)] * num_layers
    return windows, ranks


def layer_args(config: PretrainedConfig) -> tuple[int, list[int | None], dict[str, Any]]:
    """A compressed model's cache layers as its config describes them: the number of decoder layers, the
    sliding window of each (transformers' ``layer_types``), and ``ranks_k``, ``ranks_v`` and ``storage`` from
    the ``lrkv`` section (``cache``: ``{"name": ..., **options}``, dense when absent, as in models saved
    before storages existed; none of them for a config without the section)."""
    decoder = config.get_text_config(decoder=True)
    types, per_layer = get_layer_types_and_kwargs(decoder)
    windows = [
        kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(types, per_layer)
    ]
    section = getattr(config, "lrkv", None) or getattr(decoder, "lrkv", None)
    if not section:
        return decoder.num_hidden_layers, windows, {}
    fmt = LrkvFormat.from_dict(section)  # the model-format section (older formats migrated)
    options = dict(ranks_k=fmt.ranks_k, ranks_v=fmt.ranks_v, storage=fmt.cache)
    return decoder.num_hidden_layers, windows, options


def _stored_tensors(obj: Any, found: dict[int, torch.Tensor]) -> None:
    """Collect the plain tensors under ``obj``: itself, the items of tuples, lists and dicts, and the inner
    tensors of tensor subclasses that store their data in them (optimum-quanto's packed codes, scales and
    shifts), whose own ``numel · element_size`` would describe the unpacked values instead."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            for name in obj.__tensor_flatten__()[0]:
                _stored_tensors(getattr(obj, name), found)
        else:
            found.setdefault(id(obj), obj)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _stored_tensors(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _stored_tensors(value, found)


def cache_nbytes(cache: Cache) -> int:
    """Bytes of every tensor a cache holds, over all layers (latent parts, positions, scales, ...).

    Latent layers (dynamic and static) report their tensors (:meth:`LatentLayer.tensors`); other layers (a
    ``DynamicCache``'s, a transformers ``QuantizedCache``'s) are scanned through their attributes, tuples,
    lists and dicts (keys, values, a sliding window's scalar, HQQ's codes and scale/zero metadata, quanto's
    packed tensors).
    """
    total = 0
    for layer in cache.layers:
        found: dict[int, torch.Tensor] = {}
        latent = callable(getattr(layer, "tensors", None))  # LatentLayer, StaticLatentLayer
        _stored_tensors(layer.tensors() if latent else vars(layer), found)
        total += sum(t.numel() * t.element_size() for t in found.values())
    return total
