"""Latents of rotated keys (:class:`~lrkv_core.model.attention_rotated.RotatedKeyAttention`): the original's
logits at full rank, a decode through the cache (dynamic and static) that matches the full forward at half
key rank with no positions cached, a saved model that loads as it was, and the models it refuses."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import CompileConfig

from lrkv_core import load_compressed, save_compressed
from lrkv_core.cache import LatentCache, StaticLatentCache, cache_kwargs, cache_nbytes, output_cache
from lrkv_core.conversion.convert import CompressionConfig, build_params, plan_conversion
from lrkv_core.conversion.refine import PlanWeights
from lrkv_core.lora import RecoveryConfig, TrainingData, check_targets, merge_lora, target_modules, train_lora
from lrkv_core.model.adapters import get_adapter
from lrkv_core.model.attention_rotated import RotatedKeyAttention, check_rotated_keys
from lrkv_core.model.fuse import attention_kind, compress_model
from tests.support.inputs import greedy, ids_for, left_padded, max_diff
from tests.support.models import SLIDING_WINDOW, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def rotated(model, group_size: int, ratio: float, *, cache: dict | None = None):
    """``model`` converted with latents of rotated keys (uniform ranks, multiples of 2)."""
    rows = torch.randint(3, model.config.vocab_size, (8, 24), generator=torch.Generator().manual_seed(5))
    config = CompressionConfig(
        ratio=ratio, group_size=group_size, rank_multiple=2, allocator="uniform", key_latents="rotated",
        cache=cache or "dense",
    )  # fmt: skip
    return plan_conversion(model, rows, config).apply(copy.deepcopy(model))


@pytest.mark.parametrize(
    "arch, group_size, overrides",
    [
        ("llama", 1, {}),
        ("llama", 2, {}),
        ("qwen2", 2, {}),
        ("mistral", 1, {"sliding_window": SLIDING_WINDOW}),
        ("phi3", 2, {}),
        ("phi3_partial", 2, {}),
    ],
    ids=[
        "llama-per-head",
        "llama-joint",
        "qwen2-biases-sliding",
        "mistral-sliding",
        "phi3-fused-qkv",
        "phi3-partial-rope",
    ],
)
def test_full_rank_reproduces_the_original(arch, group_size, overrides) -> None:
    model = tiny_model(arch, 2, **overrides)
    comp = rotated(model, group_size, 1.0)
    assert all(isinstance(get_adapter(comp.config).attention(comp, i), RotatedKeyAttention) for i in range(2))
    assert comp.config.lrkv["rope"] == "rotated-keys"
    ids = ids_for(2, 3 * SLIDING_WINDOW)
    with torch.no_grad():
        assert max_diff(comp(ids).logits, model(ids).logits) <= 1e-4


def test_a_decode_through_the_cache_matches_the_full_forward_at_half_key_rank(tmp_path) -> None:
    model = tiny_model("llama", 2)
    comp = rotated(model, 2, 0.5)
    ranks_k = comp.config.lrkv["ranks_k"]
    assert all(r < 16 and r % 2 == 0 for layer in ranks_k for r in layer)
    ids = ids_for(2, 14)
    with torch.no_grad():
        full = comp(ids).logits
        assert 1e-3 < max_diff(full, model(ids).logits)  # compressed: not the original
        out = comp(ids[:, :6], use_cache=True)
        steps = [out.logits]
        for t in range(6, 14):
            out = comp(ids[:, t : t + 1], use_cache=True, **cache_kwargs(output_cache(out)))
            steps.append(out.logits)
    assert max_diff(torch.cat(steps, dim=1), full) <= 1e-4
    cache = output_cache(out)
    assert isinstance(cache, LatentCache) and all(layer.store.positions is None for layer in cache.layers)
    widths = [sum(rk) + sum(rv) for rk, rv in zip(ranks_k, comp.config.lrkv["ranks_v"])]
    assert cache_nbytes(cache) == sum(2 * 14 * 4 * w for w in widths)  # float32 latents only

    prompt, mask = left_padded((9, 4))
    dynamic = greedy(comp, prompt, mask)
    static = StaticLatentCache.from_config(comp.config, max_cache_len=prompt.shape[1] + 8)
    assert torch.equal(greedy(comp, prompt, mask, **cache_kwargs(static)), dynamic)

    save_compressed(comp, tmp_path / "m")
    loaded = load_compressed(tmp_path / "m")
    assert isinstance(get_adapter(loaded.config).attention(loaded, 0), RotatedKeyAttention)
    with torch.no_grad():
        assert max_diff(loaded(ids).logits, full) == 0
    assert torch.equal(greedy(loaded, prompt, mask), dynamic)


def test_a_data_free_version_with_rotated_keys(tmp_path) -> None:
    """What ``lrkv bench --keys rotated`` measures: with no calibration the basis is fitted to the weights
    alone (the input's Gram the identity); at full rank the saved model is the original, at half width it
    caches latents of rotated keys at the plan's ranks, and a 4-bit version holds packed codes."""
    from transformers import AutoModelForCausalLM

    from lrkv_core.conversion.pipeline import convert_data_free_dir
    from tests.support.models import tiny_model_dir

    source = tiny_model_dir(tmp_path, "llama", 2)
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    ids = ids_for(2, 20)
    outs = {}
    for ratio, bits in [(1.0, None), (0.5, None), (0.5, 4)]:
        out = tmp_path / f"r{ratio}-{bits}"
        record = convert_data_free_dir(str(source), str(out), ratio=ratio, bits=bits, key_latents="rotated")
        assert record == {"ratio": ratio, "bits": bits, "key_latents": "rotated"}
        outs[ratio, bits] = load_compressed(out)
        assert outs[ratio, bits].config.lrkv["rope"] == "rotated-keys"
        assert isinstance(get_adapter(model.config).attention(outs[ratio, bits], 1), RotatedKeyAttention)
    with torch.no_grad():
        assert max_diff(outs[1.0, None](ids).logits, model(ids).logits) <= 1e-4
        half = outs[0.5, None]
        assert 1e-3 < max_diff(half(ids).logits, model(ids).logits)
        assert half.config.lrkv["ranks_k"] == half.config.lrkv["ranks_v"] == [[8], [8]]  # of 2 heads of 8
        cache = output_cache(half(ids, use_cache=True))
        assert cache_nbytes(cache) == 2 * (2 * 20 * 4 * (8 + 8))  # 2 layers of float32 latents, no positions
        packed = output_cache(outs[0.5, 4](ids, use_cache=True))
        assert cache_nbytes(packed) <= cache_nbytes(cache) / 4  # 4-bit codes and their scales


@pytest.mark.parametrize(
    "arch", ["llama", "phi3", "phi3_partial"], ids=["llama", "phi3-fused-qkv", "phi3-partial-rope"]
)
def test_plans_are_priced_on_the_keys_the_model_caches(arch) -> None:
    """The keys' factors every allocator, the KL response and the refinement read are the rotated basis on
    k_proj's input: the original with its k/v weights cut to a plan (the refinement's model) gives the
    compressed model's logits, and full rank gives k_proj back."""
    model = tiny_model(arch, 2)
    rows = ids_for(8, 24)
    config = CompressionConfig(
        ratio=0.5, group_size=2, rank_multiple=2, allocator="uniform", key_latents="rotated"
    )
    conversion = plan_conversion(model, rows, config)
    comp = conversion.apply(copy.deepcopy(model))
    cut = copy.deepcopy(model)
    weights = PlanWeights(cut, conversion.factors)
    for (layer, kind), groups in weights.factors.items():
        full = torch.cat([g.up.double() @ g.down.double() for g in groups])
        torch.testing.assert_close(full, weights.original[(layer, kind)].double(), atol=1e-5, rtol=0)
    weights.cut(conversion.plan.ranks)
    ids = ids_for(2, 20)
    with torch.no_grad():
        served = comp(ids).logits
        assert 1e-3 < max_diff(served, model(ids).logits)  # compressed: not the original
        assert max_diff(cut(ids).logits, served) <= 1e-4


def test_quantized_latents_of_rotated_keys() -> None:
    """The quantized storage holds the rotated keys' latents as any others: close to the dense model."""
    model = tiny_model("llama", 2)
    dense = rotated(model, 2, 0.5)
    quantized = rotated(model, 2, 0.5, cache={"name": "quantized", "bits": 8})
    ids = ids_for(2, 12)
    with torch.no_grad():
        ref = dense(ids).logits
        out = quantized(ids[:, :4], use_cache=True)
        out = quantized(ids[:, 4:], use_cache=True, **cache_kwargs(output_cache(out)))
    assert 0 < max_diff(out.logits, ref[:, 4:]) <= 0.05


def _decoded(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of ``ids`` (B, T): the first ``prefill`` tokens at once, then one token a step through the
    cache."""
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        steps = [out.logits]
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t : t + 1], use_cache=True, **cache_kwargs(output_cache(out)))
            steps.append(out.logits)
    return torch.cat(steps, dim=1)


def test_the_tale_and_gear_storages_hold_latents_of_rotated_keys() -> None:
    """TALE with every token at the full level gives the dense model's logits and with a low level cuts
    them; GEAR's 8-bit codes stay close."""
    model = tiny_model("llama", 2)
    ids = ids_for(2, 60)
    with torch.no_grad():
        ref = rotated(model, 2, 0.5)(ids).logits
    whole = rotated(model, 2, 0.5, cache={"name": "tale", "low": 0.5, "recent": 100})
    assert max_diff(_decoded(whole, ids, 40), ref) <= 1e-4
    cut = rotated(model, 2, 0.5, cache={"name": "tale", "low": 0.5})
    assert max_diff(_decoded(cut, ids, 40), ref) > 1e-2
    gear = rotated(model, 2, 0.5, cache={"name": "gear", "bits": 8})
    assert 0 < max_diff(_decoded(gear, ids, 40), ref) <= 0.1


def test_models_it_cannot_serve_and_bad_options_are_refused() -> None:
    """Before any work: QK-norm, RoPE per layer type, no RoPE; odd ranks; factors without rotated keys given
    to the rotated attention; a format naming an attention the model cannot take."""
    for arch, why in [
        ("qwen3", "do not support QK-norm"),
        ("gemma3", "do not support QK-norm"),
        ("opt", "opt has no RoPE"),
    ]:
        with pytest.raises(ValueError, match=why):
            rotated(tiny_model(arch, 4 if arch == "opt" else 2), 2, 1.0)
    gemma = tiny_model("gemma3", 2).config
    without_norms = dataclasses.replace(get_adapter(gemma), qk_norm=None)  # Gemma 3's RoPE per layer type
    with pytest.raises(
        ValueError, match="need one RoPE for every layer; convert it with key_latents: rebuilt"
    ):
        check_rotated_keys(without_norms, gemma)
    with pytest.raises(ValueError, match="rank multiple must be even, got 3"):
        CompressionConfig(key_latents="rotated", rank_multiple=3)
    with pytest.raises(ValueError, match="key_latents must be one of rebuilt, rotated"):
        CompressionConfig(key_latents="after-rope")
    model = tiny_model("llama", 2)
    rows = ids_for(4, 16)
    plain = plan_conversion(model, rows, CompressionConfig(ratio=1.0, group_size=2, allocator="uniform"))
    with pytest.raises(ValueError, match="hold no keys fitted after RoPE"):
        params = build_params(plain.config) | {"attention": "rotated-keys"}
        compress_model(copy.deepcopy(model), plain.factors, plain.plan, **params)
    with pytest.raises(ValueError, match="opt models take 'keys-fused-into-q' attention, not 'rotated-keys'"):
        attention_kind(get_adapter(tiny_model("opt", 4).config), "rotated-keys")


def test_the_step_graph_carries_the_option_only_when_asked() -> None:
    """``key_latents: rotated``: each decompose step reads the Gram (a plain decomposition reads none) and
    says so, the build names the attention; the default graph has no ``key_latents`` or ``attention``
    parameters (its cache keys stay)."""
    from lrkv_core.conversion.steps import conversion_steps, statistic_step

    model_config = tiny_model("llama", 2).config
    for key_latents in ("rebuilt", "rotated"):
        options = dict(ratio=0.5, decomposition="plain", allocator="uniform")
        config = CompressionConfig(**options, key_latents=key_latents)
        config = config.for_model(model_config)
        steps = {s.name: s for s in conversion_steps(config, 2).steps}
        decompose = [s for s in steps.values() if s.kind == "decompose"]
        rotated = key_latents == "rotated"
        assert all(("key_latents" in s.params) == rotated for s in decompose)
        assert all((statistic_step("gram") in s.inputs) == rotated for s in decompose)
        assert ("attention" in steps["build"].params) == rotated


@pytest.mark.parametrize(
    "arch, overrides",
    [("llama", {}), ("mistral", {"sliding_window": SLIDING_WINDOW})],
    ids=["llama", "mistral-sliding"],
)
def test_a_decode_step_under_sdpa_reads_each_groups_latents_once(monkeypatch, arch, overrides) -> None:
    """Under SDPA a decode step attends with each group's query heads as the query rows of its one latent
    head, not through transformers' interface (which copies the latents per query head when compiled): the
    same tokens and scores as the interface under eager attention, over dynamic (left-padded) and static
    caches, a sliding layer past its window, and a static step compiled whole."""
    comp = rotated(tiny_model(arch, 2, **overrides), 2, 0.5)
    assert comp.config._attn_implementation == "sdpa"
    prompt, mask = left_padded((9, 4))
    interface_calls = []
    attend = RotatedKeyAttention.attend
    monkeypatch.setattr(
        RotatedKeyAttention, "attend", lambda *a, **k: interface_calls.append(1) or attend(*a, **k)
    )
    kwargs = dict(max_new_tokens=6, output_scores=True, return_dict_in_generate=True)
    packed = greedy(comp, prompt, mask, **kwargs)
    assert len(interface_calls) == 2  # the prompt's forward in each layer; no decode step
    static = greedy(comp, prompt, mask, cache_implementation="static", **kwargs)

    eager = copy.deepcopy(comp)
    eager.set_attn_implementation("eager")
    interface_calls.clear()
    reference = greedy(eager, prompt, mask, **kwargs)
    assert len(interface_calls) == 2 * 6
    for got in (packed, static):
        assert torch.equal(got.sequences, reference.sequences)
        assert max_diff(torch.stack(got.scores), torch.stack(reference.scores)) <= 1e-4

    torch._dynamo.reset()
    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True  # generate()'s compilation of decode steps, allowed on the CPU
    compiled = greedy(comp, prompt, mask, cache_implementation="static", compile_config=config, **kwargs)
    assert torch.equal(compiled.sequences, reference.sequences)


@pytest.mark.parametrize(
    "cache",
    [None, {"name": "quantized", "bits": 4}, {"name": "quantized", "bits": 3}],
    ids=["dense", "4bit", "3bit"],
)
def test_a_decode_step_through_the_absorbed_kernel_is_the_unfused_step(monkeypatch, cache) -> None:
    """The absorbed flash-decoding kernel (Triton's interpreter on the CPU, the GPU where there is one) gives
    the unfused path's logits and tokens, over dense latents and over a quantized cache's packed codes."""
    pytest.importorskip("triton", reason="the fused kernel needs Triton (installed by scripts/setup.sh)")
    import lrkv_core.model.attention_rotated as rotated_module
    from lrkv_core.model.attention import set_fused_decode

    device = "cuda" if torch.cuda.is_available() else "cpu"
    comp = rotated(tiny_model("llama", 2), 2, 0.5, cache=cache).to(device)
    prompt, mask = left_padded((9, 4))
    prompt, mask = prompt.to(device), mask.to(device)
    unfused = greedy(comp, prompt, mask, output_scores=True, return_dict_in_generate=True)
    calls = []
    kernel = rotated_module.absorbed_decode_attention
    monkeypatch.setattr(
        rotated_module, "absorbed_decode_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    assert set_fused_decode(comp, True)
    try:
        fused = greedy(comp, prompt, mask, output_scores=True, return_dict_in_generate=True)
    finally:
        set_fused_decode(comp, None)
    assert len(calls) == 2 * 7  # every layer of every decode step after the prompt's
    assert torch.equal(fused.sequences, unfused.sequences)
    assert max_diff(torch.stack(fused.scores), torch.stack(unfused.scores)) <= 1e-4


def test_sdpa_takes_the_decode_steps_it_reads_faster_than_the_kernel() -> None:
    """Where the choice is lrkv's, a decode step over dense latents in half precision, ranks multiples of 8
    up to 256, under SDPA with a mask shared by the heads goes through SDPA; the kernel keeps a quantized
    cache's codes, float32 latents, other ranks, a per-head mask, eager attention. Forcing the kernel takes
    it; on the CPU (no kernel) neither choice runs it."""
    model = tiny_model("llama", 2)
    dense, quantized = rotated(model, 2, 0.5), rotated(model, 2, 0.5, cache={"name": "quantized", "bits": 4})
    ids = ids_for(2, 6)
    views = {}
    for name, comp in (("dense", dense), ("quantized", quantized)):
        with torch.no_grad():
            views[name] = output_cache(comp(ids, use_cache=True)).layers[0].store.view()
    assert views["dense"].packed is None and views["quantized"].packed is not None
    attn = next(m for m in dense.modules() if isinstance(m, RotatedKeyAttention))
    H, D = attn.shape.H, attn.shape.D
    q = torch.zeros(2, H, 1, D, dtype=torch.bfloat16)
    shared_mask = torch.zeros(2, 1, 1, 6)

    def faster(ranks: int = 64, q: torch.Tensor = q, view: str = "dense", mask=shared_mask, module=attn):
        module.layout = dataclasses.replace(module.layout, ranks_k=(ranks,), ranks_v=(ranks,))
        return module.sdpa_is_faster(q, views[view], mask)

    assert faster() and faster(256) and faster(8) and faster(q=q.half()) and faster(mask=None)
    assert not faster(q=q.float())  # float32: no fast SDPA kernel
    assert not faster(264) and not faster(60)  # past the fast kernels' widest head, not a multiple of 8
    assert not faster(view="quantized")  # packed codes: only the kernel reads them without decoding
    assert not faster(mask=torch.zeros(2, H, 1, 6))  # a mask per head: not one latent head's query rows
    assert not faster(q=torch.zeros(2, H, 2, D, dtype=torch.bfloat16))  # not a decode step
    eager = copy.deepcopy(dense)
    eager.set_attn_implementation("eager")
    assert not faster(module=next(m for m in eager.modules() if isinstance(m, RotatedKeyAttention)))

    faster()  # ranks SDPA reads faster
    assert not attn.takes_kernel(q, views["dense"], shared_mask)  # CPU: the kernel needs CUDA unless forced
    attn.fused_decode = True
    assert attn.takes_kernel(q, views["dense"], shared_mask) and attn.takes_kernel(
        q.float(), views["dense"], None
    )
    attn.fused_decode = False
    assert not attn.takes_kernel(q, views["quantized"], shared_mask)


def _shifted(model, ids: torch.Tensor, offset: int) -> torch.Tensor:
    """Logits of ``ids`` (B, T) at positions ``offset … offset + T − 1``."""
    positions = (torch.arange(ids.shape[1]) + offset).expand(ids.shape[0], -1)
    with torch.no_grad():
        return model(ids, position_ids=positions).logits


def test_lora_recovery_adapts_the_keys_before_rope_so_the_scores_stay_relative() -> None:
    """With latents of rotated keys, LoRA's key role ``k_down`` adapts ``k_proj`` (keys before RoPE): the
    trained and merged model gives the same logits whatever the offset of the positions, as the original
    does. An adapter on the latents' map after RoPE would make the scores depend on absolute positions (it
    would hold only at the positions it was trained on). ``k_up`` cannot be adapted."""
    comp = rotated(tiny_model("llama", 2), 2, 0.5)
    found = target_modules(comp, ("k_down",))
    assert sorted(found) == [f"model.layers.{i}.self_attn.k_proj" for i in range(2)]
    ids = ids_for(2, 12)
    before = _shifted(comp, ids, 0)
    assert max_diff(_shifted(comp, ids, 3000), before) <= 1e-4
    ranks_k = comp.config.lrkv["ranks_k"]
    rows = ids_for(24, 16, seed=3)
    roles = ("k_down", "v_down", "q_proj", "o_proj")
    config = RecoveryConfig(steps=4, r=4, alpha=8, lr=2e-2, batch_size=4, seq_len=16, targets=roles)
    trained = train_lora(copy.deepcopy(comp), TrainingData(rows, rows.clone(), "random"), config)
    merged = merge_lora(trained.model)
    assert max_diff(_shifted(merged, ids, 0), before) > 1e-3  # training changed the model
    assert max_diff(_shifted(merged, ids, 3000), _shifted(merged, ids, 0)) <= 1e-4
    assert merged.config.lrkv["ranks_k"] == ranks_k

    with pytest.raises(ValueError, match="'k_up' does not exist in RotatedKeyAttention"):
        target_modules(comp, ("k_up",))
    with pytest.raises(ValueError, match="latents of rotated keys"):
        check_targets(True, ("k_down", "k_up"), key_latents="rotated")
