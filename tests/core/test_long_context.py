"""The long-context suite: retrieval prompts (needles where they say, answers once, exact lengths), the exact
match scorer, continuation scoring through the cache against one forward of the whole window, and seeds.

Text is tokenized by a byte-level BPE trained here on generated sentences (lrkv_demo's builtin tokenizer
trainer), so no file or download is needed; tiny random models get that tokenizer's vocabulary.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from lrkv_core.cache import LatentCache, output_cache
from lrkv_core.conversion.pipeline import use_cache_storage
from lrkv_core.evaluation.longcontext import (
    ANSWER_RESERVE,
    LongContextProtocol,
    cap_lengths,
    continuation_nll,
    cut_windows,
    evaluate_long_context,
)
from lrkv_core.evaluation.metrics import decode_perplexity, dense_kv_bytes
from lrkv_core.evaluation.needles import (
    INTRO,
    SNAP,
    TASKS,
    PromptTooShort,
    _content,
    generate_answer,
    is_exact_match,
    make_sample,
    make_samples,
)
from lrkv_demo.corpus import train_tokenizer
from tests.support.models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the a river garden king queen sword letter night morning walked spoke saw found old quiet".split()
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _text(n_sentences: int, seed: int = 0) -> str:
    """Sentences of random words, some with numbers (which a drawn value must not collide with)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_sentences):
        words = list(rng.choice(WORDS, rng.integers(4, 9)))
        if i % 5 == 0:
            words.append(str(rng.integers(10_000, 100_000)))
        out.append(" ".join(words).capitalize() + rng.choice([".", ".", "!", "?"]))
    return " ".join(out) + "\n"


@pytest.fixture(scope="module")
def tokenizer():
    """A 600-token BPE that has seen the templates (else a byte-level one would spend most of a short prompt
    on them)."""
    rng = np.random.default_rng(0)
    templates = "".join("".join(n) + q for n, q, _, _ in (_content(t, rng) for t in TASKS))
    return train_tokenizer(_text(400, seed=1) + (INTRO + templates) * 10, 600, 4096)


@pytest.fixture(scope="module")
def haystack(tokenizer) -> torch.Tensor:
    return torch.tensor(tokenizer(_text(300), add_special_tokens=False)["input_ids"])  # (S,)


def _llama(tokenizer, seed: int = 0, **overrides):
    kwargs = {"vocab_size": len(tokenizer), "max_position_embeddings": 512} | overrides
    return tiny_model("llama", 2, seed, **kwargs)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- retrieval prompts


@pytest.mark.parametrize("task", TASKS)
def test_prompts_have_the_length_asked_and_the_needle_at_its_depth(task, tokenizer, haystack) -> None:
    prefix = len(_encode(tokenizer, INTRO))  # this tokenizer adds no BOS
    for length in (192, 256):
        for depth in DEPTHS:
            s = make_sample(task, tokenizer, haystack, length=length, depth=depth, seed=3)
            assert s.input_ids.shape == (length,)
            assert abs(s.actual_depth - depth) <= SNAP + 1 / s.haystack_len  # a sentence end, a token
            needle = tokenizer.decode(s.input_ids[s.needle_start : s.needle_start + s.needle_len])
            value = s.answer if task != "variables" else needle.split("=")[1].strip(" .")
            assert value.isdigit() and value in needle  # the asked needle's tokens, where it says
            if task in ("passkey", "needle"):  # one needle: the haystack tokens before it are the depth
                assert s.needle_start - prefix == round(s.actual_depth * s.haystack_len)
            if depth == 0.0:
                assert s.needle_start == prefix
            if depth == 1.0 and task != "variables":  # last: only needles and the question follow it
                tail = tokenizer.decode(s.input_ids[s.needle_start + s.needle_len :])
                assert tail.startswith("\n\n") or tail.startswith(" One of")


