"""Tests for lrkv_demo.builtin: corpus walking, the split, a 30-step build, atomic caching."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lrkv_demo import builtin
from lrkv_demo.builtin import (
    BUILTIN_MODELS,
    DEFAULT_BUILTIN,
    DOC_SEPARATOR,
    collect_stdlib_docstrings,
    ensure_builtin_model,
    evaluate_nll,
    split_corpus,
)

STEPS = 30


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[tuple[int, int, float]]]:
    """(home, model dir, progress calls) of one 30-step build shared by the read-only tests below."""
    home = tmp_path_factory.mktemp("lrkv_home")
    calls: list[tuple[int, int, float]] = []
    path = ensure_builtin_model(home=home, steps=STEPS, progress=lambda *call: calls.append(call))
    return home, path, calls


def _info(path: Path) -> dict:
    return json.loads((path / "build_info.json").read_text(encoding="utf-8"))


def test_collect_docstrings_parses_without_importing(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "a.py").write_text(
        f'"""Module a."""\nopen({str(marker)!r}, "w")\n\nclass K:\n    """Class K.\n\n    More."""\n\n'
        '    def f(self):\n        """Method f."""\n\n\ndef g():\n    """Function g."""\n'
    )
    (tmp_path / "pkg" / "b.py").write_text('"""Module a."""\n\nasync def h():\n    """  Coroutine h.  """\n')
    (tmp_path / "bad.py").write_text('"""Never seen."""\ndef (:\n')
    (tmp_path / "test" / "t.py").write_text('"""Test doc."""\n')
    (tmp_path / "site-packages" / "s.py").write_text('"""Third party."""\n')
    text = collect_stdlib_docstrings(tmp_path)
    # sorted paths (a.py < bad.py < pkg/b.py), source order inside a file, duplicates and bad files dropped
    expected = ["Module a.", "Class K.\n\nMore.", "Method f.", "Function g.", "Coroutine h."]
    assert text == DOC_SEPARATOR.join(expected)
    assert not marker.exists()
    capped = collect_stdlib_docstrings(tmp_path, max_chars=len("Module a.") + 5)
    assert capped == "Module a."


def test_split_corpus_is_two_disjoint_slices() -> None:
    text = DOC_SEPARATOR.join(f"doc {i} " * (i % 7 + 1) for i in range(200))
    train, valid = split_corpus(text, 0.05)
    assert train + DOC_SEPARATOR + valid == text
    longest = max(len(d) for d in text.split(DOC_SEPARATOR))  # the cut snaps back to a docstring boundary
    assert 0.05 * len(text) <= len(valid) + len(DOC_SEPARATOR) <= 0.05 * len(text) + longest + 1
    assert valid.startswith("doc ")


def test_lr_schedule_warms_up_then_decays_to_floor() -> None:
    factors = [builtin._lr_factor(s, 10, 100, 0.1) for s in range(100)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))
    assert builtin._lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1)


def test_build_loads_offline_and_tokenizer_roundtrips(built: tuple) -> None:
    _, path, _ = built
    spec = BUILTIN_MODELS[DEFAULT_BUILTIN]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert (cfg.model_type, cfg.num_attention_heads, cfg.num_key_value_heads) == ("llama", 4, 2)
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (0, 1, spec.vocab_size)
    assert (path / "generation_config.json").is_file()
    line = next(ln for ln in (path / "valid.txt").read_text(encoding="utf-8").splitlines() if len(ln) > 20)
    ids = tok(line)["input_ids"]
    assert 0 not in ids and 1 not in ids  # nothing added on encode
    assert tok.decode(ids) == line
    # the saved weights are the ones the build measured
    valid_ids = torch.tensor(tok((path / "valid.txt").read_text(encoding="utf-8"))["input_ids"])
    nll = evaluate_nll(model.eval(), valid_ids, spec.seq_len)
    assert nll == pytest.approx(_info(path)["valid_nll"], abs=1e-4)


def test_train_and_valid_are_the_corpus_split(built: tuple) -> None:
    _, path, _ = built
    train = (path / "train.txt").read_text(encoding="utf-8")
    valid = (path / "valid.txt").read_text(encoding="utf-8")
    corpus = collect_stdlib_docstrings(max_chars=BUILTIN_MODELS[DEFAULT_BUILTIN].max_corpus_chars)
    assert train + DOC_SEPARATOR + valid == corpus
    info = _info(path)
    sizes = (info["corpus_chars"], info["train_chars"], info["valid_chars"])
    assert sizes == (len(corpus), len(train), len(valid))
    assert valid not in train


def test_training_lowers_the_loss_and_card_reports_measurements(built: tuple) -> None:
    _, path, calls = built
    info = _info(path)
    assert info["steps"] == STEPS and len(info["loss_curve"]) > 0
    assert [c[:2] for c in calls] == [(s, STEPS) for s in range(1, STEPS + 1)]
    assert info["train_loss_last"] < info["train_loss_first"] - 0.3
    assert info["valid_nll"] < math.log(BUILTIN_MODELS[DEFAULT_BUILTIN].vocab_size)
    assert info["valid_ppl"] == pytest.approx(math.exp(info["valid_nll"]))
    card = (path / "README.md").read_text(encoding="utf-8")
    assert f"{info['valid_ppl']:.2f}" in card and f"{info['steps']} AdamW steps" in card
    assert f"{info['corpus_chars']:,}" in card and f"{info['seconds']:.1f} s" in card


def test_second_call_returns_cache_without_building(built: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    home, path, _ = built
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(builtin, "build_builtin_model", fail)
    t0 = time.perf_counter()
    assert ensure_builtin_model(home=home) == path
    assert time.perf_counter() - t0 < 1.0
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_unknown_name_lists_available(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pydoc-llama"):
        ensure_builtin_model("gpt-17", home=tmp_path)
    assert not (tmp_path / "builtin").exists()


def test_build_failing_midway_leaves_no_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = DOC_SEPARATOR.join(f"Return item {i} of the list, or None." for i in range(400))
    monkeypatch.setattr(builtin, "collect_stdlib_docstrings", lambda max_chars: corpus)

    def boom(*args, **kwargs):
        raise RuntimeError("killed during training")

    monkeypatch.setattr(builtin, "_train_model", boom)
    with pytest.raises(RuntimeError, match="killed during training"):
        ensure_builtin_model(home=tmp_path, steps=5)
    assert list((tmp_path / "builtin").iterdir()) == []


def _fake_build(out_dir: Path, **kwargs) -> Path:
    (out_dir / "build_info.json").write_text(json.dumps({"who": "me"}))
    return out_dir


def test_build_finished_elsewhere_meanwhile_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "builtin" / DEFAULT_BUILTIN

    def racing_build(out_dir: Path, **kwargs) -> Path:
        target.mkdir()
        (target / "build_info.json").write_text(json.dumps({"who": "other"}))
        (target / "config.json").write_text("{}")
        return _fake_build(out_dir, **kwargs)

    monkeypatch.setattr(builtin, "build_builtin_model", racing_build)
    assert ensure_builtin_model(home=tmp_path) == target
    assert _info(target) == {"who": "other"}
    assert sorted(p.name for p in target.parent.iterdir()) == [DEFAULT_BUILTIN]


def test_stale_partial_builds_are_swept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parent = tmp_path / "builtin"
    old, fresh = parent / f"{DEFAULT_BUILTIN}.partial-1-dead", parent / f"{DEFAULT_BUILTIN}.partial-2-busy"
    for d in (old, fresh):
        d.mkdir(parents=True)
        (d / "train.txt").write_text("half")
    os.utime(old, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    monkeypatch.setattr(builtin, "build_builtin_model", _fake_build)
    assert _info(ensure_builtin_model(home=tmp_path)) == {"who": "me"}
    assert sorted(p.name for p in parent.iterdir()) == sorted([DEFAULT_BUILTIN, fresh.name])
