"""The flash-decoding kernel over a quantized cache's packed codes: unpacking 2-, 3- and 4-bit codes (and
8-bit) in registers and dequantizing them with their float16 scales and zero-points gives the attention of
the dequantized latents (:func:`latent_decode_attention_packed_ref`), which is the quantized storage's.

Without a GPU the Triton kernel runs in Triton's interpreter on CPU tensors (tests/conftest.py sets
``TRITON_INTERPRET=1`` when no CUDA device is present); with one, the tests run on the GPU.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from lrkv_core.cache import cache_kwargs
from lrkv_core.quant import dequantize, group_widths, pack_codes, packed_width, quantize, unpack_codes
from lrkv_kernels.latent_rope import (
    PackedLatents,
    dequantize_ref,
    latent_decode_attention,
    latent_decode_attention_packed_ref,
    latent_decode_attention_ref,
    triton_runs_on,
)
from tests.kernels.test_flash_decode import DEVICE, layer, relative_error
from tests.kernels.test_fused_scores import fused
from tests.support.inputs import PAD, greedy, ids_for, left_padded
from tests.support.models import tiny_model

pytest.importorskip("triton", reason="the kernel needs Triton (installed by scripts/setup.sh)")


def packed(h: torch.Tensor, ranks, bits: int, group_width: int | None, recent: int = 0) -> PackedLatents:
    """Latents h (B, S, R) as the quantized storage keeps them: the first S − ``recent`` tokens quantized
    and packed (:mod:`lrkv_core.quant`), the last ``recent`` as they are."""
    S = h.shape[1]
    rows = quantize(h[:, : S - recent], group_widths(ranks, group_width), bits)
    window = h[:, S - recent :] if recent else None
    return PackedLatents(
        pack_codes(rows.codes, bits), rows.scale, rows.zero, bits, group_width, window, h.dtype
    )


def packed_layer(B, S, s, D, n_rep, ranks_k, ranks_v, bits, group_width=None, recent=0, norm_eps=None):
    """:func:`layer`'s inputs with packed key and value latents."""
    q, h_k, h_v, weights, positions, inv_freq = layer(
        B, S, s, D, n_rep, ranks_k, ranks_v, True, norm_eps=norm_eps
    )
    k = packed(h_k, ranks_k, bits, group_width, recent)
    v = packed(h_v, ranks_v, bits, group_width, recent)
    return q, k, v, weights, positions, inv_freq


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("ranks, group_width", [((5, 11), None), ((16, 8, 24), 8), ((13,), None)])
def test_dequantize_ref_reads_the_storage_layout(bits, ranks, group_width):
    """The kernels' reference reading of packed codes is the quantized storage's dequantization, exactly."""
    gen = torch.Generator().manual_seed(bits)
    h = torch.randn(2, 7, sum(ranks), generator=gen)
    latents = packed(h, ranks, bits, group_width)
    widths = group_widths(ranks, group_width)
    codes = unpack_codes(latents.codes, bits, sum(ranks))
    rows = dataclasses.replace(quantize(h, widths, bits), codes=codes)
    assert torch.equal(dequantize_ref(latents, ranks), dequantize(rows, widths, torch.float32))


