"""The exactness matrix of compressed models on tiny random Llama / Mistral configs, and the LatentCache.

Cases: Llama and Mistral (sliding window 6, shorter than the 12-token inputs) × MHA (Hkv = H = 4) and GQA
(Hkv = 2) × group sizes 1, Hkv and one in between. At ratio 1.0 a compressed model is the original up to
float rounding: fp32 logits within 1e-4, float64 within 1e-10, identical greedy and beam generations.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, Qwen2Config

from lrkv_core.adapters import UnsupportedModelError, get_adapter
from lrkv_core.attention import LatentAttention
from lrkv_core.cache import LatentCache, LatentLayer, SlidingLatentLayer
from lrkv_core.evaluate import kv_bytes_per_token
from lrkv_core.fuse import _latent_cache_pre_hook, compress_model, enable_latent_cache
from lrkv_core.ranks import allocate_ranks
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

SLIDING_WINDOW = 6
T = 12  # > SLIDING_WINDOW
CASES = [
    (family, hkv, group_size)
    for family in ("llama", "mistral")
    for hkv in (4, 2)
    for group_size in sorted({1, 2, hkv})
]
IDS = [f"{family}-hkv{hkv}-s{s}" for family, hkv, s in CASES]


def _overrides(family: str) -> dict:
    return {"sliding_window": SLIDING_WINDOW} if family == "mistral" else {}


# ------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("family,hkv,group_size", CASES, ids=IDS)
def test_full_rank_fp32_logits_and_latent_cache(make_tiny, compress, family, hkv, group_size) -> None:
    model = make_tiny(family, hkv, **_overrides(family))
    comp, plan = compress(model, group_size)
    assert plan.achieved_ratio == 1.0
    assert all(isinstance(get_adapter(comp.config).attention(comp, i), LatentAttention) for i in range(2))
    ids = ids_for(2, T)
    with torch.no_grad():
        ref = model(ids).logits
        out = comp(ids, use_cache=True)
    assert max_diff(out.logits, ref) <= 1e-4
    cache = out.past_key_values
    assert isinstance(cache, LatentCache) and cache.get_seq_length() == T
    kept = SLIDING_WINDOW - 1 if family == "mistral" else T  # a sliding layer keeps window − 1 tokens
    for layer in cache.layers:
        assert isinstance(layer, SlidingLatentLayer if family == "mistral" else LatentLayer)
        assert layer.keys.shape[1] == layer.values.shape[1] == kept
        assert torch.equal(layer.positions, torch.arange(T - kept, T, dtype=torch.int32).expand(2, kept))


@pytest.mark.parametrize("family,hkv,group_size", CASES, ids=IDS)
def test_full_rank_float64_is_exact(make_tiny, compress, family, hkv, group_size) -> None:
    """In float64 the fusion is exact.

    HF's RMSNorm computes in float32 and would hide attention errors below fp32 rounding, so the attention
    outputs of every layer are compared too (same inputs up to that rounding).
    """
    model = make_tiny(family, hkv, **_overrides(family)).double()
    comp, _ = compress(model, group_size)
    assert comp.dtype == torch.float64
    adapter = get_adapter(model.config)
    captured: dict[str, list[torch.Tensor]] = {"orig": [], "comp": []}
    handles = [
        adapter.attention(m, i).register_forward_hook(
            lambda _m, _a, out, key=key: captured[key].append(out[0])
        )
        for key, m in (("orig", model), ("comp", comp))
        for i in range(2)
    ]
    try:
        ids = ids_for(2, T)
        with torch.no_grad():
            ref, got = model(ids).logits, comp(ids).logits
    finally:
        for h in handles:
            h.remove()
    assert max_diff(got, ref) <= 1e-10
    for a, b in zip(captured["orig"], captured["comp"], strict=True):
        assert max_diff(a, b) <= 1e-12 * (1 + a.abs().max().item())


@pytest.mark.parametrize("family,hkv,group_size", CASES, ids=IDS)
def test_full_rank_greedy_generate_matches_batched_and_left_padded(
    make_tiny, compress, family, hkv, group_size
) -> None:
    model = make_tiny(family, hkv, **_overrides(family))
    comp, _ = compress(model, group_size)
    ids = ids_for(3, 5)
    assert torch.equal(greedy(comp, ids), greedy(model, ids))
    ids, mask = left_padded((9, 5, 2))
    expected = greedy(model, ids, mask)
    assert torch.equal(greedy(comp, ids, mask), expected)
    # the padding is really handled: the shortest row alone generates the same continuation
    alone = greedy(comp, ids[2:, -2:])
    assert torch.equal(alone[0, 2:], expected[2, 9:])


@pytest.mark.parametrize("family,hkv,group_size", CASES, ids=IDS)
def test_decode_through_the_cache_equals_one_full_forward(
    make_tiny, compress, family, hkv, group_size
) -> None:
    model = make_tiny(family, hkv, **_overrides(family))
    comp, _ = compress(model, group_size)
    ids = ids_for(2, T)
    with torch.no_grad():
        full = comp(ids).logits  # (B, T, V)
        out = comp(ids[:, :4], use_cache=True)
        steps = [out.logits]
        for t in range(4, T):
            out = comp(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
        ref = model(ids).logits
    decoded = torch.cat(steps, dim=1)
    assert max_diff(decoded, full) <= 1e-5
    assert max_diff(decoded, ref) <= 1e-4
    assert out.past_key_values.get_seq_length() == T


def test_mistral_sliding_window_is_in_effect(make_tiny, compress) -> None:
    """The Mistral cases test something: without the window the original's logits change past position 6."""
    model = make_tiny("mistral", 2, sliding_window=SLIDING_WINDOW)
    unwindowed = copy.deepcopy(model)
    unwindowed.config.sliding_window = None
    ids = ids_for(2, T)
    with torch.no_grad():
        windowed, full = model(ids).logits, unwindowed(ids).logits
        comp_logits = compress(model, 2)[0](ids).logits
    assert max_diff(windowed[:, :SLIDING_WINDOW], full[:, :SLIDING_WINDOW]) <= 1e-6
    assert max_diff(windowed[:, SLIDING_WINDOW:], full[:, SLIDING_WINDOW:]) > 1e-2
    assert max_diff(comp_logits, windowed) <= 1e-4


