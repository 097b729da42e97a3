"""Evaluation data that overlaps the calibration data is recognised from the two specs alone."""

import pytest

from lrkv_core.data.heldout import heldout, overlap


@pytest.mark.parametrize(
    "calibration, evaluation, shared",
    [
        ("text:{a}", "text:{a}", "all of the evaluation data"),
        ("text:{a}", "text:{a}[90%:]", "all of the evaluation data"),
        ("text:{a}[:95%]", "text:{a}[90%:]", "5% of the source"),
        ("parquet:{a}[20%:60%]", "parquet:{a}[:30%]", "10% of the source"),
        ("hf:wikitext:wikitext-2-raw-v1:train", "hf:wikitext:wikitext-2-raw-v1:train[90%:]", "all of"),
    ],
)
def test_overlapping_specs_are_named(tmp_path, monkeypatch, calibration, evaluation, shared):
    monkeypatch.chdir(tmp_path)
    a = tmp_path / "a.txt"
    clash = overlap(calibration.format(a=a), evaluation.replace("{a}", "a.txt"))  # relative: the same file
    assert clash is not None and f"({shared}" in clash


@pytest.mark.parametrize(
    "calibration, evaluation",
    [
        ("text:a.txt[:90%]", "text:a.txt[90%:]"),
        ("text:a.txt", "text:b.txt"),
        ("text:a.txt", "parquet:a.txt"),
        ("hf:wikitext:wikitext-2-raw-v1:train", "hf:wikitext:wikitext-2-raw-v1:test"),
    ],
)
def test_disjoint_specs_do_not_overlap(calibration, evaluation):
    assert overlap(calibration, evaluation) is None


def test_the_default_held_out_part_never_overlaps():
    for spec in ("text:a.txt", "text:a.txt[:80%]", "parquet:r.parquet[30%:]"):
        calibration, evaluation, _ = heldout(spec)
        assert overlap(calibration, evaluation) is None
