"""LoRA recovery: adapters found by structure, exact merge into the projections, unchanged KV cache."""

from __future__ import annotations

import copy

import pytest
import torch

from lrkv_core import load_compressed, save_compressed
from lrkv_core.evaluation.metrics import kv_bytes_per_token
from lrkv_core.lora import (
    ROLES,
    RecoveryConfig,
    TrainingData,
    attach_lora,
    merge_lora,
    target_modules,
    train_lora,
)
from lrkv_core.lora.train import _kl_sum, _nll_sum
from tests.support.inputs import greedy, ids_for, max_diff

pytestmark = pytest.mark.usefixtures("one_thread")
ROPE_ROLES = ROLES
NOROPE_ROLES = tuple(r for r in ROLES if r != "k_up")  # OPT folds B_k into q_proj: no k_up


def _data(rows: int = 24, length: int = 16, seed: int = 3) -> TrainingData:
    ids = ids_for(rows, length, seed)
    return TrainingData(ids, ids.clone(), "random")


def _compressed(make_tiny, compress, arch="llama", ratio=0.5):
    model, _ = compress(make_tiny(arch), group_size=2 if arch != "opt" else 4, ratio=ratio, rank_multiple=2)
    return model


def test_targets_come_from_the_latent_attention_structure(make_tiny, compress):
    model = _compressed(make_tiny, compress)
    found = target_modules(model, ("k_down", "k_up"))
    attn = [model.model.layers[i].self_attn for i in range(2)]
    expected = {id(a.k_down) for a in attn} | {id(up) for a in attn for up in a.k_up}
    assert {id(m) for m in found.values()} == expected  # every layer, one k_up per group
    assert set(found) >= {"model.layers.0.self_attn.k_down", "model.layers.1.self_attn.k_up.0"}


def test_targets_refuse_missing_roles_and_uncompressed_models(make_tiny, compress):
    opt = _compressed(make_tiny, compress, "opt")
    with pytest.raises(ValueError, match="'k_up' does not exist in NoRopeLatentAttention"):
        target_modules(opt, ("k_up",))
    with pytest.raises(ValueError, match="not a latent attention"):
        target_modules(make_tiny("llama"), ("k_down",))
    with pytest.raises(ValueError, match="unknown LoRA targets"):
        RecoveryConfig(targets=("k_proj",))


def test_fresh_adapters_compute_the_compressed_model(make_tiny, compress):
    model = _compressed(make_tiny, compress)
    ids = ids_for(2, 12)
    with torch.no_grad():
        before = model(ids).logits
        peft_model = attach_lora(copy.deepcopy(model), RecoveryConfig(r=4, targets=ROLES))
        assert torch.equal(peft_model(ids).logits, before)  # B starts at zero


def test_one_step_does_not_raise_the_loss(make_tiny, compress):
    model = _compressed(make_tiny, compress, ratio=0.3)
    data = _data(rows=4)
    config = RecoveryConfig(steps=1, r=4, lr=1e-3, batch_size=4, seq_len=16, eval_every=0)
    with torch.no_grad():
        before = _nll_sum(model, data.input_ids, data.labels).item()
    trained = train_lora(model, data, config)
    with torch.no_grad():
        after = _nll_sum(trained.model, data.input_ids, data.labels).item()
    assert after < before


def test_the_distill_objective_fits_the_original_models_predictions(make_tiny, compress):
    """``objective: distill``: each scored token's loss is KL(original ‖ compressed) of the next-token
    distributions (zero against itself); training lowers it on the training rows; the objective and the
    teacher go together."""
    original = make_tiny("llama")
    model = compress(original, group_size=2, ratio=0.3, rank_multiple=2)[0]
    data = _data(rows=4)
    data.labels[:, :5] = -100  # unscored targets: not in the loss
    ids, labels = data.input_ids, data.labels
    with torch.no_grad():
        p = torch.log_softmax(original(ids).logits[:, :-1].float(), -1)
        q = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)
        by_token = (p.exp() * (p - q)).sum(-1)[labels[:, 1:] != -100]  # KL(p ‖ q) per scored token
        before = _kl_sum(model, original, ids, labels)
        assert abs(before.item() - by_token.sum().item()) < 1e-3 * by_token.sum().item()
        assert _kl_sum(original, copy.deepcopy(original), ids, labels).item() < 1e-5
    config = RecoveryConfig(
        steps=10, r=4, lr=1e-2, batch_size=4, seq_len=16, eval_every=0, objective="distill"
    )
    with pytest.raises(ValueError, match="distill objective takes a teacher model"):
        train_lora(copy.deepcopy(model), data, config)
    with pytest.raises(ValueError, match="distill objective takes a teacher model"):
        train_lora(copy.deepcopy(model), data, RecoveryConfig(steps=1, r=4), teacher=original)
    with pytest.raises(ValueError, match="unknown LoRA objective 'kl'; choose from nll, distill"):
        RecoveryConfig(objective="kl")
    trained = train_lora(model, data, config, teacher=original)
    assert not any(p.requires_grad and p.grad is not None for p in original.parameters())
    with torch.no_grad():
        after = _kl_sum(trained.model, original, ids, labels)
    assert after < 0.8 * before, (before, after)
    assert trained.state.history[0]["loss"] == pytest.approx(before.item() / by_token.numel(), rel=1e-4)


