"""Prefill/decode perplexity, KV bytes per token and KL, on tiny random Llamas and shakespeare-llama."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from lrkv_core.cache import GearStorage, cache_kwargs, cache_nbytes, output_cache
from lrkv_core.data.datasets import eval_windows
from lrkv_core.evaluation import metrics
from lrkv_core.evaluation.metrics import (
    EvalResult,
    decode_perplexity,
    kl_and_agreement,
    kv_bytes_per_token,
    prefill_perplexity,
)
from tests.support.latents import tiny_compressed
from tests.support.models import tiny_model

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
SHAKESPEARE = SHARED / "models" / "shakespeare-llama"
VALID_TXT = SHARED / "data" / "shakespeare" / "valid.txt"


pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A 2-layer GQA Llama with a wider vocabulary and MLP; a large init range makes predictions depend
    strongly on the context."""
    kwargs = dict(vocab_size=97, intermediate_size=64, initializer_range=0.3, pad_token_id=None)
    return tiny_model("llama", 2, seed, **(kwargs | overrides))


def _windows(n: int, t: int, vocab: int = 97, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def shakespeare():
    if not (SHAKESPEARE.exists() and VALID_TXT.exists()):
        pytest.skip(f"shared assets absent: {SHAKESPEARE} / {VALID_TXT}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHAKESPEARE)
    return AutoModelForCausalLM.from_pretrained(SHAKESPEARE), eval_windows(
        f"text:{VALID_TXT}", tok, seq_len=256
    )


def _reference_nll(model: LlamaForCausalLM, windows: torch.Tensor, first_target: int) -> float:
    """Mean NLL over targets first_target..T-1, window by window, in float64 with explicit gathers."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            logp = torch.log_softmax(model(ids[None]).logits[0].double(), dim=-1)  # (T, V)
            picked = logp[first_target - 1 : -1].gather(-1, ids[first_target:, None])
            total -= picked.sum().item()
            count += picked.numel()
    return total / count


def test_prefill_matches_reference_and_ignores_batching() -> None:
    model, windows = _tiny_llama(), _windows(5, 20)
    res = prefill_perplexity(model, windows, batch_size=2)
    assert res["nll"] == pytest.approx(_reference_nll(model, windows, 1), abs=1e-5)
    assert res["ppl"] == pytest.approx(math.exp(res["nll"]))
    assert res["tokens"] == 5 * 19 and res["windows"] == 5
    assert res["protocol"] == {
        "measure": "prefill_nll", "through_cache": True, "seq_len": 20, "windows": 5, "targets": [1, 20],
        "tokens_scored": 95,
    }  # fmt: skip
    assert prefill_perplexity(model, windows, batch_size=5)["nll"] == pytest.approx(res["nll"], abs=1e-6)
    later = prefill_perplexity(model, windows, score_from=12)
    assert later["nll"] == pytest.approx(_reference_nll(model, windows, 12), abs=1e-5)
    assert later["tokens"] == 5 * 8


def test_decode_equals_prefill_on_the_same_targets() -> None:
    model, windows = _tiny_llama(), _windows(5, 24)
    calls = []
    dec = decode_perplexity(
        model, windows, prefix_len=7, batch_size=2, progress=lambda d, n: calls.append((d, n))
    )
    pre = prefill_perplexity(model, windows, score_from=7)
    assert abs(dec["nll"] - pre["nll"]) < 1e-5
    assert dec["tokens"] == pre["tokens"] == 5 * 17
    assert dec["cache_class"] == "DynamicCache"
    assert dec["protocol"]["prefix_len"] == 7 and dec["protocol"]["targets"] == pre["protocol"]["targets"]
    assert calls[-1] == (3 * 17, 3 * 17) and [d for d, _ in calls] == sorted(d for d, _ in calls)
    # The check has teeth: the same targets predicted without the cached context score very differently.
    with torch.no_grad():
        logits = torch.cat([model(windows[:, p - 1 : p]).logits for p in range(7, 24)], dim=1)  # (N, 17, V)
    no_context = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 7:].flatten()).item()
    assert abs(no_context - dec["nll"]) > 0.05


def test_decode_rejects_bad_prefix() -> None:
    model, windows = _tiny_llama(), _windows(2, 10)
    for prefix_len in (0, 10):
        with pytest.raises(ValueError, match="prefix_len"):
            decode_perplexity(model, windows, prefix_len=prefix_len)


def test_model_training_flag_is_restored() -> None:
    model = _tiny_llama().train()
    prefill_perplexity(model, _windows(2, 8))
    assert model.training


@pytest.mark.parametrize(("dtype", "elem"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_kv_bytes_of_plain_llama_are_keys_and_values_only(dtype: torch.dtype, elem: int) -> None:
    model = _tiny_llama(num_hidden_layers=3).to(dtype)
    res = kv_bytes_per_token(model, _windows(4, 16), n_rows=2)
    n_layers, n_kv, head_dim = 3, 2, 32 // 4
    assert res["kv_bytes_per_token"] == 2 * n_layers * n_kv * head_dim * elem
    assert res["kv_bytes_total"] == 2 * 16 * 2 * n_layers * n_kv * head_dim * elem
    assert res["cache_class"] == "DynamicCache"
    assert res["protocol"]["windows"] == 2 and res["protocol"]["tokens_prefilled"] == 32
    # the original model's own cache is the reference: compression 1
    assert res["dense_kv_bytes_per_token"] == res["kv_bytes_per_token"] and res["kv_compression_ratio"] == 1


def test_decode_reports_the_bytes_its_cache_holds_after_the_last_step(compress) -> None:
    """The original's DynamicCache holds what a prefill of the same tokens holds; a GEAR cache's decode holds
    its streaming state (a buffer of recent float32 latents, appended segments), not what a one-pass prefill
    of the same tokens holds; either way the figure is the cache's own tensors after the last step."""
    model, windows = _tiny_llama(num_hidden_layers=3), _windows(2, 40)
    res = decode_perplexity(model, windows, prefix_len=8)
    assert res["kv_bytes_per_token"] == res["dense_kv_bytes_per_token"] == 2 * 3 * 2 * 8 * 4
    assert res["kv_bytes_total"] == 2 * 39 * 2 * 3 * 2 * 8 * 4 and res["protocol"]["tokens_held"] == 2 * 39
    comp = tiny_compressed(compress)
    comp.config.lrkv["cache"] = GearStorage(bits=3, rank=2, buffer=6).to_dict()
    ids = _windows(2, 40, vocab=61)
    res = decode_perplexity(comp, ids, prefix_len=8)
    with torch.no_grad():
        cache = output_cache(comp(ids[:, :8], use_cache=True))
        for pos in range(8, 39):
            cache = output_cache(comp(ids[:, pos : pos + 1], **cache_kwargs(cache), use_cache=True))
    assert (
        res["kv_bytes_total"] == cache_nbytes(cache) and res["kv_bytes_per_token"] == cache_nbytes(cache) / 78
    )
    prefill = kv_bytes_per_token(comp, ids[:, :39], n_rows=2)
    assert res["kv_bytes_per_token"] != prefill["kv_bytes_per_token"]
    metrics_ = EvalResult("m", res, res, prefill).metrics()  # the run's flat metrics name both figures
    assert (
        metrics_["decode_kv_bytes_per_token"] == res["kv_bytes_per_token"] != metrics_["kv_bytes_per_token"]
    )


def test_a_logits_budget_scores_fewer_rows_per_pass_and_the_same_numbers(monkeypatch) -> None:
    """Below ``LOGITS_BYTES`` a batch is scored a row (or a few) at a time: the same NLL and KL."""
    base, other, windows = _tiny_llama(0), _tiny_llama(1), _windows(5, 20)
    whole = prefill_perplexity(other, windows, batch_size=5), kl_and_agreement(base, other, windows)
    calls = []
    other.register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append(kwargs.get("input_ids", args[0] if args else None).shape[0]),
        with_kwargs=True,
    )
    monkeypatch.setattr(metrics, "LOGITS_BYTES", 2 * 20 * 97 * 4)  # two rows' logits
    rowwise = prefill_perplexity(other, windows, batch_size=5), kl_and_agreement(base, other, windows)
    assert calls == [2, 2, 1, 2, 2, 1]  # prefill, then the KL: at most two rows per forward pass
    assert rowwise[0]["nll"] == pytest.approx(whole[0]["nll"], abs=1e-6)
    assert rowwise[1]["kl"] == pytest.approx(whole[1]["kl"], rel=1e-5)
    assert rowwise[1]["top1_agreement"] == whole[1]["top1_agreement"]


def test_kl_of_a_model_with_itself_is_zero() -> None:
    model, windows = _tiny_llama(), _windows(3, 12)
    res = kl_and_agreement(model, model, windows, batch_size=2)
    assert res["kl"] == 0.0 and res["top1_agreement"] == 1.0
    assert res["tokens"] == 36 and res["protocol"]["seq_len"] == 12


def test_kl_of_a_different_model_matches_float64_reference() -> None:
    base, other, windows = _tiny_llama(0), _tiny_llama(0), _windows(3, 12)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
        logp = torch.log_softmax(base(windows).logits.double(), -1)  # (N, T, V)
        logq = torch.log_softmax(other(windows).logits.double(), -1)
    expected_kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    expected_agree = (logp.argmax(-1) == logq.argmax(-1)).double().mean().item()
    res = kl_and_agreement(base, other, windows, batch_size=2)
    assert res["kl"] == pytest.approx(expected_kl, rel=1e-4) and res["kl"] > 1e-3
    assert res["top1_agreement"] == pytest.approx(expected_agree) and res["top1_agreement"] < 1.0


def test_an_eval_result_reads_its_parts_by_name_and_round_trips_its_json_form() -> None:
    model, windows = _tiny_llama(), _windows(3, 12)
    parts = {
        "prefill": prefill_perplexity(model, windows, batch_size=2),
        "decode": decode_perplexity(model, windows, prefix_len=6, batch_size=2),
        "kv": kv_bytes_per_token(model, windows),
    }
    plain = EvalResult(model="m", **parts)
    assert plain.kl is None and plain.kl_to_base is None and plain.top1_agreement is None
    assert set(plain.to_dict()) == {"model", "prefill", "decode", "kv"}  # absent parts are left out
    scores = {"results": {"piqa": {"acc": 0.5}}}
    full = EvalResult(model="m", **parts, kl=kl_and_agreement(model, model, windows), zeroshot=scores)
    assert EvalResult.from_dict(full.to_dict()) == full
    assert full.prefill_ppl == parts["prefill"]["ppl"] and full.decode_ppl == parts["decode"]["ppl"]
    assert full.kl_to_base == 0.0 and full.top1_agreement == 1.0
    assert full.metrics("base_") == {
        "base_prefill_ppl": parts["prefill"]["ppl"],
        "base_decode_ppl": parts["decode"]["ppl"],
        "base_kv_bytes_per_token": parts["kv"]["kv_bytes_per_token"],
        "base_decode_kv_bytes_per_token": parts["decode"]["kv_bytes_per_token"],
        "base_zeroshot.piqa.acc": 0.5,
    }
    with pytest.raises(ValueError, match="unknown part"):
        EvalResult.from_dict(full.to_dict() | {"perplexity": 1.0})


def test_shakespeare_prefill_reproduces_readme(shakespeare) -> None:
    model, windows = shakespeare
    res = prefill_perplexity(model, windows)
    assert res["windows"] == 95 and res["tokens"] == 95 * 255
    assert res["nll"] == pytest.approx(3.1795, abs=5e-5)
    assert round(res["ppl"], 2) == 24.03


def test_shakespeare_decode_equals_prefill(shakespeare) -> None:
    model, windows = shakespeare
    few = windows[:3, :96]
    dec = decode_perplexity(model, few, prefix_len=48)
    pre = prefill_perplexity(model, few, score_from=48)
    assert abs(dec["nll"] - pre["nll"]) < 1e-5 and dec["tokens"] == 3 * 48


def test_a_compressed_model_shares_the_tensors_it_has_in_common_with_its_original(compress) -> None:
    from lrkv_core.model.loading import share_equal_weights

    base = _tiny_llama(tie_word_embeddings=True)
    comp, _ = compress(base, group_size=1, ratio=0.5)
    with torch.no_grad():
        comp.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0  # one tensor that differs stays its own
    ids = _windows(2, 12)
    with torch.no_grad():
        before = comp(ids).logits
    theirs = dict(base.named_parameters(remove_duplicate=False)) | dict(base.named_buffers())
    equal = {
        n: p.numel() * p.element_size()
        for n, p in [*comp.named_parameters(), *comp.named_buffers()]  # a tied tensor counts once
        if n in theirs and p.shape == theirs[n].shape and torch.equal(p, theirs[n])
    }
    freed = share_equal_weights(comp, base)
    mine = dict(comp.named_parameters(remove_duplicate=False))
    shared = {n for n, p in mine.items() if n in theirs and p.data_ptr() == theirs[n].data_ptr()}
    assert shared == {n for n in mine if n in equal or n == "lm_head.weight"}
    assert all(b.data_ptr() == theirs[n].data_ptr() for n, b in comp.named_buffers() if n in equal)
    assert "model.layers.0.mlp.down_proj.weight" in shared and "model.embed_tokens.weight" in shared
    assert "model.layers.1.mlp.up_proj.weight" not in shared
    assert not any(p in n for n in shared for p in ("k_proj", "v_proj", "o_proj"))  # what compression changed
    assert freed == sum(equal.values()) > 0
    with torch.no_grad():
        assert torch.equal(comp(ids).logits, before)
    assert share_equal_weights(comp, base) == 0  # a second call finds nothing left to share