@pytest.mark.parametrize("task", TASKS)
def test_the_answer_occurs_once_in_the_context(task, tokenizer, haystack) -> None:
    for s in make_samples(task, tokenizer, haystack, length=200, depth=0.5, samples=12, seed=0):
        text = tokenizer.decode(s.input_ids)
        context, question = text.split("\n\nWhat is" if task != "variables" else "\n\nFind all", 1)
        if task == "variables":
            value = tokenizer.decode(s.input_ids[s.needle_start : s.needle_start + s.needle_len])
            value = value.split("=")[1].strip(" .")
            assert context.count(value) == 1
            names = s.answer.split()
            assert len(set(names)) == 4 and all(context.count(f"VAR {n} =") == 1 for n in names)
        else:
            assert context.count(s.answer) == 1 and s.answer not in question
    if task == "multikey":  # the key asked is in exactly one needle; three distractor needles
        assert context.count("special magic numbers for") == 4
        key = question.split("number for ")[1].split(" ")[0]
        assert context.count(f"numbers for {key} is") == 1


def test_too_short_a_prompt_and_bad_depths_are_refused(tokenizer, haystack) -> None:
    with pytest.raises(PromptTooShort, match="does not fit the template"):
        make_sample("needle", tokenizer, haystack, length=40, depth=0.5, seed=0)
    with pytest.raises(ValueError, match="depth must be in"):
        make_sample("passkey", tokenizer, haystack, length=200, depth=1.5, seed=0)
    with pytest.raises(ValueError, match="unknown retrieval task"):
        make_sample("essay", tokenizer, haystack, length=200, depth=0.5, seed=0)


def test_samples_are_a_function_of_the_seed(tokenizer, haystack) -> None:
    a = make_samples("multikey", tokenizer, haystack, length=192, depth=0.25, samples=3, seed=5)
    b = make_samples("multikey", tokenizer, haystack, length=192, depth=0.25, samples=3, seed=5)
    c = make_samples("multikey", tokenizer, haystack, length=192, depth=0.25, samples=3, seed=6)
    assert all(torch.equal(x.input_ids, y.input_ids) and x.answer == y.answer for x, y in zip(a, b))
    assert [x.answer for x in a] != [x.answer for x in c]
    assert len({x.answer for x in a}) == 3  # the samples of a cell differ
    short = make_sample("passkey", tokenizer, haystack[:30], length=256, depth=0.5, seed=0)  # repeated
    assert short.input_ids.shape == (256,) and short.haystack_len > 30


# --------------------------------------------------------------------------- scoring


def test_exact_match() -> None:
    assert is_exact_match(" 68231.", "68231") and is_exact_match("68231", "68231")
    assert is_exact_match("\n68231 is the key", "68231")
    assert not is_exact_match(" 682310", "68231")  # a longer number
    assert not is_exact_match(" 68213", "68231") and not is_exact_match("", "68231")
    assert not is_exact_match(" the key 68231", "68231")  # not what the answer starts with
    assert is_exact_match(" AB CD EF, and", "AB CD EF") and not is_exact_match(" AB CD", "AB CD EF")


def test_generated_answers_are_scored_through_the_models_cache(tokenizer, haystack, compress) -> None:
    """Greedy generate through a full-rank compressed model's LatentCache answers what the original does
    through its DynamicCache; the scorer passes the text generated and fails a changed one."""
    model = _llama(tokenizer)
    comp, _ = compress(model, 2, ratio=1.0)
    seen = []
    comp.register_forward_hook(lambda m, a, out: seen.append(type(output_cache(out))))
    for s in make_samples("needle", tokenizer, haystack, length=128, depth=0.5, samples=2, seed=1):
        out = generate_answer(model, tokenizer, s)
        assert generate_answer(comp, tokenizer, s) == out and out.strip()
        right = replace(s, answer=out.strip().split()[0])
        wrong = right.answer[:-1] + ("x" if right.answer[-1] != "x" else "y")
        assert is_exact_match(generate_answer(comp, tokenizer, right), right.answer)
        assert not is_exact_match(generate_answer(comp, tokenizer, right), wrong)
    assert seen and set(seen) == {LatentCache}


