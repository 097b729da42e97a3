"""benchmarks/long_peer.py's pure parts: the tasks file round-trips to the same windows and prompts lrkv's own
functions make, the press ratio matched to a bytes fraction, and the exact-match rows and table. Nothing here
needs the kvpress environment.

Text is tokenized by a byte-level BPE trained here (lrkv_demo's tokenizer trainer): no file or download.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lrkv_core.data.datasets import token_sequences, window_prefix
from lrkv_core.evaluation.longcontext import cut_windows
from lrkv_core.evaluation.needles import INTRO, TASKS, _content, make_sample
from lrkv_demo.corpus import train_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def long_peer():
    spec = importlib.util.spec_from_file_location("long_peer", ROOT / "benchmarks" / "long_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(n_sentences: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = "the a river garden king queen sword letter night morning walked spoke saw found old".split()
    sentences = (
        " ".join(rng.choice(words, rng.integers(4, 9))).capitalize() + "." for _ in range(n_sentences)
    )
    return " ".join(sentences)


@pytest.fixture(scope="module")
def tokenizer():
    rng = np.random.default_rng(0)
    templates = "".join("".join(n) + q for n, q, _, _ in (_content(t, rng) for t in TASKS))
    return train_tokenizer(_text(400, seed=1) + (INTRO + templates) * 10, 600, 4096)


@pytest.fixture
def dataset(tmp_path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text(_text(600))
    return f"text:{path}[50%:]"


def test_tasks_round_trip_to_lrkv_windows_and_prompts(long_peer, tokenizer, dataset, tmp_path):
    tasks = long_peer.build_tasks(tokenizer, dataset, lengths=[96, 160], continuation=16, windows=3,
                                  depths=[0.0, 1.0], samples=2, seed=5)  # fmt: skip
    path = tmp_path / "tasks.json"
    long_peer.save_tasks(tasks, path)
    loaded = long_peer.load_tasks(path)
    assert loaded == tasks
    seqs = token_sequences(dataset, tokenizer)
    for block in loaded["continuation"]:
        expected = cut_windows(seqs, block["context"] + 16, 3, window_prefix(dataset, tokenizer))
        assert torch.equal(torch.tensor(block["windows"]), expected)
    haystack = torch.cat(seqs)
    assert len(loaded["retrieval"]) == 2 * 2 * 2
    for prompt in loaded["retrieval"]:
        sample = long_peer.needle_sample(prompt)
        again = make_sample("passkey", tokenizer, haystack, length=prompt["length"], depth=prompt["depth"],
                            seed=5, index=prompt["index"])  # fmt: skip
        assert torch.equal(sample.input_ids, again.input_ids) and sample.answer == again.answer
        assert sample.input_ids.numel() == prompt["length"]
        question = tokenizer.decode(prompt["input_ids"][-prompt["question_len"] :])
        assert question == "\n\nWhat is the pass key? The pass key is"
        assert prompt["answer"] not in question


def test_strided_tasks_record_their_stride_and_never_score_a_token_twice(long_peer, tokenizer, dataset):
    tasks = long_peer.build_tasks(tokenizer, dataset, lengths=[96], continuation=16, windows=50, stride=24,
                                  samples=0)  # fmt: skip
    seqs, prefix = token_sequences(dataset, tokenizer), window_prefix(dataset, tokenizer)
    expected = cut_windows(seqs, 96 + 16, 50, prefix, stride=24)
    [block] = tasks["continuation"]
    assert torch.equal(torch.tensor(block["windows"]), expected) and len(block["windows"]) > 1
    assert tasks["protocol"]["stride"] == 24 and tasks["retrieval"] == []
    with pytest.raises(ValueError, match="twice"):
        long_peer.build_tasks(tokenizer, dataset, lengths=[96], continuation=16, stride=8, samples=0)


def test_matched_press_ratio_keeps_the_lrkv_bytes(long_peer):
    assert long_peer.matched_press_ratio(0.5) == 0.5
    # 3-bit latents at half width with fp16 scale and zero-point per token and group of 96 latents:
    fraction = 0.5 * (3 / 16 + 2 * 16 / (16 * 96))
    assert math.isclose(1 - long_peer.matched_press_ratio(fraction), fraction)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            long_peer.matched_press_ratio(bad)


def test_bytes_of_coded_caches_are_matched_against_float16(long_peer):
    """Quantized, GEAR and TALE-with-bits caches keep codes (their bytes are set against the original's
    float16 cache); dense latents and a float TALE cache follow the model's dtype."""
    from lrkv_core.cache import CACHE_STORAGES

    def form(spec):
        return CACHE_STORAGES.create(spec).to_dict()

    coded = [form({"name": "quantized", "bits": 3}), form("gear"), form({"name": "tale", "low_bits": 2})]
    assert all(long_peer.stores_codes(c) for c in coded)
    assert not any(long_peer.stores_codes(c) for c in (form("dense"), form("tale"), {}, None))


