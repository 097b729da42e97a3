"""Dataset specs, token streams, calibration extraction and evaluation windows (slices: test_heldout.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from datasets import Dataset

from lrkv_core.data import datasets, heldout
from lrkv_core.data.datasets import (
    DatasetSpec,
    calibration_windows,
    check_dataset,
    eval_windows,
    extract_calibration,
    load_text,
    parse_dataset_spec,
    read_token_rows,
    resolve_spec,
    text_prefix,
    token_sequences,
    window_prefix,
)
from lrkv_core.data.refs import DATASET_SCHEMES, DatasetScheme, register_dataset_scheme
from lrkv_core.data.slices import PercentSlice
from tests.support.models import with_bos

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
SHAKESPEARE = SHARED / "models" / "shakespeare-llama"
VALID_TXT = SHARED / "data" / "shakespeare" / "valid.txt"
STORIES_CALIB = SHARED / "data" / "stories260k" / "calib.parquet"
STORIES_VALID = SHARED / "data" / "stories260k" / "valid.parquet"


def _need(*paths: Path) -> None:
    for p in paths:
        if not p.exists():
            pytest.skip(f"shared asset {p} is absent")


@pytest.fixture(scope="module")
def tok():
    _need(SHAKESPEARE, VALID_TXT)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHAKESPEARE)


def _write_rows(path: Path, rows: list[list[int]]) -> Path:
    pq.write_table(pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32()))}), path)
    return path


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("hf:wikitext:wikitext-2-raw-v1:test", DatasetSpec("hf", "wikitext", "wikitext-2-raw-v1", "test")),
        ("hf:wikitext:wikitext-2-raw-v1", DatasetSpec("hf", "wikitext", "wikitext-2-raw-v1", "train")),
        ("hf:org/name", DatasetSpec("hf", "org/name", None, "train")),
        ("hf:org/name::validation", DatasetSpec("hf", "org/name", None, "validation")),
        ("text:/a/b:c.txt", DatasetSpec("text", "/a/b:c.txt")),
        ("parquet:rel/x.parquet", DatasetSpec("parquet", "rel/x.parquet")),
        ("text:/a/b:c.txt[:90%]", DatasetSpec("text", "/a/b:c.txt", part=PercentSlice(0, 90))),
        ("parquet:x.parquet[90%:]", DatasetSpec("parquet", "x.parquet", part=PercentSlice(90, 100))),
        ("hf:org/n::valid[10%:50%]", DatasetSpec("hf", "org/n", None, "valid", PercentSlice(10, 50))),
        ("hf:org/n[0%:100%]", DatasetSpec("hf", "org/n", None, "train")),  # the whole source: no slice
        ("text:odd[1].txt", DatasetSpec("text", "odd[1].txt")),  # brackets inside a name are a name
        ("text:x[:90%][:]", DatasetSpec("text", "x[:90%]")),  # [:] names a file that ends like a slice
    ],
)
def test_parse_good_specs_round_trip(spec: str, expected: DatasetSpec) -> None:
    parsed = parse_dataset_spec(spec)
    assert parsed == expected
    assert parse_dataset_spec(str(parsed)) == parsed
    assert parse_dataset_spec(parsed) is parsed


@pytest.mark.parametrize(
    "spec",
    [
        "", "wikitext", "foo:bar", "hf:", "hf:a:b:c:d", "text:", "text:[:90%]", "Bad_Scheme:x",
        "text:x[:150%]", "text:x[50%:50%]", "text:x[90%:10%]", "text:x[:90]", "hf:a[%:]", "parquet:x[a:b]",
    ],
)  # fmt: skip
def test_parse_bad_specs_list_accepted_forms(spec: str) -> None:
    with pytest.raises(ValueError, match=r"accepted forms: hf:NAME\[:CONFIG\[:SPLIT\]\], text:PATH"):
        parse_dataset_spec(spec)


def test_missing_files_name_the_path(tmp_path: Path, tok) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        token_sequences(f"text:{missing}", tok)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        token_sequences(f"parquet:{tmp_path / 'nope.parquet'}", None)


@pytest.mark.parametrize("chunk", [1 << 22, 7])  # one read, and a bad byte found across reads
def test_text_that_is_not_utf8_is_one_line_naming_the_file_and_byte(tmp_path: Path, tok, chunk) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("a café, ".encode() + "déjà vu".encode("latin-1"))  # "é" in latin-1 at offset 10
    expected = f"{path} is not UTF-8 text (byte 0xe9 at offset 10)"
    assert heldout.utf8_problem(path, chunk=chunk).startswith(expected)
    for check in (
        lambda: check_dataset(f"text:{path}", has_tokenizer=True),  # before any work
        lambda: token_sequences(f"text:{path}[:50%]", tok),  # and wherever it is read
    ):
        with pytest.raises(ValueError) as err:
            check()
        assert expected in str(err.value) and "\n" not in str(err.value)
    path.write_bytes("déjà vu".encode())
    assert heldout.utf8_problem(path, chunk=chunk) is None


def test_text_without_tokenizer_is_refused() -> None:
    _need(VALID_TXT)
    with pytest.raises(ValueError, match="this model has no tokenizer; use a parquet: dataset of input_ids"):
        token_sequences(f"text:{VALID_TXT}", None)


def test_text_is_one_stream_without_special_tokens(tok) -> None:
    (stream,) = token_sequences(f"text:{VALID_TXT}", tok)
    assert stream.dtype == torch.long and stream.numel() == 24524  # README of shakespeare-llama
    assert tok.bos_token_id not in stream.tolist()
    assert tok.decode(stream.tolist()) == VALID_TXT.read_text()  # newlines kept, whole file one document


def test_text_slices_cut_the_token_stream(tok) -> None:
    (whole,) = token_sequences(f"text:{VALID_TXT}", tok)
    (head,) = token_sequences(f"text:{VALID_TXT}[:90%]", tok)
    (tail,) = token_sequences(f"text:{VALID_TXT}[90%:]", tok)
    assert head.numel() == round(0.9 * 24524) and torch.equal(torch.cat([head, tail]), whole)
    with pytest.raises(ValueError, match="a slice cuts the token stream"):
        load_text(f"text:{VALID_TXT}[:90%]")


def test_hub_rows_are_joined_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return Dataset.from_dict({"text": [" = Title =\n", "\n", "Body line .\n"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_text("hf:wikitext:wikitext-2-raw-v1:test") == " = Title =\n\nBody line .\n"
    assert calls == [(("wikitext", "wikitext-2-raw-v1"), {"split": "test"})]


def test_an_unreachable_hub_dataset_says_to_give_a_local_one(tmp_path: Path) -> None:
    """The Hub really unreachable (offline mode, an empty cache): the error names the local forms."""
    code = "from lrkv_core.data.datasets import load_text; load_text('hf:wikitext:wikitext-2-raw-v1:train')"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and last.startswith("ConnectionError: Couldn't reach 'wikitext'"), res.stderr
    assert "without network, give a local dataset (text:PATH or parquet:PATH" in last


@pytest.fixture
def toy_scheme(tmp_path: Path):
    """A dataset scheme ``toy:SPLIT`` registered from this test module: ``text:<tmp>/<split>.txt``."""
    (tmp_path / "valid.txt").write_text("ab\ncd\n")
    calls: list[str] = []

    def resolve(rest: str) -> DatasetSpec:
        calls.append(rest)
        return DatasetSpec("text", str(tmp_path / f"{rest}.txt"))

    register_dataset_scheme("toy", DatasetScheme(form="toy:SPLIT", resolve=resolve))
    yield tmp_path, calls
    DATASET_SCHEMES.unregister("toy")


def test_plugin_scheme_resolves_to_a_core_spec(toy_scheme) -> None:
    root, calls = toy_scheme
    spec = parse_dataset_spec("toy:valid[:50%]")
    assert spec == DatasetSpec("toy", "valid", part=PercentSlice(0, 50))
    assert calls == []  # parsing resolves nothing
    assert resolve_spec(spec) == DatasetSpec("text", str(root / "valid.txt"), part=PercentSlice(0, 50))
    assert resolve_spec("toy:valid") == DatasetSpec("text", str(root / "valid.txt"))
    assert load_text("toy:valid") == "ab\ncd\n" and calls == ["valid"] * 3
    with pytest.raises(ValueError, match="accepted forms: .*toy:SPLIT"):
        parse_dataset_spec("nosuch:x")


def test_extract_calibration_is_deterministic_per_seed(tmp_path: Path, tok) -> None:
    spec = f"text:{VALID_TXT}"
    a = extract_calibration(spec, tok, n_samples=6, seq_len=32, seed=0, out_path=tmp_path / "a.parquet")
    b = extract_calibration(spec, tok, n_samples=6, seq_len=32, seed=0, out_path=tmp_path / "b.parquet")
    c = extract_calibration(spec, tok, n_samples=6, seq_len=32, seed=1, out_path=tmp_path / "c.parquet")
    rows_a, rows_b, rows_c = (read_token_rows(r["path"]) for r in (a, b, c))
    assert rows_a.shape == (6, 32) and torch.equal(rows_a, rows_b)
    assert torch.equal(rows_a, calibration_windows(spec, tok, n_samples=6, seq_len=32, seed=0))  # in memory
    assert a["fingerprint"] == b["fingerprint"] != c["fingerprint"]
    assert not torch.equal(rows_a, rows_c)
    assert {k: a[k] for k in ("n_samples", "seq_len", "seed", "tokens", "source")} == {
        "n_samples": 6, "seq_len": 32, "seed": 0, "tokens": 192, "source": spec,
    }  # fmt: skip
    assert pq.read_schema(a["path"]).field("input_ids").type == pa.list_(pa.int32())
    (stream,) = token_sequences(spec, tok)
    all_windows = stream.unfold(0, 32, 1)  # (N_tokens - 31, 32): every window of the stream
    for row in rows_a:
        assert (all_windows == row).all(-1).any(), "a calibration row is not a window of the stream"


def test_parquet_calibration_keeps_position_zero(tmp_path: Path) -> None:
    _need(STORIES_CALIB)
    src = token_sequences(f"parquet:{STORIES_CALIB}", None)
    assert len(src) == 512 and all(r[0] == 1 for r in src)  # BOS = 1
    out = tmp_path / "calib.parquet"
    info = extract_calibration(
        f"parquet:{STORIES_CALIB}", None, n_samples=16, seq_len=100, seed=3, out_path=out
    )
    rows = read_token_rows(info["path"])
    assert rows.shape == (16, 100) and (rows[:, 0] == 1).all()
    prefixes = torch.stack([r[:100] for r in src])  # (512, 100)
    matches = [int((prefixes == row).all(-1).nonzero()[0]) for row in rows]
    assert len(set(matches)) == 16  # distinct source rows, each taken from its start


def test_short_rows_are_skipped_and_too_little_data_is_reported(tmp_path: Path) -> None:
    src = _write_rows(
        tmp_path / "rows.parquet", [[1, 5, 6], [1] + list(range(10, 20)), [1, 7], [1] * 12, [1] * 10]
    )
    info = extract_calibration(
        f"parquet:{src}", None, n_samples=3, seq_len=10, seed=0, out_path=tmp_path / "o"
    )
    firsts = sorted(read_token_rows(info["path"])[:, 1].tolist())
    assert firsts == [1, 1, 10]  # exactly the three rows with >= 10 tokens
    with pytest.raises(ValueError, match=r"5 rows, 3 of them with >= 10 tokens; n_samples=4 needs 4"):
        extract_calibration(f"parquet:{src}", None, n_samples=4, seq_len=10, seed=0, out_path=tmp_path / "p")


def test_too_little_text_leaves_no_file(tmp_path: Path, tok) -> None:
    out = tmp_path / "sub" / "calib.parquet"
    with pytest.raises(ValueError, match=r"24524 tokens.*need at least 24779"):
        extract_calibration(f"text:{VALID_TXT}", tok, n_samples=24524, seq_len=256, seed=0, out_path=out)
    assert not out.exists()


def test_failed_write_leaves_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _write_rows(tmp_path / "src.parquet", [[1, 2, 3, 4]] * 4)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "calib.parquet"
    out.write_bytes(b"previous run")
    real_write = pq.write_table

    def failing_write(table, where, **kwargs):
        real_write(table.slice(0, 1), where, **kwargs)  # a partial file, then the crash
        raise OSError("disk full")

    monkeypatch.setattr(datasets.pq, "write_table", failing_write)
    with pytest.raises(OSError, match="disk full"):
        extract_calibration(f"parquet:{src}", None, n_samples=2, seq_len=4, seed=0, out_path=out)
    assert sorted(p.name for p in out_dir.iterdir()) == ["calib.parquet"]
    assert out.read_bytes() == b"previous run"


def test_eval_windows_text_are_consecutive_from_the_start(tok) -> None:
    windows = eval_windows(f"text:{VALID_TXT}", tok, seq_len=256)
    (stream,) = token_sequences(f"text:{VALID_TXT}", tok)
    assert windows.shape == (95, 256)  # 24524 // 256, tail dropped
    assert torch.equal(windows.flatten(), stream[: 95 * 256])
    assert torch.equal(eval_windows(f"text:{VALID_TXT}", tok, seq_len=256, max_windows=4), windows[:4])


def test_eval_windows_parquet_rows_start_at_position_zero(tmp_path: Path) -> None:
    rows = [list(range(1, 301)), list(range(1000, 1100)), list(range(2000, 2128))]
    src = _write_rows(tmp_path / "rows.parquet", rows)
    windows = eval_windows(f"parquet:{src}", None, seq_len=128)
    expected = torch.tensor([rows[0][:128], rows[0][128:256], rows[2]])  # row 1 too short, tails dropped
    assert torch.equal(windows, expected)
    with pytest.raises(ValueError, match="too little data"):
        eval_windows(f"parquet:{src}", None, seq_len=400)


def test_eval_windows_stories_valid() -> None:
    _need(STORIES_VALID)
    windows = eval_windows(f"parquet:{STORIES_VALID}", None, seq_len=256)
    assert windows.shape == (128, 256) and (windows[:, 0] == 1).all()
    assert np.array_equal(
        windows[:2].numpy(), np.array(pq.read_table(STORIES_VALID)["input_ids"][:2].to_pylist())
    )


@pytest.fixture(scope="module")
def bos_tok(tok):
    return with_bos(tok)


def test_text_prefix_is_what_the_tokenizer_puts_before_a_text(tok, bos_tok) -> None:
    assert text_prefix(bos_tok) == [bos_tok.bos_token_id] and text_prefix(tok) == [] == text_prefix(None)
    assert window_prefix(f"text:{VALID_TXT}", bos_tok) == [bos_tok.bos_token_id]
    assert window_prefix("parquet:/nowhere/rows.parquet", bos_tok) == []  # rows carry their own BOS


def test_text_windows_start_with_bos_where_the_tokenizer_adds_one(tmp_path: Path, tok, bos_tok) -> None:
    spec = f"text:{VALID_TXT}[:50%]"
    (stream,) = token_sequences(spec, bos_tok)  # the stream itself has no BOS
    assert torch.equal(stream, token_sequences(spec, tok)[0]) and bos_tok.bos_token_id not in stream[:1]
    bos = bos_tok.bos_token_id
    windows = eval_windows(spec, bos_tok, seq_len=64)
    assert windows.shape == (stream.numel() // 63, 64) and (windows[:, 0] == bos).all()
    assert torch.equal(windows[:, 1:].flatten(), stream[: windows.shape[0] * 63])  # consecutive pieces of 63
    rows = calibration_windows(spec, bos_tok, n_samples=5, seq_len=64, seed=0)
    assert rows.shape == (5, 64) and (rows[:, 0] == bos).all()
    pieces = stream.unfold(0, 63, 1)  # every 63-token piece of the stream
    assert all((pieces == row[1:]).all(-1).any() for row in rows)
    out = extract_calibration(spec, bos_tok, n_samples=5, seq_len=64, seed=0, out_path=tmp_path / "c.parquet")
    assert torch.equal(read_token_rows(out["path"]), rows)
    assert not torch.equal(rows, calibration_windows(spec, tok, n_samples=5, seq_len=64, seed=0))
    with pytest.raises(ValueError, match="no room for text after 1 leading token"):
        eval_windows(spec, bos_tok, seq_len=1)
    with pytest.raises(ValueError, match="no room for text after 1 leading token"):
        calibration_windows(spec, bos_tok, n_samples=1, seq_len=1, seed=0)