# --------------------------------------------------------------------------- continuation


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
def test_continuation_through_the_cache_equals_one_forward_of_the_window(arch, compress) -> None:
    """Chunked prefill + one forward of the continuation = the whole window in one cache-free forward, for
    the original model (DynamicCache) and a full-rank compressed one (LatentCache), and = token-by-token
    decode through the cache."""
    model = tiny_model(arch, None, 0, max_position_embeddings=256)
    stream = torch.randint(3, 61, (300,), generator=torch.Generator().manual_seed(4))
    windows = cut_windows([stream], 40 + 16, 3)  # (3, 56): contexts of 40, continuations of 16
    assert windows.shape == (3, 56) and torch.equal(windows[1], stream[56:112])
    led = cut_windows([stream], 56, None, prefix=[1])  # a text stream's windows after the tokenizer's BOS
    assert led.shape == (5, 56) and (led[:, 0] == 1).all() and torch.equal(led[1, 1:], stream[55:110])
    comp, _ = compress(model, 2 if arch != "opt" else 4, ratio=1.0)
    for m in (model, comp):
        with torch.no_grad():
            logits = m(windows, use_cache=False).logits  # (3, 56, V)
        ref = torch.nn.functional.cross_entropy(
            logits[:, 39:-1].flatten(0, 1).double(), windows[:, 40:].flatten()
        )
        for chunk in (7, 40, 64):
            total, tokens, held = continuation_nll(m, windows, context_len=40, chunk_size=chunk)
            assert tokens == 48 and total / tokens == pytest.approx(ref.item(), abs=2e-5)
        decode = decode_perplexity(m, windows, prefix_len=40)
        assert decode["nll"] == pytest.approx(total / tokens, abs=2e-5)
        # the bytes held after the windows' 55 tokens, measured from the caches: the same tensors, but each of
        # the continuation's three caches (a window each) holds the scalars the decode's one cache holds once
        assert 0 <= held - decode["kv_bytes_total"] <= 2 * 16 and decode["protocol"]["tokens_held"] == 3 * 55
    dense = dense_kv_bytes(model.config, 1, 55, torch.float32)  # one window's DynamicCache
    assert continuation_nll(model, windows, context_len=40)[2] == 3 * dense > 0
    assert abs(ref.item() - np.log(61)) > 0.05  # a random model's context matters: not a uniform guess


def test_strided_windows_overlap_and_score_distinct_tokens() -> None:
    """Windows every ``stride`` tokens: each the prefix then the stream from its start; the last ``stride``
    tokens of consecutive windows tile the stream without a gap or a repeat; a stride of a whole window's
    body gives the non-overlapping windows; a stride under one token is refused."""
    stream = torch.arange(300)
    windows = cut_windows([stream], 56, None, prefix=[1], stride=20)  # bodies of 55 tokens
    assert windows.shape == (13, 56) and (windows[:, 0] == 1).all()  # starts 0, 20, …, 240 (240 + 55 ≤ 300)
    for i, w in enumerate(windows):
        assert torch.equal(w[1:], stream[20 * i : 20 * i + 55])
    tails = windows[:, -20:].flatten()
    assert torch.equal(tails, stream[35 : 35 + 20 * 13])
    assert torch.equal(cut_windows([stream], 56, 4, prefix=[1], stride=55), cut_windows([stream], 56, 4, [1]))
    with pytest.raises(ValueError, match="stride"):
        cut_windows([stream], 56, None, stride=0)


