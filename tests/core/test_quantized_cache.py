"""The ``quantized`` cache storage inside compressed models: attention reads exactly the dequantized latents,
the bytes are the tensors', and everything generate() and save/load do works on it.

The reference for every exactness test is the same compressed model with a *dense* cache whose k_down/v_down
outputs are replaced by ``fake_quantize`` (forward hooks): per-token quantization makes each token's
dequantized latents independent of the others, so the quantized cache must give the very logits of that
model (``torch.equal``), prefill and decode, whatever the batch or padding, when both run the same steps.
Across different step shapes (a full forward against token-by-token decoding) float rounding of the
latents themselves differs by ~1e-7, which can move a value across a rounding boundary of the grid and so
by a whole quantization step: those comparisons are not exact properties, and no test makes them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from lrkv_core import load_compressed, save_compressed
from lrkv_core.cache import QuantizedStorage, QuantizedStore, cache_kwargs, cache_nbytes
from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from lrkv_core.evaluation.metrics import kv_bytes_per_token
from lrkv_core.format import LrkvFormat
from lrkv_core.model.adapters import get_adapter
from lrkv_core.quant import fake_quantize, group_widths, packed_width
from tests.support.inputs import decode_left_padded, greedy, ids_for, left_padded, max_diff
from tests.support.latents import replaced_latents, stepwise
from tests.support.models import SLIDING_WINDOW, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _compressed(compress, arch: str = "llama", group_size: int = 1, ratio: float = 0.5, **kw):
    model = tiny_model(arch, 4 if arch == "opt" else 2, **kw)
    return compress(model, group_size, ratio)[0]


def _quantizer(storage: dict, ranks: list[int], keep_last: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``storage`` gives back for latents (B, T, R) of groups ``ranks``; the last ``keep_last`` tokens
    are kept as given (a residual window holding them)."""
    st = QuantizedStorage(**{k: v for k, v in storage.items() if k != "name"})
    widths = group_widths(ranks, st.quant_group_size)

    def fq(h: torch.Tensor) -> torch.Tensor:
        return h.half().to(h.dtype) if st.bits == 16 else fake_quantize(h, widths, st.bits)

    def apply(out: torch.Tensor) -> torch.Tensor:
        cut = out.shape[1] - keep_last
        return torch.cat([fq(out[:, :cut]), out[:, cut:]], dim=1) if keep_last else fq(out)

    return apply


def dequantized_latents(model, storage: dict, keep_last: int = 0):
    """The model with a dense cache whose latents are replaced by what ``storage`` gives back."""
    return replaced_latents(model, lambda ranks: _quantizer(storage, ranks, keep_last))


