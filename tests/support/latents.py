"""Reference models for cache storages: a compressed model whose latents are replaced as they are computed.

A storage's store must give attention the very latents some function of the computed ones gives back (a
quantizer, GEAR's reconstruction). The reference is the same model with a *dense* cache and forward hooks on
every ``k_down`` / ``v_down`` replacing their outputs (B, T, Σ r_g) by that function's, so both see the same
tensors per forward call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from lrkv_core.adapters import get_adapter
from lrkv_core.cache import CACHE_STORAGES, cache_kwargs
from lrkv_core.format import LrkvFormat
from tests.support.models import tiny_model

Replace = Callable[[torch.Tensor], torch.Tensor]


@contextmanager
def replaced_latents(model, make: Callable[[list[int]], Replace]) -> Iterator[None]:
    """The model with a dense cache whose latents of groups ``ranks`` are replaced by ``make(ranks)(h)``."""
    adapter, fmt = get_adapter(model.config), LrkvFormat.of(model.config)
    before = model.config.lrkv["cache"]
    model.config.lrkv["cache"] = {"name": "dense"}
    handles = []
    for i in range(fmt.n_layers):
        attn = adapter.attention(model, i)
        for proj, ranks in (("k_down", fmt.ranks_k[i]), ("v_down", fmt.ranks_v[i])):
            fn = make(ranks)
            handles.append(getattr(attn, proj).register_forward_hook(lambda _m, _a, out, fn=fn: fn(out)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        model.config.lrkv["cache"] = before


def stepwise(model, ids: torch.Tensor, prefix: int) -> tuple[torch.Tensor, object]:
    """Logits (B, T, V) of a prefill of ``prefix`` tokens then one token at a time through the cache, and
    the cache."""
    with torch.no_grad():
        out = model(ids[:, :prefix], use_cache=True)
        steps = [out.logits]
        for t in range(prefix, ids.shape[1]):
            out = model(ids[:, t : t + 1], **cache_kwargs(out.past_key_values), use_cache=True)
            steps.append(out.logits)
    return torch.cat(steps, dim=1), out.past_key_values


def each_call(storage: dict) -> Callable[[list[int]], Replace]:
    """For :func:`replaced_latents`: what a ``buffer: 0`` store of ``storage`` (one with a ``buffer``
    option) gives back for each forward call's latents, the call's tokens taken in at once."""
    one_call = CACHE_STORAGES.create(storage | {"buffer": 0})

    def make(ranks):
        def apply(h: torch.Tensor) -> torch.Tensor:
            store = one_call.create_store(tuple(ranks), tuple(ranks))
            store.append(h, h)
            return torch.cat(store.view().keys, dim=-1)

        return apply

    return make


def tiny_compressed(compress, arch: str = "llama"):
    """A tiny model of ``arch`` compressed to ratio 0.5 in per-head groups of rank 4 (``compress``: the
    conftest fixture)."""
    return compress(tiny_model(arch, 4 if arch == "opt" else 2), 1, 0.5, rank_multiple=1)[0]