def test_the_suite_scores_strided_windows_and_refuses_a_stride_that_scores_twice() -> None:
    """With ``stride``, the suite's windows are the strided ones (more of them than fit apart), scored as
    :func:`continuation_nll` scores them, and the protocol records the stride; a stride under the
    continuation is refused."""
    model = tiny_model("llama", 2, 0, max_position_embeddings=256)
    stream = torch.randint(3, 61, (300,), generator=torch.Generator().manual_seed(4))
    protocol = LongContextProtocol(
        dataset="random", lengths=(56,), continuation=16, stride=30, windows=None, tasks=()
    )
    res = evaluate_long_context(model, None, [stream], protocol)
    windows = cut_windows([stream], 72, None, stride=30)
    assert windows.shape[0] == 8 > cut_windows([stream], 72, None).shape[0] == 4
    assert res.continuation[0].windows == 8 and res.protocol.stride == 30
    assert res.continuation[0].nll == pytest.approx(continuation_nll(model, windows, context_len=56)[0] / 128)
    with pytest.raises(ValueError, match="stride of 15 tokens would score some of the 16"):
        evaluate_long_context(model, None, [stream], replace(protocol, stride=15))


def test_continuation_reads_the_storage_the_config_names(compress) -> None:
    """A 2-bit quantized latent cache changes the continuation's NLL (it is read back from the cache); the
    dense one does not; the protocol records the storage."""
    model = tiny_model("llama", 2, 0, max_position_embeddings=256)
    comp, _ = compress(model, 2, ratio=1.0)
    windows = torch.randint(3, 61, (2, 72), generator=torch.Generator().manual_seed(2))
    dense = continuation_nll(comp, windows, context_len=56, chunk_size=16)[0]
    assert dense == pytest.approx(continuation_nll(model, windows, context_len=56)[0], abs=1e-3)
    use_cache_storage(comp, {"name": "quantized", "bits": 2})
    quantized = continuation_nll(comp, windows, context_len=56, chunk_size=16)[0]
    assert abs(quantized - dense) > 1e-3
    protocol = LongContextProtocol(dataset="random", lengths=(56,), continuation=16, windows=2, tasks=())
    res = evaluate_long_context(comp, None, [windows.flatten()], protocol, base=model)
    assert res.protocol.cache["name"] == "quantized" and res.protocol.cache["bits"] == 2
    assert res.continuation[0].nll == pytest.approx(quantized / 32, abs=1e-6)
    score = res.continuation[0]  # 2-bit codes with float16 scales: well under the original's bytes
    assert score.base_kv_bytes_per_token == dense_kv_bytes(model.config, 1, 71, torch.float32) / 71
    assert 0 < score.kv_bytes_per_token < score.base_kv_bytes_per_token / 4
    assert "KV bytes/token" in res.markdown() and f"{score.kv_bytes_per_token:.1f}" in res.markdown()


def test_lengths_are_capped_by_the_models_positions() -> None:
    assert cap_lengths([64, 512, 128], 256, 128) == (64, 128)
    assert cap_lengths([1024, 2048], None, 256) == (1024, 2048)
    with pytest.raises(ValueError, match="leaves no room"):
        cap_lengths([64], 100, 128)


# --------------------------------------------------------------------------- the suite