CASES = [  # B, S, s, D, n_rep, ranks_k, ranks_v, group_width, recent
    (2, 37, 2, 8, 3, (5,), (7,), None, 0),  # head_dim 8, GQA 3, odd ranks: 3-bit codes cross bytes
    (2, 150, 1, 32, 2, (24, 40), (16, 33), None, 0),  # two groups of different ranks, several splits
    (1, 70, 1, 64, 3, (96, 80, 16), (96, 64, 24), 8, 0),  # three groups, quantization groups of 8
    (3, 90, 2, 16, 2, (12, 20), (10, 6), None, 5),  # a residual window of 5 unquantized tokens
    (1, 40, 1, 16, 2, (6, 10), (4, 8), 1, 0),  # a scale and zero-point per latent
]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("B, S, s, D, n_rep, ranks_k, ranks_v, group_width, recent", CASES)
def test_packed_kernel_equals_reference(bits, B, S, s, D, n_rep, ranks_k, ranks_v, group_width, recent):
    assert triton_runs_on(torch.device(DEVICE))
    args = packed_layer(B, S, s, D, n_rep, ranks_k, ranks_v, bits, group_width, recent)
    got = latent_decode_attention(*args, attention_scaling=1.1, scaling=D**-0.5)
    ref = latent_decode_attention_packed_ref(*args, attention_scaling=1.1, scaling=D**-0.5)
    assert got.shape == (B, sum(s * n_rep * r for r in ranks_v)) and got.dtype == torch.float32
    assert relative_error(got, ref) < 1e-5


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_packed_kernel_with_key_norm(bits):
    """QK-norm (Qwen3): keys rebuilt from unpacked latents are RMS-normed per KV head before RoPE."""
    args = packed_layer(2, 80, 2, 32, 2, (24, 13), (16, 9), bits, recent=3, norm_eps=1e-6)
    got = latent_decode_attention(*args, attention_scaling=1.0, scaling=32**-0.5)
    ref = latent_decode_attention_packed_ref(*args, attention_scaling=1.0, scaling=32**-0.5)
    assert relative_error(got, ref) < 1e-5


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n_splits", [1, 3, 7])
def test_packed_splits_merge_to_the_same_attention(bits, n_splits):
    """However the sequence is split (splits and tiles that straddle the packed tokens and the residual
    window included), the merged partial softmaxes give the one-pass result."""
    from lrkv_kernels.latent_rope.flash import latent_decode_attention_triton

    args = packed_layer(2, 200, 1, 32, 2, (24, 16), (8, 24), bits, group_width=8, recent=27)
    ref = latent_decode_attention_packed_ref(*args, attention_scaling=1.0, scaling=0.2)
    got = latent_decode_attention_triton(*args, 1.0, 0.2, n_splits=n_splits, block_s=16)
    assert relative_error(got, ref) < 1e-5


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("layout", [(1, False), (4, True)])
def test_packed_head_layouts_give_the_same_attention(bits, layout):
    """Packed latents rebuilt a KV head at a time or all three at once with ``B_k`` read once per program."""
    from lrkv_kernels.latent_rope.flash import latent_decode_attention_triton

    args = packed_layer(2, 90, 3, 32, 2, (21, 13), (16, 9), bits, recent=4, norm_eps=1e-6)
    ref = latent_decode_attention_packed_ref(*args, attention_scaling=1.0, scaling=0.2)
    heads, hoist = layout
    got = latent_decode_attention_triton(*args, 1.0, 0.2, block_s=16, heads_per_block=heads, hoist=hoist)
    assert relative_error(got, ref) < 1e-5


def test_packed_reference_is_attention_over_the_quantized_latents():
    """The packed reference attends to exactly what the quantized storage gives back (its dequantized
    latents, the residual window as given)."""
    q, k, v, weights, positions, inv_freq = packed_layer(2, 40, 2, 16, 2, (12, 20), (10, 6), 3, recent=4)
    keys, values = dequantize_ref(k, (12, 20)), dequantize_ref(v, (10, 6))
    args = (q, keys, values, weights, positions, inv_freq)
    ref = latent_decode_attention_ref(*args, attention_scaling=1.0, scaling=0.25)
    got = latent_decode_attention_packed_ref(q, k, v, *args[3:], attention_scaling=1.0, scaling=0.25)
    assert torch.equal(got, ref)
    assert torch.equal(keys[:, 36:], k.recent)  # the window's tokens unchanged


