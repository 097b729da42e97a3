"""The anchor: transformers' QuantizedCache on the original model, evaluated and measured like lrkv's caches.

Needs the optional backends (``pip install 'lrkv[anchor]'``, which scripts/setup.sh installs); each test
skips with the reason when its backend is absent.
"""

from __future__ import annotations

import pytest
import torch

from lrkv_core.cache import cache_kwargs, cache_nbytes
from lrkv_core.evaluation.hf_quantized_cache import HfQuantizedCacheSpec
from lrkv_core.evaluation.metrics import decode_perplexity, kv_bytes_per_token, prefill_perplexity
from tests.support.inputs import ids_for
from tests.support.models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_specs_parse_and_are_checked() -> None:
    assert HfQuantizedCacheSpec.parse("hqq:3") == HfQuantizedCacheSpec("hqq", 3, None, 0)
    assert HfQuantizedCacheSpec.parse("quanto:2:4:16") == HfQuantizedCacheSpec("quanto", 2, 4, 16)
    for text, message in [
        ("quanto:3", r"takes \(2, 4\) bits"),
        ("gptq:4", "unknown QuantizedCache backend"),
        ("hqq", "BACKEND:BITS"),
        ("hqq:four", "must be integers"),
    ]:
        with pytest.raises(ValueError, match=message):
            HfQuantizedCacheSpec.parse(text)


def test_it_is_refused_for_an_lrkv_model(compress) -> None:
    comp, _ = compress(tiny_model("llama", 2), 1)
    with pytest.raises(ValueError, match="original models, not lrkv ones"):
        HfQuantizedCacheSpec("hqq", 4).make(comp.config)


def test_hqq_anchor_is_evaluated_and_its_bytes_are_its_codes_scales_and_zeros() -> None:
    pytest.importorskip("hqq", reason="the hqq backend is not installed (pip install 'lrkv[anchor]')")
    model = tiny_model("llama", 2)
    spec = HfQuantizedCacheSpec("hqq", 2, q_group_size=4)
    ids = ids_for(2, 16)
    with torch.no_grad():
        cache = model(ids, **cache_kwargs(spec.make(model.config)), use_cache=True).past_key_values
    expected = 0
    for layer in cache.layers:
        for codes, meta in (layer._quantized_keys, layer._quantized_values):
            assert (
                codes.dtype == torch.uint8 and codes.numel() == 2 * 2 * 16 * 8 // 4
            )  # four 2-bit codes a byte
            expected += codes.numel() + 4 * (meta["scale"].numel() + meta["zero"].numel())  # fp32 scale/zero
        expected += sum(
            t.numel() * t.element_size() for t in (layer.keys, layer.values)
        )  # the fp window (empty)
    assert cache_nbytes(cache) == expected
    factory = lambda: spec.make(model.config)  # noqa: E731
    kv = kv_bytes_per_token(model, ids, n_rows=2, cache_factory=factory)
    assert kv["kv_bytes_total"] == expected and kv["cache_class"] == "QuantizedCache"
    assert kv["kv_compression_ratio"] == 2 * 2 * (2 * 2 * 16 * 8) * 4 / expected > 1  # K, V; 2 layers; fp32
    # the prompt is attended in full precision; decoding reads the quantized cache
    assert (
        prefill_perplexity(model, ids, cache_factory=factory)["nll"] == prefill_perplexity(model, ids)["nll"]
    )
    exact = decode_perplexity(model, ids, prefix_len=8)["nll"]
    assert abs(decode_perplexity(model, ids, prefix_len=8, cache_factory=factory)["nll"] - exact) > 1e-3


def test_quanto_packed_codes_are_counted_as_packed() -> None:
    pytest.importorskip(
        "optimum.quanto", reason="optimum-quanto is not installed (pip install 'lrkv[anchor]')"
    )
    model = tiny_model("llama", 2)
    with torch.no_grad():
        cache = model(
            ids_for(2, 16),
            **cache_kwargs(HfQuantizedCacheSpec("quanto", 4).make(model.config)),
            use_cache=True,
        ).past_key_values
    codes = cache.layers[0]._quantized_keys._data  # quanto's PackedTensor: (B·Hkv·T, D) codes, two a byte
    assert (
        codes.numel() == 2 * 2 * 16 * 8
        and codes._data.numel() * codes._data.element_size() == codes.numel() // 2
    )
    # per layer: K and V packed codes, an fp32 scale and shift per token and head (group = head dim)
    per_layer = 2 * (2 * 2 * 16 * 8 // 2 + 2 * 4 * 2 * 2 * 16)
    assert cache_nbytes(cache) == 2 * per_layer