def test_the_suite_is_reproducible_and_records_its_protocol(tokenizer, haystack, compress) -> None:
    model = _llama(tokenizer, max_position_embeddings=220)
    comp, _ = compress(model, 2, ratio=1.0)
    protocol = LongContextProtocol(
        dataset="generated", lengths=(128, 1024), continuation=16, windows=2, chunk_size=50,
        depths=(0.0, 1.0), samples=1, tasks=("passkey", "needle"), seed=7,
    )  # fmt: skip
    calls = []
    res = evaluate_long_context(
        comp, tokenizer, [haystack], protocol, base=model, progress=lambda d, n: calls.append((d, n))
    )
    again = evaluate_long_context(comp, tokenizer, [haystack], protocol, base=model).to_dict()
    assert res.to_dict() == again
    p = res.to_dict()["protocol"]
    assert p["lengths"] == [128, 1024] and p["max_position_embeddings"] == 220
    assert p["context_lengths"] == [128, 204]  # 1024 capped: 204 + 16 continuation tokens = 220
    assert p["prompt_lengths"] == [128, 220 - ANSWER_RESERVE]
    assert res.skipped == [  # the user asked for 1024: said so, beside the tables
        "continuation at 1024: the model has 220 positions; measured at 204 instead",
        f"retrieval at 1024: the model has 220 positions; measured at {220 - ANSWER_RESERVE} instead",
    ]
    assert p["seed"] == 7 and p["depths"] == [0.0, 1.0] and p["dataset"] == "generated"
    assert p["cache"] == {"name": "dense"} and p["continuation"] == 16
    assert [c.context_len for c in res.continuation] == [128, 204]
    for c in res.continuation:  # full rank: the compressed model scores what the original does
        assert c.windows == 2 and c.tokens == 32 and c.nll == pytest.approx(c.base_nll, abs=1e-4)
    assert {(r.task, r.length, r.depth) for r in res.retrieval} == {
        (t, n, d) for t in ("passkey", "needle") for n in (128, 188) for d in (0.0, 1.0)
    }
    assert all(r.correct == r.base_correct and r.samples == 1 for r in res.retrieval)
    assert set(res.grid("needle")) == {"0", "1"} and set(res.grid("needle")["1"]) == {"128", "188"}
    assert calls[-1][0] == calls[-1][1] == 2 * (2 * 2 + 8 * 1)  # two models: windows + prompts
    assert "| 204 | 2 |" in res.markdown() and len(res.table()) == 2 + 8
    other = evaluate_long_context(comp, tokenizer, [haystack], replace(protocol, seed=8, tasks=()))
    assert [c.nll for c in other.continuation] == [c.nll for c in res.continuation]  # windows: not seeded


def test_a_cache_factorys_cache_is_the_one_filled(tokenizer, haystack) -> None:
    """``cache_factory`` (e.g. transformers' QuantizedCache for an original model) is the cache that the
    continuation's prefill and generate fill, with the same results as the model's default cache."""
    model = _llama(tokenizer)
    made = []

    def factory() -> DynamicCache:
        made.append(DynamicCache(config=model.config))
        return made[-1]

    windows = cut_windows([haystack], 96, 2)  # (2, 96)
    assert continuation_nll(model, windows, context_len=80, chunk_size=30, cache_factory=factory)[0] == (
        pytest.approx(continuation_nll(model, windows, context_len=80)[0], abs=1e-4)
    )
    assert len(made) == 2 and made[-1].get_seq_length() == 95  # the context and all but the last target
    sample = make_sample("passkey", tokenizer, haystack, length=128, depth=0.5, seed=0)
    assert generate_answer(model, tokenizer, sample, cache_factory=factory) == generate_answer(
        model, tokenizer, sample
    )
    assert len(made) == 3 and made[-1].get_seq_length() >= 128


def test_shakespeare_continuation_equals_prefill_scoring_of_the_same_windows() -> None:
    """On the real shared model: ``evaluate_long_dir``'s continuation NLL after 128 tokens is the NLL of the
    same targets in one forward of each window (the first non-overlapping 160-token windows of the text)."""
    from lrkv_core.conversion.pipeline import evaluate_long_dir
    from lrkv_core.data.datasets import eval_windows
    from lrkv_core.evaluation.metrics import prefill_perplexity
    from lrkv_core.model.loading import load_model
    from tests.support.models import SHARED

    model_dir, text = SHARED / "models" / "shakespeare-llama", SHARED / "data" / "shakespeare" / "valid.txt"
    if not (model_dir.is_dir() and text.is_file()):
        pytest.skip(f"shared assets absent: {model_dir} / {text}")
    dataset = f"text:{text}[:10%]"
    protocol = LongContextProtocol(dataset="", lengths=(128,), continuation=32, windows=3, tasks=())
    res = evaluate_long_dir(str(model_dir), dataset, protocol)
    assert res.protocol.dataset == dataset and res.protocol.cache == "DynamicCache"
    model, tokenizer = load_model(str(model_dir))
    windows = eval_windows(dataset, tokenizer, seq_len=160, max_windows=3)
    ref = prefill_perplexity(model, windows, score_from=128)
    (row,) = res.continuation
    assert row.windows == 3 and row.tokens == ref["tokens"] == 96
    assert row.nll == pytest.approx(ref["nll"], abs=1e-5)
