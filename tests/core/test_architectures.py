"""What one architecture does that the exactness matrix does not show.

Sliding windows in effect (Mistral, Qwen2's per-layer window), a long decode past the window, Qwen2's q/k/v
biases, OPT's key bias, Qwen3's and Gemma 3's QK-norm, Gemma 3's softmax scale and per-layer RoPE bases, Llama
3.x's RoPE scaling, Phi-3's fused qkv_proj, and the refusal of unsupported architectures and features. Models
come from ``tests.support.models`` (random attention biases).
"""

from __future__ import annotations

import copy

import pytest
import torch

from lrkv_core.allocation import allocate_ranks
from lrkv_core.cache import SlidingWindow, cache_kwargs
from lrkv_core.model.adapters import UnsupportedModelError, get_adapter
from lrkv_core.model.fuse import compress_model
from tests.support.inputs import greedy, ids_for, max_diff
from tests.support.models import SLIDING_WINDOW, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

T = 12  # > SLIDING_WINDOW


# ----------------------------------------------------------------------------------------- sliding windows


def test_mistral_sliding_window_is_in_effect(compress) -> None:
    """The Mistral cases test something: without the window the original's logits change past position 6."""
    model = tiny_model("mistral", 2, sliding_window=SLIDING_WINDOW)
    unwindowed = copy.deepcopy(model)
    unwindowed.config.sliding_window = None
    ids = ids_for(2, T)
    with torch.no_grad():
        windowed, full = model(ids).logits, unwindowed(ids).logits
        comp_logits = compress(model, 2)[0](ids).logits
    assert max_diff(windowed[:, :SLIDING_WINDOW], full[:, :SLIDING_WINDOW]) <= 1e-6
    assert max_diff(windowed[:, SLIDING_WINDOW:], full[:, SLIDING_WINDOW:]) > 1e-2
    assert max_diff(comp_logits, windowed) <= 1e-4


def test_qwen2_sliding_window_is_in_effect(compress) -> None:
    """The Qwen2 cases test the per-layer window: without it the original's logits change past position 6."""
    model = tiny_model("qwen2", 2)
    full = tiny_model("qwen2", 2, layer_types=["full_attention"] * 2)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    adapter = get_adapter(model.config)
    assert [adapter.attention_kwargs(model.config, i) for i in range(2)] == [
        {"sliding_window": None},
        {"sliding_window": SLIDING_WINDOW},
    ]
    ids = ids_for(2, T)
    with torch.no_grad():
        windowed, unwindowed = model(ids).logits, full(ids).logits
        comp_logits = compress(model, 2)[0](ids).logits
    assert max_diff(windowed[:, :SLIDING_WINDOW], unwindowed[:, :SLIDING_WINDOW]) <= 1e-6
    assert max_diff(windowed[:, SLIDING_WINDOW:], unwindowed[:, SLIDING_WINDOW:]) > 1e-2
    assert max_diff(comp_logits, windowed) <= 1e-4


def test_sliding_window_latent_cache_is_capped_and_exact_over_a_long_decode(compress) -> None:
    """Mistral: each layer keeps window − 1 tokens of latents and their positions, like the original's sliding
    cache, and a decode five windows long matches the original step for step and one full forward."""
    model = tiny_model("mistral", 2, sliding_window=SLIDING_WINDOW)
    comp, _ = compress(model, 2)
    n = 5 * SLIDING_WINDOW
    ids = ids_for(2, n)
    sizes = []
    with torch.no_grad():
        ref = model(ids).logits
        out, base = comp(ids[:, :2], use_cache=True), model(ids[:, :2], use_cache=True)
        steps, base_steps = [out.logits], [base.logits]
        for t in range(2, n):
            out = comp(ids[:, t : t + 1], **cache_kwargs(out.past_key_values), use_cache=True)
            base = model(ids[:, t : t + 1], **cache_kwargs(base.past_key_values), use_cache=True)
            steps.append(out.logits)
            base_steps.append(base.logits)
            sizes.append({len(layer.store) for layer in out.past_key_values.layers})
            for layer in out.past_key_values.layers:  # latents and positions of exactly the last tokens
                kept = len(layer.store)
                assert all(part.shape[1] == kept for part in layer.store.parts.values())
                assert torch.equal(
                    layer.store.positions[0], torch.arange(t + 1 - kept, t + 1, dtype=torch.int32)
                )
    decoded = torch.cat(steps, dim=1)
    assert max_diff(decoded, torch.cat(base_steps, dim=1)) <= 1e-4 and max_diff(decoded, ref) <= 1e-4
    assert sizes == [{min(t + 1, SLIDING_WINDOW - 1)} for t in range(2, n)]  # capped at window − 1
    cache = out.past_key_values
    assert all(isinstance(layer.window, SlidingWindow) for layer in cache.layers)
    assert cache.get_seq_length() == n and cache.is_sliding == [True, True]
    with pytest.raises(RuntimeError, match="window is full"):
        cache.crop(-1)
    long = {"max_new_tokens": 4 * SLIDING_WINDOW}
    assert torch.equal(greedy(comp, ids[:, :3], **long), greedy(model, ids[:, :3], **long))


