"""The exactness matrix: architectures × KV-head layouts × group sizes × decompositions, tiny random models.

Architectures (``tests.support.models``): Llama; Llama with Llama 3.x's RoPE scaling; Mistral with a sliding
window of 6 on every layer; Qwen2 (q/k/v biases, layer 1 slides over 6 tokens); Qwen3 (QK-norm on queries and
rebuilt keys, layer 1 slides over 6 tokens); Gemma 3 (QK-norm scaled by 1 + weight, query_pre_attn_scalar's
softmax scale, layer 0 slides over 6 tokens with its own RoPE base); Phi-3 (one fused qkv_proj, a sliding
window of 6 on every layer; and with partial rotary embeddings, half of each head's dims rotated); OPT (no
RoPE, biases everywhere). Inputs are 12 tokens long, longer than the windows. Layouts: MHA (Hkv = H = 4) and
GQA (Hkv = 2; OPT is MHA only) × group sizes 1, 2 and Hkv. At ratio 1.0 a compressed model is the original up
to float rounding: fp32 logits within 1e-4, float64 logits within 1e-10 and attention outputs within 1e-12
relative, identical greedy and beam generations; decoding through the cache equals one full forward within
1e-5.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lrkv_core.cache import LatentCache, LatentLayer, cache_kwargs
from lrkv_core.evaluation.metrics import kv_bytes_per_token
from lrkv_core.model.adapters import get_adapter
from lrkv_core.model.attention import LatentAttention
from lrkv_core.model.attention_norope import NoRopeLatentAttention
from lrkv_core.model.io import load_compressed, save_compressed
from tests.support.inputs import decode_left_padded, greedy, ids_for, left_padded, max_diff, positions_for
from tests.support.models import SLIDING_WINDOW, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

T = 12  # > SLIDING_WINDOW
ROPE = {
    "llama": True,
    "llama3": True,
    "mistral": True,
    "qwen2": True,
    "qwen3": True,
    "phi3": True,
    "phi3_partial": True,
    "gemma3": True,
    "opt": False,
}
SLIDING = {
    "llama": [False, False],
    "llama3": [False, False],
    "mistral": [True, True],
    "qwen2": [False, True],
    "qwen3": [False, True],
    "phi3": [True, True],
    "phi3_partial": [False, False],
    "gemma3": [True, False],
    "opt": [False, False],
}
CASES = [
    (arch, hkv, group_size)
    for arch in ROPE
    for hkv in ((4,) if arch == "opt" else (4, 2))
    for group_size in sorted({1, 2, hkv})
]
IDS = [f"{arch}-hkv{hkv}-s{s}" for arch, hkv, s in CASES]
METHODS = (
    "whitened",
    pytest.param({"name": "whitened", "values": "projection", "keys": "projection"}, id="whitened-palu"),
    pytest.param({"name": "whitened", "values": "output", "keys": "projection"}, id="whitened-output"),
    pytest.param({"name": "whitened", "values": "attention", "keys": "projection"}, id="whitened-attention"),
    "plain",
    "pca",
)


def model_for(arch: str, hkv: int, seed: int = 0):
    """The matrix's model of ``arch``: Mistral and Phi-3 get a sliding window on every layer."""
    overrides = {"sliding_window": SLIDING_WINDOW} if arch in ("mistral", "phi3") else {}
    return tiny_model(arch, hkv, seed, **overrides)


def kept_tokens(arch: str, n: int) -> list[int]:
    """Per layer, the tokens a cache keeps after ``n``: window − 1 on a sliding layer, all on a full one."""
    return [min(n, SLIDING_WINDOW - 1) if sliding else n for sliding in SLIDING[arch]]


def one_case(arch: str) -> tuple[str, int, int]:
    """A GQA case with groups of 2 (OPT: MHA)."""
    return (arch, 4 if arch == "opt" else 2, 2)