def test_rows_score_by_exact_match_and_tabulate(long_peer, tokenizer, dataset):
    tasks = long_peer.build_tasks(tokenizer, dataset, lengths=[96], continuation=16, windows=2,
                                  depths=[0.0, 1.0], samples=2, seed=0)  # fmt: skip
    keys = [p["key"] for p in tasks["retrieval"]]
    answers = {p["key"]: p["answer"] for p in tasks["retrieval"]}
    outputs = {keys[0]: " " + answers[keys[0]] + ".", keys[1]: answers[keys[1]] + "0", keys[2]: "no"}
    method = {"method": "kvpress knorm", "family": "kvpress", "press": "knorm", "press_ratio": 0.5}
    (row,) = long_peer.retrieval_rows(method, tasks, outputs)
    assert (row["samples"], row["correct"], row["accuracy"]) == (3, 1, 1 / 3)
    cont = long_peer.continuation_row(method | {"kv_fraction": 0.5}, 96, nll_sum=64.0, tokens=32, windows=2)
    assert math.isclose(cont["ppl"], math.exp(2.0))
    original = {"method": "original", "family": "lrkv", "kv_fraction": 1.0}
    rows = [long_peer.continuation_row(original, 96, 32.0, 32, 2), cont, row]
    text = long_peer.table(rows)
    lines = text.splitlines()
    assert lines[0] == "| method | press ratio | KV bytes | ppl 96 | passkey 96 |"
    assert lines[2].startswith("| original |  | 1.0000 | 2.718 |")
    assert lines[3] == f"| kvpress knorm | 0.5000 | 0.5000 | {math.exp(2.0):.3f} | 1/3 |"


def test_ruler_style_tasks_are_written_scored_and_tabulated_per_task(long_peer, tokenizer, dataset):
    """``--retrieval``: every task's prompts (the asked value once in the context, the question their last
    ``question_len`` tokens, as the peer's runner splits them), one row per task and length, a column each."""
    tasks = long_peer.build_tasks(tokenizer, dataset, lengths=[256], continuation=16, windows=0,
                                  depths=[0.5], samples=2, seed=1, retrieval=list(TASKS))  # fmt: skip
    prompts = tasks["retrieval"]
    assert tasks["continuation"] == []  # a retrieval-only file
    assert [p["task"] for p in prompts] == [t for t in TASKS for _ in range(2)]
    assert len({p["key"] for p in prompts}) == len(prompts) and tasks["protocol"]["tasks"] == list(TASKS)
    for p in prompts:
        context = tokenizer.decode(p["input_ids"][: -p["question_len"]])
        question = tokenizer.decode(p["input_ids"][-p["question_len"] :])
        assert question.startswith("\n\n") and question.rstrip().endswith(("is", "they are:"))
        value = p["answer"].split()[0] if p["task"] != "variables" else question.split("value ")[1][:5]
        assert context.count(value) == 1
    outputs = {p["key"]: " " + p["answer"] for p in prompts if p["index"] == 0}  # one of each task right
    rows = long_peer.retrieval_rows({"method": "m", "family": "lrkv", "kv_fraction": 1.0}, tasks, outputs)
    assert sorted((r["kind"], r["correct"], r["samples"]) for r in rows) == sorted((t, 1, 1) for t in TASKS)
    press = {"method": "kvpress snapkv", "family": "kvpress", "press": "snapkv", "press_ratio": 0.7}
    rows += long_peer.retrieval_rows(press, tasks, {p["key"]: " 0" for p in prompts})
    head, _, first, second = long_peer.table(rows).splitlines()
    columns = "passkey 256 | needle 256 | multikey 256 | variables 256"
    assert head == f"| method | press ratio | KV bytes | {columns} |"
    assert first == "| m |  | 1.0000 | 1/1 | 1/1 | 1/1 | 1/1 |"  # the prompts given an output
    # a press without continuation rows holds 1 − its ratio
    assert second == "| kvpress snapkv | 0.7000 | 0.3000 | 0/2 | 0/2 | 0/2 | 0/2 |"
    with pytest.raises(ValueError, match="unknown retrieval tasks"):
        long_peer.build_tasks(tokenizer, dataset, lengths=[128], retrieval=["passkey", "haystack"])
    old = {"continuation": [], "passkey": prompts[:2]}  # passkey prompts under their own key
    assert long_peer.retrieval_prompts(old) == prompts[:2]


def test_lrkv_rows_run_through_another_cache_storage_with_its_bytes(
    long_peer, tokenizer, dataset, compress, tmp_path
):
    """``lrkv --cache``: a compressed model's rows through another storage (TALE's recency levels here), its
    bytes measured from that cache and its recipe form recorded with the rows."""
    from lrkv_core import save_compressed
    from tests.support.models import tiny_model

    model = tiny_model("llama", 2, vocab_size=len(tokenizer), max_position_embeddings=256)
    compressed, _ = compress(model, 2, ratio=1.0)
    save_compressed(compressed, tmp_path / "m", tokenizer=tokenizer)
    tasks = long_peer.build_tasks(tokenizer, dataset, lengths=[96], continuation=16, windows=2,
                                  depths=[0.5], samples=1)  # fmt: skip
    dense = long_peer.run_lrkv("dense", str(tmp_path / "m"), tasks)
    tale = long_peer.run_lrkv("tale", str(tmp_path / "m"), tasks, {"name": "tale", "low": 0.5})
    (dense_row, *_), (tale_row, *_) = dense, tale
    assert dense_row["cache"]["name"] == "dense" and tale_row["cache"]["name"] == "tale"
    assert tale_row["cache"]["low"] == 0.5 and tale_row["cache"]["rule"] == "recency"
    assert 0.5 < tale_row["kv_fraction"] < dense_row["kv_fraction"] - 0.3  # most tokens keep half the latents
    assert math.isfinite(tale_row["ppl"]) and tale_row["ppl"] != dense_row["ppl"]
    # after a window of 112 tokens (not the prefill of 96 the match is made on) the cache holds its own bytes
    held = tale_row["kv_bytes_held_per_token"] / dense_row["kv_bytes_held_per_token"]
    assert 0.5 < held < 0.9 and dense_row["kv_bytes_held_per_token"] == dense_row["kv_bytes_per_token"]
