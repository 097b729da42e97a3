"""The preallocated latent cache: the same tokens as the dynamic one through generate() (greedy, beams,
left padding, sliding windows, quantized codes), bytes of its buffers, its refusals, and a decode step
traced whole by ``torch.compile`` (no graph break: what capturing it in a CUDA graph needs)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache

from lrkv_core.cache import LatentCache, StaticLatentCache, cache_kwargs, cache_nbytes, output_cache
from tests.support.inputs import PAD, greedy, ids_for, left_padded, max_diff, positions_for
from tests.support.models import SLIDING_WINDOW, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

QUANTIZED = {"name": "quantized", "bits": 4}


def _compressed(compress, arch: str = "llama", storage: dict | None = None, **overrides):
    comp, _ = compress(tiny_model(arch, 4 if arch == "opt" else 2, **overrides), 1, ratio=0.5)
    if storage is not None:
        comp.config.lrkv["cache"] = storage
    return comp


MODELS = {  # id: (arch, cache storage, config overrides)
    "llama-dense": ("llama", None, {}),
    "llama-quantized-4bit": ("llama", QUANTIZED, {}),
    "mistral-sliding": ("mistral", None, {"sliding_window": SLIDING_WINDOW}),
    "gemma3-qknorm-sliding": ("gemma3", None, {}),
    "opt-norope": ("opt", None, {}),
}
WITH_ROPE = {name: m for name, m in MODELS.items() if name != "opt-norope"}


@pytest.mark.parametrize("arch, storage, overrides", list(MODELS.values()), ids=list(MODELS))
def test_generate_through_a_static_latent_cache_gives_the_dynamic_caches_tokens(
    compress, arch, storage, overrides
) -> None:
    comp = _compressed(compress, arch, storage, **overrides)
    ids, mask = left_padded((11, 7, 3))
    dynamic = greedy(comp, ids, mask, max_new_tokens=8, output_scores=True, return_dict_in_generate=True)
    static = greedy(
        comp, ids, mask, max_new_tokens=8, output_scores=True, return_dict_in_generate=True,
        **cache_kwargs(StaticLatentCache.from_config(comp.config, max_cache_len=ids.shape[1] + 8)),
    )  # fmt: skip
    assert torch.equal(static.sequences, dynamic.sequences)
    assert max_diff(torch.stack(static.scores), torch.stack(dynamic.scores)) <= 1e-5
    cache = output_cache(static)
    assert isinstance(cache, StaticLatentCache) and int(cache.get_seq_length()) == ids.shape[1] + 7
    # generate's own static cache on a compressed model: the hook swaps it for a latent one
    implied = greedy(
        comp, ids, mask, max_new_tokens=8, cache_implementation="static", return_dict_in_generate=True
    )
    assert torch.equal(implied.sequences, dynamic.sequences)
    assert isinstance(output_cache(implied), StaticLatentCache)


def test_beam_search_reorders_the_static_buffers_in_place(compress) -> None:
    comp = _compressed(compress)
    ids, mask = left_padded((9, 5))
    beams = greedy(comp, ids, mask, num_beams=3, max_new_tokens=6)
    # generate expands the rows before the prefill, so the buffers are allocated at 2 × 3 rows
    cache = StaticLatentCache.from_config(comp.config, max_cache_len=ids.shape[1] + 6)
    got = greedy(comp, ids, mask, num_beams=3, max_new_tokens=6, **cache_kwargs(cache))
    assert torch.equal(got, beams)


def test_the_buffers_hold_the_written_latents_and_the_bytes_are_theirs(compress) -> None:
    comp = _compressed(compress)
    ids = ids_for(2, 10)
    static = StaticLatentCache.from_config(comp.config, max_cache_len=16)
    with torch.no_grad():
        dynamic = output_cache(comp(ids, use_cache=True))
        logits = comp(ids, use_cache=True, **cache_kwargs(static)).logits
        assert max_diff(logits, comp(ids).logits) <= 1e-5
    for s_layer, d_layer in zip(static.layers, dynamic.layers):
        written = {name: t[:, :10] for name, t in s_layer.store.parts.items()}
        assert all(torch.equal(written[name], d_layer.store.parts[name]) for name in written)
        assert all(not t[:, 10:].any() for t in s_layer.store.parts.values())  # the rest untouched
        assert torch.equal(s_layer.store.positions[:, :10], d_layer.store.positions)
    ranks = [sum(a) + sum(b) for a, b in zip(comp.config.lrkv["ranks_k"], comp.config.lrkv["ranks_v"])]
    # float32 latents and int32 positions, 16 slots of 2 rows
    assert cache_nbytes(static) == sum(2 * 16 * (4 * r + 4) + 8 for r in ranks)  # + an int64 count per layer
    assert cache_nbytes(dynamic) == sum(2 * 10 * (4 * r + 4) for r in ranks)
    static.crop(-4)  # forget 4 tokens: the next update writes at slot 6
    with torch.no_grad():
        again = comp(ids[:, 6:], use_cache=True, **cache_kwargs(static)).logits
    assert max_diff(again, logits[:, 6:]) <= 1e-5 and int(static.get_seq_length()) == 10
    static.reset()
    assert int(static.get_seq_length()) == 0 and not static.layers[0].store.parts["k"].any()


def test_a_static_cache_refuses_what_it_cannot_hold(compress) -> None:
    comp = _compressed(compress)
    ids = ids_for(2, 6)
    cache = StaticLatentCache.from_config(comp.config, max_cache_len=8)
    with torch.no_grad():
        comp(ids, use_cache=True, **cache_kwargs(cache))
        with pytest.raises(ValueError, match="no room for 6 more"):
            comp(ids, use_cache=True, **cache_kwargs(cache))
        with pytest.raises(ValueError, match="of batch 2 got an update of batch 1"):
            comp(ids[:1, :1], use_cache=True, **cache_kwargs(cache))
    with pytest.raises(NotImplementedError, match="batch is fixed"):
        cache.batch_repeat_interleave(2)
    for storage, why in [
        ({"name": "gear"}, "gear cache storage re-encodes"),
        ({"name": "tale"}, "tale cache storage re-encodes"),
        ({"name": "quantized", "bits": 4, "residual": 8}, "residual window"),
    ]:
        comp.config.lrkv["cache"] = storage
        with pytest.raises(ValueError, match=why):
            StaticLatentCache.from_config(comp.config, max_cache_len=8)
    with pytest.raises(ValueError, match="≥ 1 token"):
        StaticLatentCache(2, 0)
    with pytest.raises(TypeError, match="cannot continue from a filled DynamicCache"):
        filled = DynamicCache()
        filled.update(torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 8), 0)
        comp(ids, **cache_kwargs(filled))
    assert isinstance(output_cache(comp(ids, use_cache=True)), LatentCache)  # the default stays dynamic


@pytest.mark.parametrize("arch, storage, overrides", list(WITH_ROPE.values()), ids=list(WITH_ROPE))
def test_a_decode_step_over_the_static_cache_compiles_whole(compress, arch, storage, overrides) -> None:
    """``fullgraph=True``: dynamo traces the whole step, cache writes included, without a graph break (the
    ``eager`` backend runs the traced graph as is), sliding layers past their window too; then generate()
    compiles its decode steps (CPU allowed) and gives the uncompiled tokens."""
    comp = _compressed(compress, arch, storage, **overrides)
    ids, mask = left_padded((8, 5))
    cache = StaticLatentCache.from_config(comp.config, max_cache_len=16)
    pos = positions_for(mask)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(comp.forward, backend="eager", fullgraph=True)
    with torch.no_grad():
        comp(ids, attention_mask=mask, position_ids=pos, use_cache=True, **cache_kwargs(cache))
        reference = output_cache(comp(ids, attention_mask=mask, position_ids=pos, use_cache=True))
        token = ids_for(2, 6, seed=4)
        for t in range(6):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            args = dict(attention_mask=mask, position_ids=pos[:, -1:] + t + 1, use_cache=True)
            got = step(token[:, t : t + 1], **args, **cache_kwargs(cache)).logits
            want = comp(token[:, t : t + 1], **args, **cache_kwargs(reference)).logits
            assert max_diff(got, want) <= 1e-5
            if t == 2:  # a sliding layer's count is made dynamic by then: later steps reuse the graphs
                graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    assert int(cache.get_seq_length()) == 14

    torch._dynamo.reset()
    ids, mask = left_padded((8, 5))
    compiled = greedy(
        comp, ids, mask, max_new_tokens=5, cache_implementation="static", pad_token_id=PAD,
        compile_config=_compile_everywhere(),
    )  # fmt: skip
    assert torch.equal(compiled, greedy(comp, ids, mask, max_new_tokens=5))


def _compile_everywhere() -> CompileConfig:
    """generate()'s automatic compilation, allowed on the CPU, traced whole, run by the eager backend."""
    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True
    return config


def test_a_compiled_step_reads_the_kernel_weights_an_eager_step_built(compress) -> None:
    """The decode kernel's weight layout is cached by the weights' addresses, which a compiled graph cannot
    read: inside one, the layout an eager step built is reused (traced whole), not rebuilt."""
    from lrkv_core.model.attention import LatentAttention

    layer = next(m for m in _compressed(compress).modules() if isinstance(m, LatentAttention))
    eager = layer.decode_weights(torch.float32)
    torch._dynamo.reset()
    up = torch.compile(lambda: layer.decode_weights(torch.float32).up * 1, backend="eager", fullgraph=True)
    assert torch.equal(up(), eager.up) and layer.decode_weights(torch.float32) is eager