# ------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch,hkv,group_size", CASES, ids=IDS)
def test_full_rank_is_exact_in_fp32_and_float64(compress, arch, hkv, group_size, method) -> None:
    """fp32 logits within 1e-4 and a cache holding each layer's kept tokens; in float64 logits within 1e-10
    and every attention output within 1e-12 relative (HF's RMSNorm computes in float32 and could hide
    attention errors below its rounding)."""
    model = model_for(arch, hkv)
    comp, plan = compress(model, group_size, method=method)
    assert plan.achieved_ratio == 1.0
    adapter = get_adapter(comp.config)
    expected = LatentAttention if ROPE[arch] else NoRopeLatentAttention
    assert all(type(adapter.attention(comp, i)) is expected for i in range(2))
    ids = ids_for(2, T)
    with torch.no_grad():
        out = comp(ids, use_cache=True)
        assert max_diff(out.logits, model(ids).logits) <= 1e-4
    cache = out.past_key_values
    assert isinstance(cache, LatentCache) and cache.get_seq_length() == T
    assert cache.is_sliding == SLIDING[arch]
    for layer, kept in zip(cache.layers, kept_tokens(arch, T), strict=True):
        assert isinstance(layer, LatentLayer) and len(layer.store) == kept
        assert all(t.shape[:2] == (2, kept) for t in layer.store.parts.values())
        if ROPE[arch]:  # the positions of exactly the kept tokens
            assert torch.equal(
                layer.store.positions, torch.arange(T - kept, T, dtype=torch.int32).expand(2, kept)
            )
        else:
            assert layer.store.positions is None

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


# -------------------------------------------------------------------------------- generation and cache


@pytest.mark.parametrize("arch,hkv,group_size", CASES, ids=IDS)
def test_greedy_generate_matches_batched_and_left_padded(compress, arch, hkv, group_size) -> None:
    model = model_for(arch, hkv)
    comp, _ = compress(model, group_size)
    ids = ids_for(3, 5)
    assert torch.equal(greedy(comp, ids), greedy(model, ids))
    ids, mask = left_padded((9, 5, 2))
    expected = greedy(model, ids, mask)
    got = greedy(comp, ids, mask, return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected)
    cache = got.past_key_values
    assert isinstance(cache, LatentCache) and all(isinstance(layer, LatentLayer) for layer in cache.layers)
    assert all((layer.store.positions is None) == (not ROPE[arch]) for layer in cache.layers)
    # the padding is really handled: the shortest row alone generates the same continuation
    alone = greedy(comp, ids[2:, -2:], torch.ones(1, 2, dtype=torch.long))
    assert torch.equal(alone[0, 2:], expected[2, 9:])


@pytest.mark.parametrize("arch,hkv,group_size", CASES, ids=IDS)
def test_decode_through_the_cache_equals_one_full_forward(compress, arch, hkv, group_size) -> None:
    """Equal rows (prefill 4 tokens) and left-padded rows (prefill 6), then one token at a time."""
    model = model_for(arch, hkv)
    comp, _ = compress(model, group_size)
    ids = ids_for(2, T)
    with torch.no_grad():
        full = comp(ids).logits  # (B, T, V)
        out = comp(ids[:, :4], use_cache=True)
        steps = [out.logits]
        for t in range(4, T):
            out = comp(ids[:, t : t + 1], **cache_kwargs(out.past_key_values), use_cache=True)
            steps.append(out.logits)
        ref = model(ids).logits
    decoded = torch.cat(steps, dim=1)
    assert max_diff(decoded, full) <= 1e-5
    assert max_diff(decoded, ref) <= 1e-4
    assert out.past_key_values.get_seq_length() == T

    ids, mask = left_padded((T, 8, 5))
    full, decoded, cache = decode_left_padded(comp, ids, mask)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=positions_for(mask)).logits
    valid = mask.bool()
    assert cache.get_seq_length() == T
    assert max_diff(decoded[valid], full[valid]) <= 1e-5
    assert max_diff(full[valid], ref[valid]) <= 1e-4