@pytest.mark.parametrize(
    "arch,roles",
    [
        ("llama", ROPE_ROLES),
        ("qwen2", ROPE_ROLES),  # biases, a sliding-window layer
        ("qwen3", ROPE_ROLES),  # a wrapped k_up's keys go through k_norm before RoPE
        ("gemma3", ROPE_ROLES),  # the same with Gemma's norm, scale and per-layer RoPE bases
        ("phi3", ROPE_ROLES),  # built from a fused qkv_proj
        ("mistral", ("k_down", "v_down")),
        ("opt", NOROPE_ROLES),  # no RoPE: keys folded into q_proj
    ],
)
def test_merge_equals_the_peft_model_and_keeps_the_cache(make_tiny, compress, arch, roles):
    model = _compressed(make_tiny, compress, arch)
    section = copy.deepcopy(model.config.lrkv)
    ids = ids_for(2, 20, vocab=model.config.vocab_size)
    bytes_before = kv_bytes_per_token(model, ids)["kv_bytes_per_token"]
    with torch.no_grad():
        compressed_logits = model(ids).logits
    config = RecoveryConfig(steps=4, r=4, alpha=8, lr=2e-2, batch_size=4, seq_len=16, targets=roles)
    trained = train_lora(model, _data(), config)
    with torch.no_grad():
        peft_logits = trained.model(ids).logits
        peft_decode = greedy(trained.model, ids[:, :6])
    merged = merge_lora(trained.model)
    with torch.no_grad():
        merged_logits = merged(ids).logits
    assert max_diff(peft_logits, compressed_logits) > 1e-3  # training changed the model
    # the merged weights differ from base + adapter by float32 rounding, which scales with the logits
    assert max_diff(merged_logits, peft_logits) <= 1e-5 * peft_logits.abs().max().item()
    assert merged.config.lrkv == section
    assert kv_bytes_per_token(merged, ids)["kv_bytes_per_token"] == bytes_before
    assert torch.equal(greedy(merged, ids[:, :6]), peft_decode)  # decoding through the latent cache


def test_key_up_adapters_reach_the_rebuilt_keys(make_tiny, compress):
    """k_up is read by the fused key kernel; a wrapped k_up must still act (its forward is called)."""
    model = _compressed(make_tiny, compress)
    ids = ids_for(2, 16)
    with torch.no_grad():
        before = model(ids).logits
    trained = train_lora(model, _data(), RecoveryConfig(steps=3, r=4, lr=5e-2, batch_size=4, seq_len=16,
                                                        targets=("k_up",)))  # fmt: skip
    with torch.no_grad():
        peft_logits = trained.model(ids).logits
        merged_logits = merge_lora(trained.model)(ids).logits
    assert max_diff(peft_logits, before) > 1e-3
    assert max_diff(merged_logits, peft_logits) <= 1e-5


def test_merged_model_saves_and_loads_as_a_compressed_model(make_tiny, compress, tmp_path):
    model = _compressed(make_tiny, compress)
    trained = train_lora(model, _data(), RecoveryConfig(steps=2, r=4, lr=1e-2, batch_size=4, seq_len=16))
    merged = merge_lora(trained.model)
    save_compressed(merged, tmp_path / "m")
    loaded = load_compressed(tmp_path / "m")
    ids = ids_for(2, 16)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, merged(ids).logits)
    assert loaded.config.lrkv == merged.config.lrkv
    state = loaded.state_dict()
    assert not any("lora" in name for name in state)  # nothing of the adapters is left


def test_a_quantized_cache_keeps_its_settings_through_merge_save_and_load(make_tiny, tmp_path):
    """A 4-bit latent cache with a fused rotation: the merged model saves and loads with the same cache
    storage (options included), the same bytes per token, and decodes as the merged model does."""
    from lrkv_core.conversion.convert import CompressionConfig, convert

    cache = {"name": "quantized", "bits": 4, "quant_group_size": 4, "residual": 2}
    config = CompressionConfig(ratio=0.5, group_size=2, rank_multiple=4, cache=cache, rotation="hadamard")
    model = convert(make_tiny("llama"), ids_for(8, 24, seed=123), config)
    section = copy.deepcopy(model.config.lrkv)
    assert section["cache"]["name"] == "quantized" and section["cache"]["bits"] == 4
    ids = ids_for(2, 20)
    kv = kv_bytes_per_token(model, ids)
    trained = train_lora(model, _data(), RecoveryConfig(steps=3, r=4, lr=2e-2, batch_size=4, seq_len=16))
    merged = merge_lora(trained.model)
    save_compressed(merged, tmp_path / "q4")
    loaded = load_compressed(tmp_path / "q4")
    assert loaded.config.lrkv == section  # cache storage, its options, rotation, ranks: all kept
    assert kv_bytes_per_token(loaded, ids)["kv_bytes_per_token"] == kv["kv_bytes_per_token"]
    assert kv["kv_bytes_per_token"] < kv["dense_kv_bytes_per_token"] / 2  # really a quantized cache
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, merged(ids).logits)
    assert torch.equal(greedy(loaded, ids[:, :6]), greedy(merged, ids[:, :6]))