# ------------------------------------------------------------------------------------------------ biases


def test_qwen2_biases_are_kept_and_needed(compress) -> None:
    """Palu's Qwen2 path was garbage until it kept the k/v bias: dropping either breaks exactness here."""
    model = tiny_model("qwen2", 2)
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
    model = tiny_model("opt")
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


# ---------------------------------------------------------------------------------- QK-norm, RoPE scaling


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_qk_norms_are_kept_and_needed(compress, arch) -> None:
    """The per-head norms act on the queries and on the keys rebuilt from latents: the compressed model
    carries the original's weights, and resetting either norm's weight breaks exactness."""
    model = tiny_model(arch, 2)
    comp, _ = compress(model, 2)
    adapter = get_adapter(comp.config)
    ids = ids_for(2, T)
    for i in range(2):
        orig, attn = adapter.attention(model, i), adapter.attention(comp, i)
        assert torch.equal(attn.k_norm.weight, orig.k_norm.weight)
        assert torch.equal(attn.q_norm.weight, orig.q_norm.weight)
        assert not torch.equal(orig.k_norm.weight, torch.ones(8))  # random, so a dropped weight shows
    with torch.no_grad():
        ref = model(ids).logits
        assert max_diff(comp(ids).logits, ref) <= 1e-4
        for name in ("q_norm", "k_norm"):
            reset = copy.deepcopy(comp)
            for i in range(2):
                getattr(adapter.attention(reset, i), name).weight.fill_(1.0)
            assert max_diff(reset(ids).logits, ref) > 0.1


def test_gemma3_scale_and_local_rope_base_are_in_effect(compress) -> None:
    """The gemma3 cases test something: the original's logits change with query_pre_attn_scalar (6, not
    D = 8) and with the sliding layer's RoPE base (100, not the full layer's 10000); the latent attention uses
    both."""
    model = tiny_model("gemma3", 2)
    comp, _ = compress(model, 2)
    adapter = get_adapter(comp.config)
    local, full = adapter.attention(comp, 0), adapter.attention(comp, 1)
    assert local.scaling == full.scaling == 6**-0.5
    rope = model.model.rotary_emb
    assert torch.equal(local.rope_frequencies()[0], rope.sliding_attention_inv_freq)
    assert torch.equal(full.rope_frequencies()[0], rope.full_attention_inv_freq)
    assert not torch.allclose(rope.sliding_attention_inv_freq, rope.full_attention_inv_freq)
    ids = ids_for(2, T)
    with torch.no_grad():
        ref = model(ids).logits
        assert max_diff(comp(ids).logits, ref) <= 1e-4
        for change in ({"query_pre_attn_scalar": 8}, {"rope_local_base_freq": 10000.0}):
            other = tiny_model("gemma3", 2, **change)
            other.load_state_dict(model.state_dict())
            assert max_diff(other(ids).logits, ref) > 1e-2


def test_llama3_rope_scaling_is_in_effect(compress) -> None:
    """The llama3 cases test something: the scaled frequencies differ from the default RoPE's, the latent
    attention rotates with the original's, and the same weights under the default RoPE give other logits."""
    model = tiny_model("llama3", 2)
    default = tiny_model("llama", 2)
    default.load_state_dict(model.state_dict())
    rotary = model.model.rotary_emb
    assert rotary.rope_type == "llama3"
    assert not torch.allclose(rotary.inv_freq, default.model.rotary_emb.inv_freq)
    comp, _ = compress(model, 2)
    for i in range(2):
        assert torch.equal(get_adapter(comp.config).attention(comp, i).rotary_emb.inv_freq, rotary.inv_freq)
    ids = ids_for(2, T)
    with torch.no_grad():
        ref = model(ids).logits
        assert max_diff(default(ids).logits, ref) > 1e-2
        assert max_diff(comp(ids).logits, ref) <= 1e-4


# ---------------------------------------------------------------------------------------- fused qkv_proj


