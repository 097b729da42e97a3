"""The latent KV cache: a storage strategy (registered in :data:`CACHE_STORAGES`) × a window policy per layer.

- :mod:`.storage`: :class:`CacheStorage` (a strategy's registered config), :class:`LatentStore` (its mutable
  per-layer store, generic per-token operations written once), :class:`LatentView` (what attention reads);
- :mod:`.window`: :class:`FullWindow`, :class:`SlidingWindow`;
- :mod:`.dense`, :mod:`.quantized`, :mod:`.gear`, :mod:`.tale`: the registered storage strategies;
- :mod:`.layer`: :class:`LatentLayer`, one store × one window behind transformers' cache-layer API;
- :mod:`.latent_cache`: :class:`LatentCache` (``from_config`` reads ranks and storage from ``config.lrkv``)
  and :func:`cache_nbytes`;
- :mod:`.static`: :class:`StaticLatentCache`, the same layers preallocated, for captured decode steps;
- :mod:`.argument`: :data:`CACHE_ARG`, the forward keyword of the cache (``past_key_values`` / ``cache``).

A new storage strategy is one module beside :mod:`.dense` (a ``LatentStore`` subclass with ``encode`` and
``decode``, and a ``@CACHE_STORAGES.register``-ed ``CacheStorage`` making it) plus its import line below.
"""

# storage strategies: importing a strategy's module registers it
from . import dense, gear, quantized, tale  # noqa: F401
from .argument import CACHE_ARG, cache_kwargs, either_cache, output_cache, pop_cache
from .dense import DenseStorage, DenseStore
from .gear import GearStorage, GearStore
from .latent_cache import LatentCache, LatentUpdates, cache_nbytes
from .layer import LatentLayer
from .quantized import QuantizedStorage, QuantizedStore
from .static import StaticLatentCache, StaticLatentLayer
from .storage import CACHE_STORAGES, CacheStorage, LatentStore, LatentView, split_groups
from .tale import TaleStorage, TaleStore
from .window import FullWindow, SlidingWindow

__all__ = [
    "CACHE_ARG",
    "CACHE_STORAGES",
    "LatentUpdates",
    "CacheStorage",
    "DenseStorage",
    "DenseStore",
    "FullWindow",
    "GearStorage",
    "GearStore",
    "LatentCache",
    "LatentLayer",
    "LatentStore",
    "LatentView",
    "QuantizedStorage",
    "QuantizedStore",
    "SlidingWindow",
    "StaticLatentCache",
    "StaticLatentLayer",
    "TaleStorage",
    "TaleStore",
    "cache_kwargs",
    "cache_nbytes",
    "either_cache",
    "output_cache",
    "pop_cache",
    "split_groups",
]