def widened(codes: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Packed rows (B, S, bytes) zero-padded to hold ``n`` codes of ``bits`` bits."""
    return torch.nn.functional.pad(codes, (0, max(packed_width(n, bits) - codes.shape[-1], 0)))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_comparison_detects_a_wrong_scale_or_bit_width(bits):
    """The comparison the tests above make can fail: one quantization group's scales off by 1 %, or the codes
    read at another bit width, move the attention far past the tolerance."""
    args = packed_layer(2, 60, 1, 32, 2, (24, 16), (16, 8), bits)
    q, k, v = args[:3]
    got = latent_decode_attention(*args, attention_scaling=1.0, scaling=0.2)
    ref = latent_decode_attention_packed_ref(*args, attention_scaling=1.0, scaling=0.2)
    assert relative_error(got, ref) < 1e-5
    for kind in ("k", "v"):
        latents = k if kind == "k" else v
        scale = latents.scale.clone()
        scale[..., 1] *= 1.01
        wrong = dataclasses.replace(latents, scale=scale)
        wrong_args = (q, wrong, v) if kind == "k" else (q, k, wrong)
        off = latent_decode_attention_packed_ref(*wrong_args, *args[3:], attention_scaling=1.0, scaling=0.2)
        assert relative_error(got, off) > 1e-4
    for other in {2, 3, 4} - {bits}:  # the same bytes (zero-padded to the row's width), read at another width
        misread = [
            dataclasses.replace(x, bits=other, codes=widened(x.codes, n, other))
            for x, n in ((k, 40), (v, 24))
        ]
        off = latent_decode_attention(q, *misread, *args[3:], attention_scaling=1.0, scaling=0.2)
        assert relative_error(off, ref) > 1e-2


def spy_on_decode(monkeypatch) -> tuple[list[type], list[str]]:
    """Records the type of the key latents the decode kernel is given, and each dequantization of a
    quantized store's parts (the kind), while a model runs."""
    import lrkv_core.model.attention as attention
    from lrkv_core.cache import QuantizedStore

    kinds: list[type] = []
    dequantized: list[str] = []
    kernel, dequantize_parts = attention.latent_decode_attention, QuantizedStore._dequantized

    def kernel_spy(q, h_k, *args, **kwargs):
        kinds.append(type(h_k))
        return kernel(q, h_k, *args, **kwargs)

    def dequantize_spy(self, parts, kind, dtype):
        dequantized.append(kind)
        return dequantize_parts(self, parts, kind, dtype)

    monkeypatch.setattr(attention, "latent_decode_attention", kernel_spy)
    monkeypatch.setattr(QuantizedStore, "_dequantized", dequantize_spy)
    return kinds, dequantized


@pytest.mark.parametrize(
    "arch, group_size, cache",
    [
        ("llama", 2, {"name": "quantized", "bits": 2}),
        ("llama", 1, {"name": "quantized", "bits": 3, "residual": 3}),  # a residual window after the codes
        ("qwen3", 2, {"name": "quantized", "bits": 4, "quant_group_size": 2}),  # QK-norm; layer 1 slides
        ("qwen3", 1, {"name": "quantized", "bits": 3}),
    ],
)
def test_decode_through_the_packed_kernel_gives_the_unfused_logits(
    compress, monkeypatch, arch, group_size, cache
):
    """A quantized cache hands the decode kernel its packed codes: every decode step of every layer reads
    them (no dequantized copy: the store dequantizes only for the unfused attention), and each step's
    logits are the unfused path's, which attends to the dequantized latents, from the same cache.

    The kernel's attention differs from the unfused path's by about 1e-7, so the next layer's new latents
    can round a code or a float16 scale the other way: a step then differs by the quantizer's step, not
    the kernel's error (seen in the qwen3 3-bit case: one row of one step at 2.6e-4, every other step within
    2e-6). Each step starts both paths from one cache, so such a rounding does not carry into the later
    steps: every step stays within 1e-4 but at most one, and that one within 2e-3."""
    comp = compress(tiny_model(arch, 2), group_size, 0.5, rank_multiple=2)[0].to(DEVICE)
    comp.config.lrkv["cache"] = cache
    ids = ids_for(2, 14).to(DEVICE)
    kinds, dequantized = spy_on_decode(monkeypatch)
    with torch.no_grad(), fused(comp, False):
        out = comp(ids[:, :5], use_cache=True)
    diffs = []  # each step's largest difference of the logits
    for t in range(5, ids.shape[1]):
        step = ids[:, t : t + 1]
        mine = copy.deepcopy(out.past_key_values)
        dequantized.clear()
        with torch.no_grad(), fused(comp, True):
            got = comp(step, **cache_kwargs(mine), use_cache=True).logits
        assert dequantized == []  # the kernel read the codes as stored
        with torch.no_grad(), fused(comp, False):
            out = comp(step, **cache_kwargs(out.past_key_values), use_cache=True)
        diffs.append(float((got - out.logits).abs().max()))
    assert max(diffs) < 2e-3 and sum(d > 1e-4 for d in diffs) <= 1, diffs
    assert kinds == [PackedLatents] * (9 * 2)  # 9 decode steps × 2 layers


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_left_padded_generate_through_the_packed_kernel(compress, monkeypatch, bits):
    """Greedy generation from left-padded prompts through the packed kernel equals the unfused quantized
    path's."""
    comp = compress(tiny_model("llama", 2), 1, 0.5, rank_multiple=1)[0].to(DEVICE)
    comp.config.lrkv["cache"] = {"name": "quantized", "bits": bits}
    ids, mask = left_padded((9, 4, 7))
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    with fused(comp, False):
        ref = greedy(comp, ids, mask, max_new_tokens=10)
    kinds, _ = spy_on_decode(monkeypatch)
    with fused(comp, True):
        got = greedy(comp, ids, mask, max_new_tokens=10)
    assert kinds and set(kinds) == {PackedLatents}
    assert torch.equal(got, ref) and (got[:, ids.shape[1] :] != PAD).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="half-precision tl.dot needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_packed_kernel_half_precision_on_cuda(dtype, bits):
    """16-bit models: codes dequantized in float32 and rounded to the model's dtype, as the storage does."""
    q, h_k, h_v, weights, positions, inv_freq = layer(
        4, 3000, 2, 64, 3, (96, 40), (96, 24), True, dtype=dtype
    )
    k = packed(h_k, (96, 40), bits, 8, recent=17)
    v = packed(h_v, (96, 24), bits, 8, recent=17)
    args = (q, k, v, weights, positions, inv_freq)
    got = latent_decode_attention(*args, attention_scaling=1.0, scaling=0.125)
    ref = latent_decode_attention_packed_ref(*args, attention_scaling=1.0, scaling=0.125)
    assert got.dtype == dtype
    assert relative_error(got, ref) < (3e-3 if dtype == torch.float16 else 2e-2)


@pytest.mark.parametrize("storage", [{"bits": 3, "residual": 2}, {"bits": 2, "quant_group_size": 4}])
def test_quantized_store_hands_out_its_packed_parts(storage):
    """A quantized store's view carries its packed parts, which read back (the kernels' spec) as exactly
    the latents its plain view gives, and keeps them after the store drops tokens (a sliding window)."""
    from lrkv_core.cache import LatentStore
    from tests.support.latents import RANKS_K, RANKS_V, filled_store

    gen = torch.Generator().manual_seed(5)
    h_k, h_v = torch.randn(2, 9, sum(RANKS_K), generator=gen), torch.randn(2, 9, sum(RANKS_V), generator=gen)
    store = filled_store({"name": "quantized"} | storage, h_k, h_v, [6, 1, 2])
    view, plain = store.view(), LatentStore.view(store)
    k, v = view.packed
    assert len(k) == len(v) == 9 and (k.recent is None) == ("residual" not in storage)
    assert torch.equal(dequantize_ref(k, RANKS_K), torch.cat(plain.keys, -1))
    assert torch.equal(dequantize_ref(v, RANKS_V), torch.cat(plain.values, -1))
    store.keep_last(3)
    assert torch.equal(torch.cat(view.keys, -1), torch.cat(plain.keys, -1))
    assert torch.equal(torch.cat(view.values, -1), torch.cat(plain.values, -1))


@pytest.mark.parametrize(
    "storage", [{"name": "quantized", "bits": 16}, {"name": "gear", "bits": 4, "buffer": 0}]
)
def test_other_storages_hand_out_latents(storage):
    """Float16 latents and GEAR's (codes plus a low-rank residual) are no packed codes: attention reads
    their latents."""
    from tests.support.latents import filled_store

    h = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(1))
    store = filled_store(storage, h, h, [6])
    assert store.parts and store.view().packed is None