@pytest.mark.parametrize(
    "arch,hkv,group_size",
    [("llama", 2, 1), ("mistral", 2, 1), ("qwen2", 2, 1), ("qwen3", 2, 1), ("phi3", 2, 1), ("gemma3", 2, 1)]
    + [("opt", 4, 4)],
    ids=[
        "llama-hkv2-s1",
        "mistral-hkv2-s1",
        "qwen2-hkv2-s1",
        "qwen3-hkv2-s1",
        "phi3-hkv2-s1",
        "gemma3-hkv2-s1",
    ]
    + ["opt-hkv4-s4"],
)
def test_truncated_model_differs_but_its_cache_path_is_still_exact(compress, arch, hkv, group_size) -> None:
    model = model_for(arch, hkv)
    comp, _ = compress(model, group_size, ratio=0.5)
    ids, mask = left_padded((T, 8, 5))
    full, decoded, cache = decode_left_padded(comp, ids, mask)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=positions_for(mask)).logits
    valid = mask.bool()
    assert cache.get_seq_length() == T
    assert max_diff(decoded[valid], full[valid]) <= 1e-5
    assert max_diff(full[valid], ref[valid]) > 1e-2  # half the rank is not the original


@pytest.mark.parametrize("arch", list(ROPE))
def test_beam_search_matches_the_original_at_full_rank(compress, arch) -> None:
    """Beam search reorders and expands the cache rows (OPT's layers hold no positions to move)."""
    _, hkv, group_size = one_case(arch)
    model = model_for(arch, hkv)
    comp, _ = compress(model, group_size)
    ids, mask = left_padded((7, 4))
    got = greedy(comp, ids, mask, num_beams=2, return_dict_in_generate=True)
    assert torch.equal(got.sequences, greedy(model, ids, mask, num_beams=2))
    assert isinstance(got.past_key_values, LatentCache)


# -------------------------------------------------------------------------------------- memory is real

MEMORY = [
    ("llama", 2, 1, 1),
    ("llama", 2, 2, 8),
    ("mistral", 2, 2, 4),
    ("qwen2", 2, 1, 4),
    ("qwen2", 2, 2, 4),
    ("qwen3", 2, 2, 4),
    ("phi3", 2, 1, 4),
    ("phi3_partial", 2, 2, 4),
    ("gemma3", 2, 2, 4),
    ("opt", 4, 1, 4),
    ("opt", 4, 4, 4),
]


