"""Qwen2 (q/k/v biases, RoPE, per-layer sliding window) and OPT (no RoPE, learned positions, biases
everywhere) through the same compression, on tiny random configs built here.

Cases: Qwen2 MHA (Hkv = H = 4) and GQA (Hkv = 2) × group sizes 1 and Hkv; OPT (MHA, H = 4) × group sizes 1
and H; each with the "whitened" and "plain" decompositions. Layer 1 of the Qwen2 configs is a sliding-window
layer (window 6, shorter than the 12-token inputs). Attention biases are drawn at random (std 0.5; HF
initialises them to zero), so a fusion that mishandles them fails. At ratio 1.0 a compressed model is the
original up to float rounding: fp32 logits within 1e-4, float64 within 1e-10, identical greedy generations.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lrkv_core.adapters import UnsupportedModelError, get_adapter
from lrkv_core.attention import LatentAttention
from lrkv_core.attention_norope import NoRopeLatentAttention
from lrkv_core.cache import LatentCache, LatentLayer
from lrkv_core.evaluate import kv_bytes_per_token
from lrkv_core.io import load_compressed, save_compressed
from tests.support.inputs import (
    PAD,
    decode_left_padded,
    greedy,
    ids_for,
    left_padded,
    max_diff,
    positions_for,
)

pytestmark = pytest.mark.usefixtures("one_thread")

T = 12
WINDOW = 6  # Qwen2 layer 1 slides over 6 tokens
COMMON = dict(
    vocab_size=61,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
)
CASES = [("qwen2", 4, 1), ("qwen2", 4, 4), ("qwen2", 2, 1), ("qwen2", 2, 2), ("opt", 4, 1), ("opt", 4, 4)]
IDS = [f"{arch}-hkv{hkv}-s{s}" for arch, hkv, s in CASES]
METHODS = ("whitened", "plain", "pca")


def make_model(arch: str, n_kv_heads: int = 4, seed: int = 0, **overrides) -> PreTrainedModel:
    """A fresh 2-layer model in eval mode with random attention biases (std 0.5)."""
    torch.manual_seed(seed)
    if arch == "qwen2":
        config = Qwen2Config(
            **COMMON,
            intermediate_size=48,
            head_dim=8,
            num_key_value_heads=n_kv_heads,
            initializer_range=0.2,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,  # layers ≥ 1 slide
            **overrides,
        )
        model = Qwen2ForCausalLM(config)
    else:
        assert n_kv_heads == COMMON["num_attention_heads"], "OPT is MHA"
        config = OPTConfig(**COMMON, ffn_dim=48, word_embed_proj_dim=32, init_std=0.2, **overrides)
        model = OPTForCausalLM(config)
    adapter = get_adapter(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for i in range(config.num_hidden_layers):
            for proj in "qkvo":
                bias = getattr(adapter.attention(model, i), getattr(adapter, f"{proj}_name")).bias
                if bias is not None:
                    bias.copy_(0.5 * torch.randn(bias.shape, generator=gen))
    return model.eval()


# ------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch,hkv,group_size", CASES, ids=IDS)
def test_full_rank_is_exact_in_fp32_and_float64(compress, arch, hkv, group_size, method) -> None:
    """fp32 logits within 1e-4; in float64 logits within 1e-10 and every attention output within 1e-12
    relative (Qwen2's RMSNorm computes in float32 and could hide attention errors below its rounding)."""
    model = make_model(arch, hkv)
    comp, plan = compress(model, group_size, method=method)
    assert plan.achieved_ratio == 1.0
    expected = LatentAttention if arch == "qwen2" else NoRopeLatentAttention
    adapter = get_adapter(comp.config)
    assert all(type(adapter.attention(comp, i)) is expected for i in range(2))
    ids = ids_for(2, T)
    with torch.no_grad():
        out = comp(ids, use_cache=True)
        assert max_diff(out.logits, model(ids).logits) <= 1e-4
    assert isinstance(out.past_key_values, LatentCache) and out.past_key_values.get_seq_length() == T

    model = model.double()
    comp, _ = compress(model, group_size, method=method)
    assert comp.dtype == torch.float64
    captured: dict[str, list[torch.Tensor]] = {"orig": [], "comp": []}
    handles = [
        adapter.attention(m, i).register_forward_hook(lambda _m, _a, o, key=key: captured[key].append(o[0]))
        for key, m in (("orig", model), ("comp", comp))
        for i in range(2)
    ]
    try:
        with torch.no_grad():
            ref, got = model(ids).logits, comp(ids).logits
    finally:
        for h in handles:
            h.remove()
    assert max_diff(got, ref) <= 1e-10
    for a, b in zip(captured["orig"], captured["comp"], strict=True):
        assert max_diff(a, b) <= 1e-12 * (1 + a.abs().max().item())


def test_qwen2_biases_are_kept_and_needed(compress) -> None:
    """Palu's Qwen2 path was garbage until it kept the k/v bias: dropping either breaks exactness here."""
    model = make_model("qwen2", 2)
    comp, _ = compress(model, 1)
    adapter = get_adapter(comp.config)
    ids = ids_for(2, T)
    with torch.no_grad():
        ref = model(ids).logits
        assert max_diff(comp(ids).logits, ref) <= 1e-4
        no_k_bias, no_v_bias = copy.deepcopy(comp), copy.deepcopy(comp)
        for i in range(2):
            for up in adapter.attention(no_k_bias, i).k_up:
                up.bias.zero_()  # keeps q's bias: only the k bias is gone
            adapter.attention(no_v_bias, i).o_proj.bias.zero_()  # Qwen2's o_proj has no bias: only b_v's fold
        assert max_diff(no_k_bias(ids).logits, ref) > 0.1
        assert max_diff(no_v_bias(ids).logits, ref) > 0.1


def test_opt_key_bias_cancels_and_is_dropped(compress) -> None:
    """With no rotation the k bias only shifts each query row's scores by q·b_k: the original's logits do
    not see it, and the compressed model holds it nowhere (no k_up; k_down has no bias)."""
    model = make_model("opt")
    ids = ids_for(2, T)
    shifted_k, shifted_q = copy.deepcopy(model), copy.deepcopy(model)
    adapter = get_adapter(model.config)
    with torch.no_grad():
        for i in range(2):
            adapter.attention(shifted_k, i).k_proj.bias.add_(3.0)
            adapter.attention(shifted_q, i).q_proj.bias.add_(3.0)
        ref = model(ids).logits
        assert max_diff(shifted_k(ids).logits, ref) <= 1e-4
        assert max_diff(shifted_q(ids).logits, ref) > 0.1  # the q bias is not free: it is fused
        comp, _ = compress(model, 1)
        assert max_diff(comp(ids).logits, ref) <= 1e-4
    attn = adapter.attention(comp, 0)
    assert not hasattr(attn, "k_up") and attn.k_down.bias is None
    assert attn.q_proj.weight.shape == (4 * 8, 32)  # H heads × r_g = D at full rank, s = 1
    assert comp.config.lrkv["rope"] == "keys-fused-into-q"


def test_qwen2_sliding_window_is_in_effect(compress) -> None:
    """The Qwen2 cases test the per-layer window: without it the original's logits change past position 6."""
    model = make_model("qwen2", 2)
    full = make_model("qwen2", 2, layer_types=["full_attention"] * 2)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    adapter = get_adapter(model.config)
    assert [adapter.attention_kwargs(model.config, i) for i in range(2)] == [
        {"sliding_window": None},
        {"sliding_window": WINDOW},
    ]
    ids = ids_for(2, T)
    with torch.no_grad():
        windowed, unwindowed = model(ids).logits, full(ids).logits
        comp_logits = compress(model, 2)[0](ids).logits
    assert max_diff(windowed[:, :WINDOW], unwindowed[:, :WINDOW]) <= 1e-6
    assert max_diff(windowed[:, WINDOW:], unwindowed[:, WINDOW:]) > 1e-2
    assert max_diff(comp_logits, windowed) <= 1e-4


# -------------------------------------------------------------------------------- generation and cache


@pytest.mark.parametrize("arch,hkv,group_size", CASES, ids=IDS)
def test_greedy_generate_matches_batched_and_left_padded(compress, arch, hkv, group_size) -> None:
    model = make_model(arch, hkv)
    comp, _ = compress(model, group_size)
    ids, mask = left_padded((9, 5, 2))
    expected = greedy(model, ids, mask)
    got = greedy(comp, ids, mask, return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected)
    cache = got.past_key_values
    assert isinstance(cache, LatentCache) and all(isinstance(layer, LatentLayer) for layer in cache.layers)
    assert all((layer.positions is None) == (arch == "opt") for layer in cache.layers)
    # the padding is really handled: the shortest row alone generates the same continuation
    alone = greedy(comp, ids[2:, -2:], torch.ones(1, 2, dtype=torch.long))
    assert torch.equal(alone[0, 2:], expected[2, 9:])


@pytest.mark.parametrize("arch", ["qwen2", "opt"])
def test_beam_search_matches_the_original_at_full_rank(compress, arch) -> None:
    """Beam search reorders and expands the cache rows (OPT's layers hold no positions to move)."""
    model = make_model(arch, 2 if arch == "qwen2" else 4)
    comp, _ = compress(model, 2)
    ids, mask = left_padded((7, 4))
    got = greedy(comp, ids, mask, num_beams=2, return_dict_in_generate=True)
    assert torch.equal(got.sequences, greedy(model, ids, mask, num_beams=2))
    assert isinstance(got.past_key_values, LatentCache)


@pytest.mark.parametrize("arch,hkv,group_size", [CASES[2], CASES[5]], ids=[IDS[2], IDS[5]])
@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_decode_through_the_cache_equals_one_full_forward(compress, arch, hkv, group_size, ratio) -> None:
    """Left-padded rows, prefill 6 tokens, then one token at a time; at full rank also the original."""
    model = make_model(arch, hkv)
    comp, _ = compress(model, group_size, ratio=ratio)
    ids, mask = left_padded((T, 8, 5))
    full, decoded, cache = decode_left_padded(comp, ids, mask)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=positions_for(mask)).logits
    valid = mask.bool()
    assert cache.get_seq_length() == T
    assert max_diff(decoded[valid], full[valid]) <= 1e-5
    if ratio == 1.0:
        assert max_diff(full[valid], ref[valid]) <= 1e-4
    else:
        assert max_diff(full[valid], ref[valid]) > 1e-2  # truncated: the check above is not vacuous