STORAGES = [
    {"name": "quantized", "bits": b, **extra}
    for b, extra in [(2, {}), (3, {}), (4, {}), (8, {}), (16, {}), (3, {"quant_group_size": 2})]
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma3", "opt"])
@pytest.mark.parametrize("storage", STORAGES, ids=lambda s: f"b{s['bits']}-g{s.get('quant_group_size')}")
def test_quantized_attention_equals_attention_over_the_dequantized_latents(compress, arch, storage) -> None:
    comp = _compressed(compress, arch)
    ids = ids_for(2, 12)
    with torch.no_grad(), dequantized_latents(comp, storage):
        ref = comp(ids, use_cache=False).logits
        ref_decoded, _ = stepwise(comp, ids, 5)
    with torch.no_grad():
        plain = comp(ids, use_cache=True).logits  # a dense cache
        comp.config.lrkv["cache"] = storage
        prefill = comp(ids, use_cache=True)
    decoded, cache = stepwise(comp, ids, 5)
    assert all(type(layer.store) is QuantizedStore for layer in cache.layers)
    assert torch.equal(prefill.logits, ref)  # the same dequantized tensors, the same attention
    assert torch.equal(decoded, ref_decoded)  # and token by token
    assert max_diff(ref, plain) > (1e-3 if storage["bits"] < 8 else 0)  # quantization really happened


@pytest.mark.parametrize("residual", [1, 3, 20])
def test_the_residual_window_keeps_the_newest_tokens_exact_at_every_step(compress, residual) -> None:
    """After every step, attention reads the newest ``residual`` latents as computed, the older ones
    dequantized (checked on the latents the model computed, recorded as it ran)."""
    comp = _compressed(compress)
    storage = {"name": "quantized", "bits": 2, "residual": residual}
    fmt = LrkvFormat.of(comp.config)
    attn = get_adapter(comp.config).attention(comp, 1)
    seen: dict[str, list[torch.Tensor]] = {"k": [], "v": []}
    handles = [
        getattr(attn, f"{kind}_down").register_forward_hook(
            lambda _m, _a, out, kind=kind: seen[kind].append(out)
        )
        for kind in "kv"
    ]
    comp.config.lrkv["cache"] = storage
    ids = ids_for(2, 10)
    with torch.no_grad():
        out = comp(ids[:, :4], use_cache=True)
        for t in range(4, 11):
            store = out.past_key_values.layers[1].store
            view = store.view()
            for kind, ranks, got in (("k", fmt.ranks_k[1], view.keys), ("v", fmt.ranks_v[1], view.values)):
                h = torch.cat(seen[kind], dim=1)  # (B, t, R): every latent of layer 1 so far
                expected = _quantizer(storage, ranks, keep_last=min(residual, t))(h)
                assert torch.equal(torch.cat(got, dim=-1), expected)
            assert store.recent["k"].shape[1] == min(residual, t) and len(store) == t
            if t < 10:
                out = comp(ids[:, t : t + 1], **cache_kwargs(out.past_key_values), use_cache=True)
    for handle in handles:
        handle.remove()


def test_a_window_holding_every_token_decodes_exactly_as_dense(compress) -> None:
    comp = _compressed(compress)
    ids = ids_for(2, 10)
    dense, _ = stepwise(comp, ids, 4)
    comp.config.lrkv["cache"] = {"name": "quantized", "bits": 2, "residual": 10}
    assert torch.equal(stepwise(comp, ids, 4)[0], dense)


def _bytes_per_token(ranks_k: list[int], ranks_v: list[int], bits: int, group: int | None) -> int:
    """What one quantized token of one layer holds: packed codes, fp16 scale and zero per quantization
    group, and an int32 position."""
    n_groups = len(group_widths(ranks_k, group)) + len(group_widths(ranks_v, group))
    return packed_width(sum(ranks_k), bits) + packed_width(sum(ranks_v), bits) + 2 * 2 * n_groups + 4


@pytest.mark.parametrize(("bits", "group"), [(2, None), (3, None), (3, 2), (4, 4), (8, None)])
def test_the_bytes_reported_are_the_tensors_held(compress, bits: int, group: int | None) -> None:
    comp = _compressed(compress, group_size=2)  # one group of 2 KV heads: rank 8 per layer at ratio 0.5
    storage = {"name": "quantized", "bits": bits, "quant_group_size": group}
    comp.config.lrkv["cache"] = storage
    ids = ids_for(3, 11)
    with torch.no_grad():
        cache = comp(ids, use_cache=True).past_key_values
    fmt = LrkvFormat.of(comp.config)
    per_token = sum(_bytes_per_token(rk, rv, bits, group) for rk, rv in zip(fmt.ranks_k, fmt.ranks_v))
    tensors = [t for layer in cache.layers for t in layer.store.tensors()]
    assert cache_nbytes(cache) == sum(t.numel() * t.element_size() for t in tensors) == 3 * 11 * per_token
    codes = cache.layers[0].store.parts["k_codes"]
    assert codes.dtype == torch.uint8 and codes.shape == (3, 11, packed_width(8, bits))  # really packed
    kv = kv_bytes_per_token(comp, ids, n_rows=3)
    dense = 2 * 2 * 2 * 8 * 4  # the original fp32 cache: K and V, 2 layers, 2 KV heads of 8
    assert kv["kv_bytes_per_token"] == per_token and kv["dense_kv_bytes_per_token"] == dense
    assert kv["kv_compression_ratio"] == dense / per_token


def test_a_residual_window_is_counted_in_full_precision(compress) -> None:
    comp = _compressed(compress, group_size=2)
    comp.config.lrkv["cache"] = {"name": "quantized", "bits": 4, "residual": 4}
    with torch.no_grad():
        cache = comp(ids_for(2, 11), use_cache=True).past_key_values
    fmt = LrkvFormat.of(comp.config)
    old = sum(_bytes_per_token(rk, rv, 4, None) for rk, rv in zip(fmt.ranks_k, fmt.ranks_v))
    recent = sum(4 * (sum(rk) + sum(rv)) + 4 for rk, rv in zip(fmt.ranks_k, fmt.ranks_v))  # fp32 + position
    assert cache_nbytes(cache) == 2 * (7 * old + 4 * recent)


@pytest.mark.parametrize("storage", [STORAGES[1], STORAGES[-1]], ids=["b3", "b3-g2"])
def test_left_padded_batches_decode_as_the_dequantized_model(compress, storage) -> None:
    """Rows of different lengths (different positions, padding quantized too but masked) in one batch."""
    comp = _compressed(compress)
    ids, mask = left_padded((11, 7, 3))
    with dequantized_latents(comp, storage):
        ref_full, ref_steps, _ = decode_left_padded(comp, ids, mask)
    comp.config.lrkv["cache"] = storage
    full, steps, cache = decode_left_padded(comp, ids, mask)
    assert isinstance(cache.layers[0].store, QuantizedStore) and cache.get_seq_length() == 11
    assert torch.equal(full, ref_full) and torch.equal(steps, ref_steps)
    dense_steps = decode_left_padded(_compressed(compress), ids, mask)[1]
    valid = mask.bool()
    assert max_diff(steps[valid], dense_steps[valid]) > 1e-3  # quantized, really


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gemma3"])
def test_generate_and_beam_search_through_the_quantized_cache(compress, arch) -> None:
    comp = _compressed(compress, arch)
    storage = {"name": "quantized", "bits": 3}
    ids, mask = left_padded((9, 5, 2))
    with torch.no_grad(), dequantized_latents(comp, storage):
        ref_greedy, ref_beam = greedy(comp, ids, mask), greedy(comp, ids, mask, num_beams=2)
    comp.config.lrkv["cache"] = storage
    got = greedy(comp, ids, mask, num_beams=2, return_dict_in_generate=True)
    assert torch.equal(greedy(comp, ids, mask), ref_greedy) and torch.equal(got.sequences, ref_beam)
    assert got.past_key_values.storage == QuantizedStorage(bits=3)


@pytest.mark.parametrize("storage", [{"name": "quantized", "bits": 3}, {"name": "tale", "bits": 3}])
def test_cache_writes_never_read_codes_back_to_the_host(compress, monkeypatch, storage) -> None:
    """Packing a step's codes checks nothing on the host: on a GPU that check is a sync per layer and step,
    and a CUDA graph cannot capture it (the quantizer's codes are in range by construction)."""
    import lrkv_core.quant.packing as packing

    def refuse(codes, bits):
        raise AssertionError("a cache write read its codes back to check them")

    comp = _compressed(compress)
    comp.config.lrkv["cache"] = storage
    ids, mask = left_padded((7, 4))
    ref = greedy(comp, ids, mask)
    monkeypatch.setattr(packing, "_check_codes", refuse)
    assert torch.equal(greedy(comp, ids, mask), ref)
    with pytest.raises(AssertionError, match="read its codes back"):  # the check still guards pack_codes
        packing.pack_codes(torch.zeros(3, dtype=torch.uint8), 3)


def test_save_and_load_rebuild_the_quantized_cache_and_the_rotation(tmp_path) -> None:
    model = tiny_model("llama", 2)
    rows = torch.randint(3, 61, (8, 24), generator=torch.Generator().manual_seed(1))
    cache = {"name": "quantized", "bits": 3, "quant_group_size": 4, "residual": 2}
    config = CompressionConfig(
        ratio=0.5, group_size=1, rank_multiple=4, allocator="uniform", cache=cache, rotation="auto"
    )
    comp = plan_conversion(model, rows, config).apply(model)
    out = save_compressed(comp, tmp_path / "m")
    section = LrkvFormat.of(comp.config)
    assert section.cache == cache and section.rotation == "auto"
    ids = ids_for(2, 10)
    with torch.no_grad():
        ref = comp(ids, use_cache=True).logits
    for loaded in (load_compressed(out), AutoModelForCausalLM.from_pretrained(out)):
        assert LrkvFormat.of(loaded.config) == section
        with torch.no_grad():
            got = loaded(ids, use_cache=True)
        assert torch.equal(got.logits, ref)
        assert got.past_key_values.storage == QuantizedStorage(bits=3, quant_group_size=4, residual=2)
        assert torch.equal(greedy(loaded, ids), greedy(comp, ids))


def test_the_quantized_storage_composes_with_the_sliding_window(compress) -> None:
    comp, _ = compress(tiny_model("mistral", 2, sliding_window=SLIDING_WINDOW), 2)
    storage = {"name": "quantized", "bits": 4}
    ids = ids_for(2, 3 * SLIDING_WINDOW)
    with dequantized_latents(comp, storage):
        ref, _ = stepwise(comp, ids, 2)
    comp.config.lrkv["cache"] = storage
    decoded, cache = stepwise(comp, ids, 2)
    assert torch.equal(decoded, ref)
    comp.config.lrkv["cache"] = storage | {"residual": 2}
    cache = stepwise(comp, ids, 2)[1]
    for layer in cache.layers:  # window − 1 tokens kept: 2 of them exact, the older ones encoded
        assert len(layer.store) == SLIDING_WINDOW - 1 and layer.store.recent["k"].shape[1] == 2
        assert layer.store.positions.shape[1] == SLIDING_WINDOW - 1


def test_a_quantization_group_that_does_not_divide_the_ranks_is_refused_early(compress) -> None:
    model = tiny_model("llama", 2)
    cache = {"name": "quantized", "bits": 4, "quant_group_size": 3}
    bad = CompressionConfig(ratio=0.5, group_size=1, rank_multiple=4, allocator="uniform", cache=cache)
    with pytest.raises(ValueError, match=r"quantization group size 3 does not divide .* rank multiple \(4\)"):
        bad.for_model(model.config)
    comp = _compressed(compress)
    comp.config.lrkv["cache"] = {"name": "quantized", "bits": 4, "quant_group_size": 3}
    with pytest.raises(ValueError, match="does not divide the latent group rank"):
        comp(ids_for(1, 3), use_cache=True)
    for options, message in [({"bits": 5}, "bits must be one of"), ({"residual": -1}, "residual must be")]:
        with pytest.raises(ValueError, match=message):
            QuantizedStorage(**options)


def test_the_bytes_held_through_a_long_decode_are_the_codes_and_the_window() -> None:
    # 3-bit codes in quantization groups of 4 and a residual window of 16 tokens, through a prefill of 10
    # (all in the window) and 150 one-token steps: at each step the codes of the tokens pushed out, the
    # window in float32 and every position
    ranks_k, ranks_v, batch = (8, 8), (16,), 2
    store = QuantizedStorage(bits=3, quant_group_size=4, residual=16).create_store(ranks_k, ranks_v)
    gen = torch.Generator().manual_seed(0)
    h_k, h_v = torch.randn(batch, 160, 16, generator=gen), torch.randn(batch, 160, 16, generator=gen)
    positions = torch.arange(160)[None].expand(batch, -1)
    store.append(h_k[:, :10], h_v[:, :10], positions[:, :10])
    encoded, recent = _bytes_per_token(ranks_k, ranks_v, 3, 4), (16 + 16) * 4 + 4  # each with its position
    for t in range(10, 160):
        store.append(h_k[:, t : t + 1], h_v[:, t : t + 1], positions[:, t : t + 1])
        s_r = min(t + 1, 16)
        s_e = t + 1 - s_r
        expected = s_e * encoded + s_r * recent
        assert store._encoded() == s_e and sum(x.nbytes for x in store.tensors()) == batch * expected