@pytest.mark.parametrize(
    "arch,hkv,group_size,multiple", MEMORY, ids=[f"{a}-hkv{h}-s{s}-m{m}" for a, h, s, m in MEMORY]
)
def test_half_ratio_kv_bytes_are_latents_only(compress, arch, hkv, group_size, multiple) -> None:
    """Latents (+ one int32 position per token and layer with RoPE) of the tokens each layer keeps: half the
    original's bytes, plus the positions."""
    model = model_for(arch, hkv)  # L=2, D=8, d=32
    comp, plan = compress(model, group_size, ratio=0.5, rank_multiple=multiple)
    assert plan.achieved_ratio == 0.5
    D, B, n = 8, 2, 16
    windows = ids_for(B, n)
    orig = kv_bytes_per_token(model, windows, n_rows=B)
    got = kv_bytes_per_token(comp, windows, n_rows=B)
    assert (orig["cache_class"], got["cache_class"]) == ("DynamicCache", "LatentCache")
    ranks = [(sum(rk), sum(rv)) for rk, rv in zip(plan.ranks["k"], plan.ranks["v"], strict=True)]
    assert all(rk == rv == hkv * D // 2 for rk, rv in ranks)
    position_bytes = 4 if ROPE[arch] else 0
    kept = kept_tokens(arch, n)
    expected = sum(k * ((rk + rv) * 4 + position_bytes) for k, (rk, rv) in zip(kept, ranks)) / n
    assert got["kv_bytes_per_token"] == expected
    # the original caches the same tokens per layer (fp32 keys + values; a sliding layer adds an int64 scalar)
    scalars = 8 * sum(k < n for k in kept) / (B * n)
    full_width = sum(k * 2 * hkv * D * 4 for k in kept) / n
    assert orig["kv_bytes_per_token"] == full_width + scalars
    assert got["kv_bytes_per_token"] == full_width / 2 + sum(kept) * position_bytes / n
    if kept == [n, n]:
        assert got["kv_bytes_per_token"] / orig["kv_bytes_per_token"] == pytest.approx(
            0.5 + position_bytes / (2 * hkv * D * 4)
        )

    with torch.no_grad():
        cache = comp(windows, use_cache=True).past_key_values
    for i, ((rk, rv), layer, k) in enumerate(zip(ranks, cache.layers, kept, strict=True)):
        attn = get_adapter(comp.config).attention(comp, i)
        assert attn.k_down.weight.shape == (rk, 32) and attn.v_down.weight.shape == (rv, 32)
        assert {name: t.shape for name, t in layer.store.parts.items()} == {"k": (B, k, rk), "v": (B, k, rv)}
        if ROPE[arch]:
            assert layer.store.positions.shape == (B, k) and layer.store.positions.dtype == torch.int32
        else:
            assert layer.store.positions is None


# --------------------------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    "arch,hkv,group_size",
    [("llama", 2, 2), ("mistral", 2, 2), ("qwen2", 2, 1), ("qwen3", 2, 2), ("phi3", 2, 2), ("gemma3", 2, 1)]
    + [("opt", 4, 1)],
    ids=[
        "llama-hkv2-s2",
        "mistral-hkv2-s2",
        "qwen2-hkv2-s1",
        "qwen3-hkv2-s2",
        "phi3-hkv2-s2",
        "gemma3-hkv2-s1",
    ]
    + ["opt-hkv4-s1"],
)
def test_save_load_roundtrip_is_exact(compress, tmp_path, arch, hkv, group_size) -> None:
    model = model_for(arch, hkv)
    comp, _ = compress(model, group_size, ratio=0.5, rank_multiple=4)
    save_compressed(comp, tmp_path / "m")
    ids, mask = left_padded((9, 5))
    rope = "reconstruct-then-rope" if ROPE[arch] else "keys-fused-into-q"
    # the strict loader, and plain from_pretrained through the "lrkv" quant method
    for loaded in (load_compressed(tmp_path / "m"), AutoModelForCausalLM.from_pretrained(tmp_path / "m")):
        adapter = get_adapter(loaded.config)
        assert loaded.config.lrkv == comp.config.lrkv
        assert loaded.config.lrkv["rope"] == rope
        assert all(type(adapter.attention(loaded, i)) is type(adapter.attention(comp, i)) for i in range(2))
        with torch.no_grad():
            assert torch.equal(loaded(ids, attention_mask=mask).logits, comp(ids, attention_mask=mask).logits)
        assert torch.equal(greedy(loaded, ids, mask), greedy(comp, ids, mask))


@pytest.mark.parametrize("group_size,ratio", [(1, 0.5), (2, 1.0)], ids=["values-narrower", "values-wider"])
def test_sdpa_gets_one_head_width_and_equals_eager(compress, monkeypatch, group_size, ratio) -> None:
    """Value latents narrower (half rank, one head per group) or wider (two heads per group) than the keys
    reach torch's SDPA padded to one width, the width its fused kernels need; the logits equal eager
    attention's, which takes the widths as they are."""
    model = model_for("llama", 2)
    comp, _ = compress(model, group_size, ratio=ratio)
    ids = ids_for(2, T)
    comp.set_attn_implementation("eager")
    with torch.no_grad():
        eager = comp(ids).logits
    comp.set_attn_implementation("sdpa")
    widths = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        widths.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        padded = comp(ids).logits
    assert widths and all(len(set(w)) == 1 for w in widths)
    head_dim = get_adapter(model.config).shape(model.config).D
    ranks_v = {r for m in comp.modules() if hasattr(m, "layout") for r in m.layout.ranks_v}
    assert ranks_v and head_dim not in ranks_v  # the case pads: value latents of another width than keys
    assert max_diff(padded, eager) <= 1e-5