def test_latent_layer_refuses_mixing_with_and_without_positions() -> None:
    layer = LatentLayer()
    h = torch.zeros(1, 2, 3)
    _, _, pos = layer.update_latents(h, h)
    assert pos is None and layer.positions is None and layer.get_seq_length() == 2
    with pytest.raises(ValueError, match="positions"):
        layer.update_latents(h, h, torch.arange(2)[None])


# -------------------------------------------------------------------------------------- memory is real


@pytest.mark.parametrize("arch,hkv,group_size", [CASES[2], CASES[3], CASES[4], CASES[5]], ids=IDS[2:])
def test_half_ratio_kv_bytes_are_latents_only(compress, arch, hkv, group_size) -> None:
    """Qwen2: latents + one int32 position per token and layer; OPT: latents only (no RoPE, no positions)."""
    model = make_model(arch, hkv)
    comp, plan = compress(model, group_size, ratio=0.5, rank_multiple=4)
    assert plan.achieved_ratio == 0.5
    D, B = 8, 2
    windows = ids_for(B, 16)
    orig = kv_bytes_per_token(model, windows, n_rows=B)
    got = kv_bytes_per_token(comp, windows, n_rows=B)
    assert got["cache_class"] == "LatentCache"
    ranks = [(sum(rk), sum(rv)) for rk, rv in zip(plan.ranks["k"], plan.ranks["v"], strict=True)]
    assert all(rk == rv == hkv * D // 2 for rk, rv in ranks)
    position_bytes = 4 if arch == "qwen2" else 0
    kept = [16, WINDOW - 1] if arch == "qwen2" else [16, 16]  # Qwen2's layer 1 slides: window − 1 tokens
    expected = sum(n * ((rk + rv) * 4 + position_bytes) for n, (rk, rv) in zip(kept, ranks)) / 16
    assert got["kv_bytes_per_token"] == expected
    # the original caches the same tokens per layer (its own sliding layer too, plus an int64 window scalar)
    scalar = 8 / (B * 16) if arch == "qwen2" else 0
    full_width = sum(n * 2 * hkv * D * 4 for n in kept) / 16
    assert orig["kv_bytes_per_token"] == full_width + scalar
    assert got["kv_bytes_per_token"] == full_width / 2 + sum(kept) * position_bytes / 16
    with torch.no_grad():
        cache = comp(windows, use_cache=True).past_key_values
    for (rk, rv), layer, n in zip(ranks, cache.layers, kept, strict=True):
        assert layer.keys.shape == (B, n, rk) and layer.values.shape == (B, n, rv)
        assert (layer.positions is None) == (arch == "opt")


# ------------------------------------------------------------------------------------- format, adapters


@pytest.mark.parametrize("arch,hkv,group_size", [CASES[2], CASES[4]], ids=[IDS[2], IDS[4]])
def test_save_load_roundtrip_is_exact(compress, tmp_path, arch, hkv, group_size) -> None:
    model = make_model(arch, hkv)
    comp, _ = compress(model, group_size, ratio=0.5, rank_multiple=4)
    save_compressed(comp, tmp_path / "m")
    ids, mask = left_padded((9, 5))
    rope = "reconstruct-then-rope" if arch == "qwen2" else "keys-fused-into-q"
    # the strict loader, and plain from_pretrained through the "lrkv" quant method
    for loaded in (load_compressed(tmp_path / "m"), AutoModelForCausalLM.from_pretrained(tmp_path / "m")):
        adapter = get_adapter(loaded.config)
        assert loaded.config.lrkv == comp.config.lrkv
        assert loaded.config.lrkv["rope"] == rope
        assert all(type(adapter.attention(loaded, i)) is type(adapter.attention(comp, i)) for i in range(2))
        with torch.no_grad():
            assert torch.equal(loaded(ids, attention_mask=mask).logits, comp(ids, attention_mask=mask).logits)
        assert torch.equal(greedy(loaded, ids, mask), greedy(comp, ids, mask))


def test_unsupported_model_names_every_supported_family() -> None:
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*supported: llama, mistral, opt, qwen2$"):
        get_adapter(gpt2.config)