def test_word_bytes_follow_the_bit_width_and_the_groups_alignment():
    """Codes are read a word at a time only where every group starts at a whole word: 8 codes in 3 bytes
    for 3-bit codes, 4 (2) in a byte for 2- (4-) bit codes; unpacked and 8-bit latents are read as before."""
    from lrkv_kernels.latent_rope.decode import alignment
    from lrkv_kernels.latent_rope.flash import word_bytes

    assert [alignment(r) for r in ([24, 40], [16, 33], [12, 20], [6, 10], [96, 80, 16])] == [8, 1, 4, 2, 8]
    assert [word_bytes(3, a) for a in (8, 4, 1)] == [3, 0, 0]
    assert [word_bytes(2, a) for a in (8, 4, 2)] == [1, 1, 0]
    assert [word_bytes(4, a) for a in (2, 1)] == [1, 0]
    assert word_bytes(8, 8) == word_bytes(0, 8) == 0


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize(
    "ranks_k, ranks_v, group_width, recent",
    [((24, 40), (16, 32), None, 0), ((96, 80, 16), (96, 64, 24), 8, 5), ((8, 24), (8, 16), 4, 0)],
)
def test_codes_read_by_words_equal_codes_read_one_by_one(bits, ranks_k, ranks_v, group_width, recent):
    """Reading whole words and cutting codes in registers gives the same attention as reading each code's
    bytes, which is the reference's (ranks aligned to whole words, so the word path is taken)."""
    from lrkv_kernels.latent_rope.flash import latent_decode_attention_triton

    args = packed_layer(2, 70, 1, 32, 2, ranks_k, ranks_v, bits, group_width, recent)
    ref = latent_decode_attention_packed_ref(*args, attention_scaling=1.0, scaling=0.2)
    stats: dict = {}
    words = latent_decode_attention_triton(*args, 1.0, 0.2, block_s=16, stats=stats)
    codes = latent_decode_attention_triton(*args, 1.0, 0.2, block_s=16, unpack_words=False)
    assert stats["word_bytes"][0] and relative_error(words, ref) < 1e-5
    torch.testing.assert_close(words, codes, rtol=1e-6, atol=1e-7)