def mistral_twin(phi3: torch.nn.Module) -> torch.nn.Module:
    """The Mistral model (sliding window as Phi-3) computing what ``phi3`` computes: qkv_proj's rows split
    into q/k/v_proj, gate_up_proj's into gate/up_proj (Phi-3's MLP is Mistral's with the two fused)."""
    twin = tiny_model("mistral", 2, sliding_window=SLIDING_WINDOW, rms_norm_eps=phi3.config.rms_norm_eps)
    state = {}
    for name, tensor in phi3.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            q, k, v = tensor.split([32, 16, 16])
            state |= {
                name.replace("qkv_proj", p): w for p, w in zip(("q_proj", "k_proj", "v_proj"), (q, k, v))
            }
        elif name.endswith("gate_up_proj.weight"):
            gate, up = tensor.chunk(2)
            state |= {
                name.replace("gate_up_proj", "gate_proj"): gate,
                name.replace("gate_up_proj", "up_proj"): up,
            }
        else:
            state[name] = tensor
    twin.load_state_dict(state)
    return twin


def test_phi3_fused_qkv_is_read_as_its_q_k_v_parts(compress) -> None:
    """Statistics (the Gram, the keys' Fisher from qkv_proj's output gradients, the attention Gram), the
    weights the decompositions read and the fused latent module all take qkv_proj's rows for q, k and v: at
    half the rank, Phi-3 compresses to exactly what its Mistral twin compresses to."""
    phi3 = tiny_model("phi3", 2, sliding_window=SLIDING_WINDOW)
    twin = mistral_twin(phi3)
    ids = ids_for(2, T)
    with torch.no_grad():
        assert max_diff(phi3(ids).logits, twin(ids).logits) <= 1e-5
    for method in ("whitened", "pca"):
        comp, plan = compress(phi3, 2, ratio=0.5, method=method)
        comp_twin, plan_twin = compress(twin, 2, ratio=0.5, method=method)
        assert plan.ranks == plan_twin.ranks
        with torch.no_grad():
            got, ref = comp(ids).logits, comp_twin(ids).logits
            assert max_diff(got, ref) <= 1e-4
            assert max_diff(got, phi3(ids).logits) > 1e-2  # truncated: the factors mattered


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"attn_logit_softcapping": 50.0},
            r"does not support attention logit softcapping yet \(gemma3_text ",
        ),
        (
            {"use_bidirectional_attention": True},
            r"supports causal attention only \(gemma3_text is bidirectional",
        ),
    ],
)
def test_gemma3_features_lrkv_does_not_handle_are_refused(overrides, message) -> None:
    config = tiny_config("gemma3", 2, **overrides)
    with pytest.raises(UnsupportedModelError, match=message) as refused:
        get_adapter(config)
    assert "\n" not in str(refused.value)


def test_partial_rotary_embeddings_rotate_only_their_dims(compress) -> None:
    """Phi-3 with partial_rotary_factor 0.5: 2 frequencies for D = 8, so the matrix's cases test something
    (the same weights fully rotated give other logits); the compressed model is exact and decodes through the
    unfused path, since the decode kernel rotates all D dims."""
    model = tiny_model("phi3_partial", 2)
    assert model.model.rotary_emb.inv_freq.shape == (2,)
    full = tiny_model("phi3", 2)
    full.load_state_dict(model.state_dict())
    comp, _ = compress(model, 2)
    ids = ids_for(2, T)
    with torch.no_grad():
        ref = model(ids).logits
        assert max_diff(full(ids).logits, ref) > 1e-2
        assert max_diff(comp(ids).logits, ref) <= 1e-4
    attn = get_adapter(comp.config).attention(comp, 0)
    attn.fused_decode = True
    assert not attn.decodes_fused(torch.zeros(1, 4, 1, 8))


# ---------------------------------------------------------------------------------------------- adapters


def test_unsupported_model_names_every_supported_family() -> None:
    gpt2 = tiny_model("gpt2")
    with pytest.raises(
        UnsupportedModelError,
        match=r"'gpt2'.*supported: gemma3_text, llama, mistral, opt, phi3, qwen2, qwen3$",
    ):
        get_adapter(gpt2.config)
    plan = allocate_ranks([{"k": [torch.ones(8)], "v": [torch.ones(8)]}], ratio=1.0, group_size=1, head_dim=8)
    with pytest.raises(UnsupportedModelError):
        compress_model(gpt2, [], plan, decomposition={"name": "whitened"})
    assert isinstance(UnsupportedModelError("x"), ValueError)
