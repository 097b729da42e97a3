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


def pop_cache(kwargs: dict[str, Any]) -> Any:
    """Remove the cache from forward ``kwargs`` under either name and return it (None when absent)."""
    new, old = kwargs.pop("cache", None), kwargs.pop(LEGACY_CACHE_ARG, None)
    if new is not None and old is not None and new is not old:
        raise TypeError("got two caches, as `cache` and as `past_key_values`: pass one")
    return new if new is not None else old