def test_sliding_window_latent_cache_is_capped_and_exact_over_a_long_decode(make_tiny, compress) -> None:
    """Mistral: each layer keeps window − 1 tokens of latents, like the original's sliding cache, and a
    decode five windows long matches the original step for step and one full forward."""
    model = make_tiny("mistral", 2, sliding_window=SLIDING_WINDOW)
    comp, _ = compress(model, 2)
    n = 5 * SLIDING_WINDOW
    ids = ids_for(2, n)
    sizes = []
    with torch.no_grad():
        ref = model(ids).logits
        out, base = comp(ids[:, :2], use_cache=True), model(ids[:, :2], use_cache=True)
        steps, base_steps = [out.logits], [base.logits]
        for t in range(2, n):
            out = comp(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            base = model(ids[:, t : t + 1], past_key_values=base.past_key_values, use_cache=True)
            steps.append(out.logits)
            base_steps.append(base.logits)
            sizes.append({layer.keys.shape[1] for layer in out.past_key_values.layers})
    decoded = torch.cat(steps, dim=1)
    assert max_diff(decoded, torch.cat(base_steps, dim=1)) <= 1e-4 and max_diff(decoded, ref) <= 1e-4
    assert sizes == [{min(t + 1, SLIDING_WINDOW - 1)} for t in range(2, n)]  # capped at window − 1
    cache = out.past_key_values
    assert all(isinstance(layer, SlidingLatentLayer) for layer in cache.layers)
    assert cache.get_seq_length() == n and cache.is_sliding == [True, True]
    with pytest.raises(RuntimeError, match="window is full"):
        cache.crop(-1)
    long = {"max_new_tokens": 4 * SLIDING_WINDOW}
    assert torch.equal(greedy(comp, ids[:, :3], **long), greedy(model, ids[:, :3], **long))


def test_latent_cache_layers_follow_the_configs_layer_types() -> None:
    config = Qwen2Config(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    )  # fmt: skip
    cache = LatentCache.from_config(config)
    assert [type(layer) for layer in cache.layers] == [LatentLayer, SlidingLatentLayer, SlidingLatentLayer]
    assert cache.layers[1].sliding_window == 4
    assert [type(layer) for layer in LatentCache.from_config(GPT2Config(n_layer=2)).layers] == [
        LatentLayer
    ] * 2
    layer = SlidingLatentLayer(4)
    h = torch.zeros(1, 2, 3)
    layer.update_latents(h, h, torch.arange(2)[None])
    layer.crop(-1)  # below the window a crop is an ordinary one
    assert layer.get_seq_length() == layer.keys.shape[1] == layer.positions.shape[1] == 1
    assert layer.get_mask_sizes(3) == (4, 0)
    keys, _, pos = layer.update_latents(torch.ones(1, 5, 3), torch.ones(1, 5, 3), torch.arange(1, 6)[None])
    assert keys.shape[1] == 6 and layer.keys.shape[1] == 3
    assert torch.equal(layer.positions[0], torch.tensor([3, 4, 5], dtype=torch.int32))
    assert layer.get_mask_sizes(1) == (4, 3)  # the mask sees the 3 kept tokens + the query, from position 3


# -------------------------------------------------------------------------------------- memory is real


@pytest.mark.parametrize("group_size,multiple", [(1, 1), (2, 8)])
def test_half_ratio_cache_holds_latents_of_width_r(make_tiny, compress, group_size, multiple) -> None:
    model = make_tiny("llama", 2)  # L=2, Hkv=2, D=8
    comp, plan = compress(model, group_size, ratio=0.5, rank_multiple=multiple)
    assert plan.achieved_ratio == 0.5
    L, hkv, D, B = 2, 2, 8, 2
    windows = ids_for(B, 16)
    orig = kv_bytes_per_token(model, windows, n_rows=B)
    got = kv_bytes_per_token(comp, windows, n_rows=B)
    assert (orig["cache_class"], got["cache_class"]) == ("DynamicCache", "LatentCache")
    ranks = [(sum(rk), sum(rv)) for rk, rv in zip(plan.ranks["k"], plan.ranks["v"], strict=True)]
    assert all(rk == rv == hkv * D // 2 for rk, rv in ranks)
    assert orig["kv_bytes_per_token"] == L * 2 * hkv * D * 4  # fp32 keys + values
    assert got["kv_bytes_per_token"] == sum((rk + rv) * 4 + 4 for rk, rv in ranks)  # latents + int32 position
    assert got["kv_bytes_per_token"] / orig["kv_bytes_per_token"] == pytest.approx(
        0.5 + 4 / (2 * hkv * D * 4)
    )

    with torch.no_grad():
        cache = comp(windows, use_cache=True).past_key_values
    for i, layer in enumerate(cache.layers):
        attn = get_adapter(comp.config).attention(comp, i)
        assert attn.k_down.weight.shape == (ranks[i][0], 32) and attn.v_down.weight.shape == (ranks[i][1], 32)
        assert layer.keys.shape == (B, 16, ranks[i][0]) and layer.values.shape == (B, 16, ranks[i][1])
        assert layer.positions.shape == (B, 16) and layer.positions.dtype == torch.int32


def test_truncated_model_differs_but_its_cache_path_is_still_exact(make_tiny, compress) -> None:
    model = make_tiny("llama", 2)
    comp, _ = compress(model, 1, ratio=0.5)
    ids, mask = left_padded((T, 8, 5))
    full, decoded, _ = decode_left_padded(comp, ids, mask)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=positions_for(mask)).logits
    valid = mask.bool()
    assert max_diff(decoded[valid], full[valid]) <= 1e-5
    assert max_diff(full[valid], ref[valid]) > 1e-2  # rank 4 of 8 per head is not the original


# -------------------------------------------------------------------------------- cache interoperation


def test_filled_dynamic_cache_is_refused(make_tiny, compress) -> None:
    model = make_tiny("llama", 2)
    comp, _ = compress(model, 1)
    with torch.no_grad():
        filled = model(ids_for(1, 5), use_cache=True).past_key_values
        assert type(filled) is DynamicCache and filled.get_seq_length() == 5
        with pytest.raises(TypeError, match="LatentCache"):
            comp(ids_for(1, 1), past_key_values=filled, use_cache=True)


@pytest.mark.parametrize("empty", [DynamicCache, lambda: None], ids=["empty-DynamicCache", "none"])
def test_empty_or_missing_cache_becomes_a_latent_cache(make_tiny, compress, empty) -> None:
    model = make_tiny("llama", 2)
    comp, _ = compress(model, 1)
    ids = ids_for(2, 6)
    with torch.no_grad():
        out = comp(ids, past_key_values=empty(), use_cache=True)
        no_cache = comp(ids, use_cache=False)
    assert isinstance(out.past_key_values, LatentCache) and out.past_key_values.get_seq_length() == 6
    assert no_cache.past_key_values is None
    assert torch.equal(out.logits, no_cache.logits)


def test_latent_cache_hook_is_installed_once(make_tiny, compress) -> None:
    comp, _ = compress(make_tiny("llama", 2), 1)
    enable_latent_cache(comp)
    enable_latent_cache(comp)
    hooks = list(get_adapter(comp.config).base_model(comp)._forward_pre_hooks.values())
    assert hooks.count(_latent_cache_pre_hook) == 1


def _prefilled(make_tiny, compress):
    """A compressed model, a left-padded batch of 3 rows (lengths 10, 7, 4) plus 3 more tokens each, its
    full-forward logits (the reference), and a LatentCache prefilled with all 13 tokens."""
    model = make_tiny("llama", 2)
    comp, _ = compress(model, 1, ratio=0.5)
    prompt, prompt_mask = left_padded((10, 7, 4))
    ids = torch.cat([prompt, ids_for(3, 3, seed=5)], dim=1)  # (3, 13)
    mask = torch.cat([prompt_mask, torch.ones(3, 3, dtype=torch.long)], dim=1)
    pos = positions_for(mask)
    with torch.no_grad():
        ref = comp(ids, attention_mask=mask, position_ids=pos).logits  # (3, 13, V)
        cache = comp(ids, attention_mask=mask, position_ids=pos, use_cache=True).past_key_values
    return comp, ids, mask, pos, ref, cache


def _continue(comp, cache, ids, mask, pos, rows: torch.Tensor) -> torch.Tensor:
    """Feed tokens 10..12 of ``rows`` through ``cache`` (holding tokens 0..9 of those rows)."""
    with torch.no_grad():
        return comp(
            ids[rows, 10:], attention_mask=mask[rows], position_ids=pos[rows, 10:], past_key_values=cache
        ).logits


def test_crop_keeps_latents_and_positions_consistent(make_tiny, compress) -> None:
    comp, ids, mask, pos, ref, cache = _prefilled(make_tiny, compress)
    cache.crop(-3)
    rows = torch.arange(3)
    for layer in cache.layers:
        assert layer.keys.shape[1] == layer.values.shape[1] == layer.positions.shape[1] == 10
        assert torch.equal(layer.positions, pos[:, :10].int())
    assert max_diff(_continue(comp, cache, ids, mask, pos, rows), ref[:, 10:]) <= 1e-5


@pytest.mark.parametrize(
    "op,rows",
    [
        ("batch_select_indices", [2, 0]),
        ("reorder_cache", [1, 1, 0]),
        ("batch_repeat_interleave", [0, 0, 1, 1, 2, 2]),
    ],
)
def test_batch_operations_keep_positions_with_their_rows(make_tiny, compress, op, rows) -> None:
    """Rows have different left padding, hence different positions: a position left behind changes RoPE."""
    comp, ids, mask, pos, ref, cache = _prefilled(make_tiny, compress)
    cache.crop(-3)
    rows = torch.tensor(rows)
    if op == "batch_repeat_interleave":
        cache.batch_repeat_interleave(2)
    else:
        getattr(cache, op)(rows)
    for layer in cache.layers:
        assert layer.keys.shape[0] == layer.values.shape[0] == len(rows)
        assert torch.equal(layer.positions, pos[rows, :10].int())
    valid = _continue(comp, cache, ids, mask, pos, rows)
    assert max_diff(valid, ref[rows, 10:]) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_beam_search_matches_the_original_at_full_rank(make_tiny, compress, family) -> None:
    model = make_tiny(family, 2, **_overrides(family))
    comp, _ = compress(model, 2)
    ids, mask = left_padded((7, 4))
    expected = greedy(model, ids, mask, num_beams=2)
    got = comp.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        num_beams=2,
        pad_token_id=PAD,
        eos_token_id=None,
        return_dict_in_generate=True,
    )
    assert torch.equal(got.sequences, expected)
    assert isinstance(got.past_key_values, LatentCache)


# -------------------------------------------------------------------------------------------- adapters


def test_unsupported_model_names_the_supported_families() -> None:
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2)).eval()
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*supported: llama, mistral"):
        get_adapter(gpt2.config)
    plan = allocate_ranks([{"k": [torch.ones(8)], "v": [torch.ones(8)]}], ratio=1.0, group_size=1, head_dim=8)
    with pytest.raises(UnsupportedModelError):
        compress_model(gpt2, [], plan, "whitened")
    assert isinstance(UnsupportedModelError("x"), ValueError)
