"""Percent slices of text and Parquet sources, held-out evaluation specs, and check_dataset's early errors."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lrkv_core.data.datasets import (
    DatasetSpec,
    check_dataset,
    eval_windows,
    extract_calibration,
    heldout,
    parse_dataset_spec,
    read_token_rows,
    token_sequences,
)
from lrkv_core.data.refs import DATASET_SCHEMES, DatasetScheme, register_dataset_scheme
from lrkv_core.data.slices import PercentSlice

N_WORDS = 1000


class WordTokenizer:
    """Token id = N for the word ``wN`` (other words have none): every token of the test corpus is distinct,
    so overlaps show. It adds no special tokens."""

    def __call__(self, text: str, add_special_tokens: bool = False, verbose: bool = False) -> dict:
        return {"input_ids": [int(word[1:]) for word in text.split() if word[1:].isdigit()]}


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(f"w{i}" for i in range(N_WORDS)) + "\n")
    return path


def _write_rows(path: Path, rows: list[list[int]], column: str = "input_ids") -> Path:
    pq.write_table(pa.table({column: pa.array(rows, type=pa.list_(pa.int32()))}), path)
    return path


@pytest.fixture
def rows_file(tmp_path: Path) -> Path:
    """Seven rows of 20 distinct tokens each: row i holds i*100 .. i*100+19."""
    return _write_rows(tmp_path / "rows.parquet", [list(range(i * 100, i * 100 + 20)) for i in range(7)])


# ----------------------------------------------------------------------------------------------- slices


@pytest.mark.parametrize("cut", [1, 10, 33, 50, 90, 99])
def test_text_slices_are_disjoint_and_cover_the_stream(corpus: Path, cut: int) -> None:
    tok = WordTokenizer()
    (head,) = token_sequences(f"text:{corpus}[:{cut}%]", tok)
    (tail,) = token_sequences(f"text:{corpus}[{cut}%:]", tok)
    assert head.numel() == cut * N_WORDS // 100
    assert torch.equal(torch.cat([head, tail]), torch.arange(N_WORDS))
    (middle,) = token_sequences(f"text:{corpus}[10%:25%]", tok)
    assert torch.equal(middle, torch.arange(100, 250))


def test_parquet_slices_are_rows_in_file_order(rows_file: Path) -> None:
    head = token_sequences(f"parquet:{rows_file}[:90%]", None)
    tail = token_sequences(f"parquet:{rows_file}[90%:]", None)
    assert (len(head), len(tail)) == (6, 1)  # round(6.3) = 6: the same cut on both sides
    assert [int(r[0]) for r in head + tail] == [i * 100 for i in range(7)]
    windows = eval_windows(f"parquet:{rows_file}[90%:]", None, seq_len=10)
    assert torch.equal(windows, torch.arange(600, 620).view(2, 10))
    with pytest.raises(ValueError, match=r"selects no rows: the file has 7"):
        token_sequences(f"parquet:{rows_file}[:5%]", None)


@pytest.mark.parametrize("spec", ["text:{p}[:90%]", "text:{p}[90%:]", "text:{p}[5%:60%]", "parquet:{p}[:9%]"])
def test_sliced_specs_round_trip(spec: str, tmp_path: Path) -> None:
    parsed = parse_dataset_spec(spec.format(p=tmp_path / "a:b.txt"))
    assert parsed.part is not None and parsed.name == str(tmp_path / "a:b.txt")
    assert str(parsed) == spec.format(p=tmp_path / "a:b.txt")
    assert parse_dataset_spec(str(parsed)) == parsed


def test_bracket_ending_names_round_trip() -> None:
    literal = DatasetSpec("text", "x[:90%]")  # a file whose name looks like a slice
    assert str(literal) == "text:x[:90%][:]" and parse_dataset_spec(str(literal)) == literal
    odd = DatasetSpec("parquet", "runs[a:b]", part=PercentSlice(0, 50))
    assert parse_dataset_spec(str(odd)) == odd


def test_a_real_file_ending_in_a_non_slice_bracket_is_a_path(tmp_path: Path) -> None:
    odd = tmp_path / "data[a:b]"
    odd.write_text("w1 w2\n")
    assert parse_dataset_spec(f"text:{odd}") == DatasetSpec("text", str(odd))
    with pytest.raises(ValueError, match="bad slice"):
        parse_dataset_spec(f"text:{tmp_path / 'missing[a:b]'}")


def test_calibration_never_overlaps_heldout_windows(corpus: Path, tmp_path: Path) -> None:
    tok = WordTokenizer()
    calib, evaluation, _ = heldout(f"text:{corpus}")
    info = extract_calibration(calib, tok, n_samples=40, seq_len=16, seed=0, out_path=tmp_path / "c.parquet")
    drawn = read_token_rows(info["path"])  # (40, 16)
    windows = eval_windows(evaluation, tok, seq_len=16)  # (6, 16): 100 held-out tokens
    assert info["source"] == f"text:{corpus}[:90%]" and windows.shape == (6, 16)
    assert int(drawn.max()) < 900 <= int(windows.min())
    assert not set(drawn.flatten().tolist()) & set(windows.flatten().tolist())


def test_calibration_on_parquet_slice_draws_only_its_rows(rows_file: Path, tmp_path: Path) -> None:
    calib, evaluation, _ = heldout(f"parquet:{rows_file}")
    info = extract_calibration(calib, None, n_samples=6, seq_len=20, seed=1, out_path=tmp_path / "c.parquet")
    firsts = sorted(read_token_rows(info["path"])[:, 0].tolist())
    assert firsts == [0, 100, 200, 300, 400, 500]
    assert eval_windows(evaluation, None, seq_len=20)[:, 0].tolist() == [600]


# ---------------------------------------------------------------------------------------------- heldout


@pytest.mark.parametrize(
    ("spec", "calib", "evaluation", "words"),
    [
        ("text:X", "text:X[:90%]", "text:X[90%:]", "the last 10% of X's tokens"),
        ("parquet:X", "parquet:X[:90%]", "parquet:X[90%:]", "the last 10% of X's rows"),
        ("text:X[:80%]", "text:X[:80%]", "text:X[80%:]", "the last 20% of X's tokens"),
        ("parquet:X[30%:]", "parquet:X[30%:]", "parquet:X[:30%]", "the first 30% of X's rows"),
        ("text:X[10%:50%]", "text:X[10%:50%]", "text:X[50%:]", "the last 50% of X's tokens"),
    ],
)
def test_heldout_slices_one_source(spec: str, calib: str, evaluation: str, words: str) -> None:
    got = heldout(spec)
    assert (str(got[0]), str(got[1])) == (calib, evaluation)
    assert got[2] == f"{words} (not used for calibration)"


def _splits(*names: str):
    calls = []

    def lookup(name: str, config: str | None) -> list[str]:
        calls.append((name, config))
        return list(names)

    return lookup, calls


@pytest.mark.parametrize(
    ("splits", "split", "expected"),
    [
        (("train", "validation", "test"), "train", "hf:w:c:test"),
        (("train", "validation"), "train", "hf:w:c:validation"),
        (("train", "validation", "test"), "test", "hf:w:c:validation"),  # never the calibration split
    ],
)
def test_heldout_hub_prefers_test_then_validation(splits: tuple, split: str, expected: str) -> None:
    lookup, calls = _splits(*splits)
    calib, evaluation, words = heldout(f"hf:w:c:{split}", split_names=lookup)
    assert str(calib) == f"hf:w:c:{split}" and str(evaluation) == expected
    assert words == f"the {evaluation.split} split of hf:w:c (calibration uses {split})"
    assert calls == [("w", "c")]


def test_heldout_hub_without_eval_split_slices_the_split() -> None:
    lookup, _ = _splits("train", "test")
    calib, evaluation, words = heldout("hf:w::test", split_names=lookup)
    assert (str(calib), str(evaluation)) == ("hf:w::test[:90%]", "hf:w::test[90%:]")
    assert words == "the last 10% of hf:w::test's tokens (not used for calibration)"


@pytest.mark.parametrize(("split", "guess"), [("train", "test"), ("test", "validation")])
def test_heldout_hub_offline_assumes_test(split: str, guess: str) -> None:
    def offline(name: str, config: str | None) -> list[str]:
        raise ConnectionError("no network")

    calib, evaluation, words = heldout(f"hf:w:c:{split}", split_names=offline)
    assert str(calib) == f"hf:w:c:{split}" and evaluation.split == guess
    assert words.startswith(f"the {guess} split of hf:w:c (assumed:") and "ConnectionError" in words


@pytest.fixture
def toy_schemes():
    """``toy:SPLIT`` (held-out hook: train -> dev) and ``bare:X`` (no hook) registered from this module."""

    def hook(rest: str) -> tuple[str, str] | None:
        return ("dev", "the dev split of toy") if rest == "train" else None

    toy = DatasetScheme(form="toy:SPLIT", resolve=lambda rest: f"text:/{rest}", heldout=hook)
    register_dataset_scheme("toy", toy)
    register_dataset_scheme("bare", lambda rest: f"text:/{rest}")
    yield
    DATASET_SCHEMES.unregister("toy")
    DATASET_SCHEMES.unregister("bare")


def test_heldout_plugin_hook_then_slices(toy_schemes) -> None:
    calib, evaluation, words = heldout("toy:train")
    assert (str(calib), str(evaluation), words) == ("toy:train", "toy:dev", "the dev split of toy")
    calib, evaluation, words = heldout("toy:dev")
    assert (str(calib), str(evaluation)) == ("toy:dev[:90%]", "toy:dev[90%:]")
    assert words == "the last 10% of toy:dev (not used for calibration)"
    assert str(heldout("bare:x[:70%]")[1]) == "bare:x[70%:]"


# ------------------------------------------------------------------------------------------ check_dataset


def test_check_dataset_accepts_good_specs(corpus: Path, rows_file: Path, monkeypatch) -> None:
    def no_network(*args, **kwargs):
        raise AssertionError("check_dataset touched the hub")

    monkeypatch.setattr("datasets.load_dataset", no_network)
    monkeypatch.setattr("datasets.get_dataset_split_names", no_network)
    for spec in (f"text:{corpus}", f"text:{corpus}[90%:]", "hf:wikitext:wikitext-2-raw-v1:test"):
        check_dataset(spec, has_tokenizer=True)
    for spec in (f"parquet:{rows_file}", f"parquet:{rows_file}[90%:]"):
        check_dataset(spec, has_tokenizer=False)


def test_check_dataset_names_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"dataset file not found: .*nope\.txt"):
        check_dataset(f"text:{tmp_path / 'nope.txt'}[:90%]", has_tokenizer=True)
    with pytest.raises(FileNotFoundError, match=r"nope\.parquet"):
        check_dataset(f"parquet:{tmp_path / 'nope.parquet'}", has_tokenizer=False)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        check_dataset(f"text:{tmp_path}", has_tokenizer=True)
    literal = tmp_path / "x[:90%]"
    literal.write_text("w1\n")
    with pytest.raises(FileNotFoundError, match=r"write text:.*x\[:90%\]\[:\]"):
        check_dataset(f"text:{literal}", has_tokenizer=True)
    check_dataset(f"text:{literal}[:]", has_tokenizer=True)


def test_check_dataset_text_needs_a_tokenizer(corpus: Path) -> None:
    expected = rf"cannot tokenize text:{corpus}: model m/tiny has no tokenizer; use a parquet: dataset of"
    with pytest.raises(ValueError, match=expected):
        check_dataset(f"text:{corpus}", has_tokenizer=False, model="m/tiny")
    with pytest.raises(ValueError, match="cannot tokenize hf:w::train: the model has no tokenizer"):
        check_dataset("hf:w", has_tokenizer=False)


def test_check_dataset_reads_parquet_schema_and_slice(tmp_path: Path, rows_file: Path, corpus: Path) -> None:
    other = _write_rows(tmp_path / "other.parquet", [[1, 2]], column="tokens")
    with pytest.raises(ValueError, match=r"no 'input_ids' column \(columns: \['tokens'\]\)"):
        check_dataset(f"parquet:{other}", has_tokenizer=True)
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        check_dataset(f"parquet:{corpus}", has_tokenizer=True)
    with pytest.raises(ValueError, match="selects no rows: the file has 7"):
        check_dataset(f"parquet:{rows_file}[95%:]", has_tokenizer=True)


@pytest.mark.parametrize("bad", ["[:150%]", "[50%:50%]", "[60%:20%]", "[:90]", "[x%:]"])
def test_check_dataset_rejects_malformed_slices(corpus: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="bad slice"):
        check_dataset(f"text:{corpus}{bad}", has_tokenizer=True)


def test_check_dataset_rejects_empty_text(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        check_dataset(f"text:{empty}", has_tokenizer=True)
