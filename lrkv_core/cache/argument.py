"""The keyword transformers' forwards take the KV cache by, for the installed release.

Up to 5.23 it is ``past_key_values``. From 5.24 it is ``cache``: ``past_key_values`` still works there with
a deprecation warning (removed in 5.40), but a forward given both uses ``cache`` and silently drops the
other, so lrkv never passes the old name where the new one exists. Outputs name the field the same way (5.24
keeps a ``past_key_values`` property that logs a deprecation warning).
"""

from __future__ import annotations

from typing import Any

import transformers
from packaging.version import Version

LEGACY_CACHE_ARG = "past_key_values"
CACHE_ARG = "cache" if Version(transformers.__version__).release >= (5, 24) else LEGACY_CACHE_ARG


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """Forward kwargs that pass ``cache`` under the installed transformers' name."""
    return {CACHE_ARG: cache}


def output_cache(output: Any) -> Any:
    """The cache a forward returned (``output.cache`` from 5.24, ``output.past_key_values`` before)."""
    return getattr(output, CACHE_ARG)


def either_cache(cache: Any, past_key_values: Any) -> Any:
    """The one cache given as ``cache`` or as ``past_key_values`` (None if neither; two different: error)."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise TypeError("got two caches, as `cache` and as `past_key_values`: pass one")
    return cache if cache is not None else past_key_values


def pop_cache(kwargs: dict[str, Any]) -> Any:
    """Remove the cache from forward ``kwargs`` under either name and return it (None when absent)."""
    return either_cache(kwargs.pop("cache", None), kwargs.pop(LEGACY_CACHE_ARG, None))
