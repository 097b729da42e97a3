"""``lrkv eval DIR --suite long``: the long-context suite from the CLI, on a saved compressed tiny model with
a tokenizer trained here, next to its original, through another cache storage."""

from __future__ import annotations

import json

from lrkv_core.evaluation.needles import INTRO


def test_eval_suite_long_reports_continuation_and_retrieval_with_its_protocol(
    compress, tmp_path, monkeypatch
):
    from typer.testing import CliRunner

    from lrkv_core import save_compressed
    from lrkv_demo.corpus import train_tokenizer
    from lrkv_flows.cli import app
    from tests.support.models import tiny_model

    monkeypatch.setenv("LRKV_HOME", str(tmp_path / "home"))
    text = " ".join(
        f"The {w} walked by the river at night and saw the {w}." for w in ("king", "queen", "old") * 60
    )
    (tmp_path / "data.txt").write_text(text + "\n")
    tokenizer = train_tokenizer(text + INTRO * 5, 400, 4096)
    model = tiny_model("llama", 2, vocab_size=len(tokenizer), max_position_embeddings=320)
    model.save_pretrained(tmp_path / "orig")
    out = save_compressed(compress(model, 2, 1.0)[0], tmp_path / "m")
    tokenizer.save_pretrained(out)
    report = tmp_path / "long.json"
    args = ["eval", str(out), "--dataset", f"text:{tmp_path / 'data.txt'}", "--suite", "long"]
    args += ["--lengths", "128,1024", "--depths", "0,1", "--samples", "1", "--continuation", "16"]
    args += ["--max-windows", "2", "--needles", "passkey", "--seed", "3", "--base", str(tmp_path / "orig")]
    res = CliRunner().invoke(app, [*args, "--cache", "{name: quantized, bits: 4}", "--json-out", str(report)])
    assert res.exit_code == 0, res.output
    assert "Retrieval `passkey`" in res.output and "| 304 | 2 |" in res.output
    result = json.loads(report.read_text())
    p = result["protocol"]
    assert (
        p["lengths"] == [128, 1024]
        and p["context_lengths"] == [128, 304]
        and p["prompt_lengths"] == [128, 288]
    )
    assert p["cache"]["name"] == "quantized" and p["cache"]["bits"] == 4
    assert p["depths"] == [0.0, 1.0] and p["samples"] == 1 and p["tasks"] == ["passkey"] and p["seed"] == 3
    assert p["dataset"] == f"text:{tmp_path / 'data.txt'}"
    assert [c["windows"] for c in result["continuation"]] == [2, 2]
    assert all(
        c["base_nll"] is not None and c["nll"] != c["base_nll"] for c in result["continuation"]
    )  # 4-bit
    assert set(result["grid"]["passkey"]) == {"0", "1"} and len(result["retrieval"]) == 4

    strided = [*args[:6], "--lengths", "1024", "--samples", "0", "--continuation", "16", "--max-windows", "4"]
    res = CliRunner().invoke(app, [*strided, "--stride", "40", "--json-out", str(report)])
    assert res.exit_code == 0, res.output
    result = json.loads(report.read_text())  # 1024 capped to 304: a stream for 2 windows apart, 4 at 40
    assert result["protocol"]["stride"] == 40 and [c["windows"] for c in result["continuation"]] == [4]
    bad = CliRunner().invoke(app, [*strided, "--stride", "8"])
    assert bad.exit_code == 1
    assert "stride of 8 tokens would score some of the 16" in " ".join(bad.output.split())
    bad = CliRunner().invoke(app, [*args[:6], "--suite", "longer"])
    assert bad.exit_code == 1 and "--suite must be standard or long" in " ".join(bad.output.split())
    bad = CliRunner().invoke(app, [*args[:8], "--depths", "0,1.5", "--samples", "1"])
    assert bad.exit_code == 1 and "depth must be in [0, 1]" in " ".join(bad.output.split())
    bad = CliRunner().invoke(app, [*args[:8], "--needles", "passkey,haystack"])
    assert bad.exit_code == 1 and "needles: unknown retrieval task(s) ['haystack']" in " ".join(
        bad.output.split()
    )
