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
from transformers import AutoModelForCausalLM

from lrkv_core import load_compressed, save_compressed
from lrkv_core.cache import CACHE_STORAGES, cache_kwargs
from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from lrkv_core.format import LrkvFormat
from lrkv_core.model.adapters import get_adapter
from tests.support.inputs import greedy, ids_for
from tests.support.models import tiny_model

Replace = Callable[[torch.Tensor], torch.Tensor]

RANKS_K, RANKS_V = (8, 8), (16,)  # the per-group ranks of the storages' unit tests: two key groups, one value


def filled_store(storage, h_k: torch.Tensor, h_v: torch.Tensor, steps: list[int]):
    """A store of ``storage`` (a name, mapping or CacheStorage) for groups of :data:`RANKS_K` /
    :data:`RANKS_V`, given latents h_k (B, T, 16), h_v (B, T, 16) in appends of ``steps`` tokens."""
    store = CACHE_STORAGES.create(storage).create_store(RANKS_K, RANKS_V)
    start = 0
    for n in steps:
        store.append(h_k[:, start : start + n], h_v[:, start : start + n])
        start += n
    return store


def store_view(store) -> tuple[torch.Tensor, torch.Tensor]:
    """What attention reads from ``store``, every group side by side: keys (B, S, R_k), values (B, S, R_v)."""
    view = store.view()
    return torch.cat(view.keys, dim=-1), torch.cat(view.values, dim=-1)


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


def check_saved_with_cache(cache: dict, tmp_path) -> None:
    """A tiny Llama converted with the cache storage ``cache`` records it in its format section, and both
    loaders (``load_compressed``, plain ``from_pretrained``) rebuild it: the same logits and generations."""
    model = tiny_model("llama", 2)
    rows = torch.randint(3, 61, (8, 24), generator=torch.Generator().manual_seed(1))
    config = CompressionConfig(ratio=0.5, group_size=1, rank_multiple=4, allocator="uniform", cache=cache)
    comp = plan_conversion(model, rows, config).apply(model)
    out = save_compressed(comp, tmp_path / "m")
    assert LrkvFormat.of(comp.config).cache == cache
    ids = ids_for(2, 10)
    with torch.no_grad():
        ref = comp(ids, use_cache=True).logits
    for loaded in (load_compressed(out), AutoModelForCausalLM.from_pretrained(out)):
        with torch.no_grad():
            got = loaded(ids, use_cache=True)
        assert torch.equal(got.logits, ref) and got.past_key_values.storage == CACHE_STORAGES.create(cache)
        assert torch.equal(greedy(loaded, ids), greedy(comp, ids))
