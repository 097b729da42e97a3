"""The compressed model format: save_compressed → load_compressed, atomic and pickle-free."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import lrkv_core
from lrkv_core import load_compressed, load_model, save_compressed
from lrkv_core.cache import LatentCache
from lrkv_core.format import FORMAT_VERSION, LrkvFormat
from lrkv_core.model import io as lrkv_io
from lrkv_core.model.adapters import get_adapter
from lrkv_core.model.attention import LatentAttention
from lrkv_core.model.hf_quantizer import LrkvConfig
from lrkv_core.model.io import ModelFileError

pytestmark = pytest.mark.usefixtures("one_thread")

EXPECTED_FILES = {"config.json", "generation_config.json", "model.safetensors", "README.md"}


def _ids(batch: int = 2, length: int = 10) -> torch.Tensor:
    return torch.randint(3, 61, (batch, length), generator=torch.Generator().manual_seed(3))


def _generate(model, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.fixture
def compressed(make_tiny, compress):
    """A GQA Llama (Hkv=2) compressed at ratio 0.5 with groups of 2 KV heads, and its plan."""
    return compress(make_tiny("llama", 2), 2, ratio=0.5, rank_multiple=8)


def _siblings(path: Path) -> set[str]:
    return {p.name for p in path.parent.iterdir()}


def test_roundtrip_is_bit_exact(compressed, tmp_path) -> None:
    model, plan = compressed
    out = save_compressed(model, tmp_path / "m")
    assert out == tmp_path / "m"
    loaded = load_compressed(out)
    assert not loaded.training and loaded.dtype == torch.float32
    assert isinstance(get_adapter(loaded.config).attention(loaded, 0), LatentAttention)
    ids = _ids()
    with torch.no_grad():
        ref, got = model(ids).logits, loaded(ids, use_cache=True)
    assert torch.equal(got.logits, ref)
    assert isinstance(got.past_key_values, LatentCache)
    assert torch.equal(_generate(loaded, ids), _generate(model, ids))
    assert set(model.state_dict()) == set(loaded.state_dict())


def test_config_has_the_lrkv_section_and_no_pickle_is_written(compressed, tmp_path) -> None:
    model, plan = compressed
    out = save_compressed(model, tmp_path / "m", card="# my card\n")
    assert {p.name for p in out.iterdir()} == EXPECTED_FILES  # no .bin / .pt / .pkl
    section = json.loads((out / "config.json").read_text())["lrkv"]
    assert section["group_size"] == 2
    assert section["ranks_k"] == plan.ranks["k"] == [[8], [8]] and section["ranks_v"] == plan.ranks["v"]
    assert section["lrkv_version"] == lrkv_core.__version__ and section["format_version"] == FORMAT_VERSION
    assert section["achieved_ratio"] == plan.achieved_ratio == 0.5
    assert section["target_ratio"] == 0.5
    assert section["decomposition"] == {"name": "whitened", "values": "attention", "keys": "fisher"}
    assert section["allocator"] == {"name": "uniform"} and section["cache"] == {"name": "dense"}
    assert (out / "README.md").read_text() == "# my card\n"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.k_down.weight" in names
    assert not any(n.endswith(("k_proj.weight", "v_proj.weight")) for n in names)


def test_default_card_describes_the_compression(compressed, tmp_path) -> None:
    out = save_compressed(compressed[0], tmp_path / "m")
    card = (out / "README.md").read_text()
    assert "whitened decomposition per group of 2 KV head(s)" in card and "0.5000 of the original" in card
    assert "| 0 | [8] | [8] |" in card and "| 1 | [8] | [8] |" in card  # the ranks table
    assert "then RoPE at the cached positions" in card
    assert "load_compressed" in card and "from_pretrained" in card and "Source model" not in card
    fmt = LrkvFormat.of(compressed[0].config)
    assert "Source model: `org/name`" in lrkv_io.model_card(fmt, "org/name")


def test_refuses_to_overwrite_a_foreign_directory(compressed, tmp_path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an lrkv model directory"):
        save_compressed(compressed[0], target)
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    assert _siblings(target) == {"m"}  # no temp dir left behind


def test_empty_directory_is_fine(compressed, tmp_path) -> None:
    (tmp_path / "m").mkdir()
    save_compressed(compressed[0], tmp_path / "m")
    assert {p.name for p in (tmp_path / "m").iterdir()} == EXPECTED_FILES


def test_resaving_over_an_lrkv_directory_replaces_it(make_tiny, compress, compressed, tmp_path) -> None:
    target = tmp_path / "m"
    save_compressed(compressed[0], target)
    full, _ = compress(make_tiny("llama", 2, seed=1), 1)  # another model, other ranks
    save_compressed(full, target)
    assert _siblings(target) == {"m"}  # neither the temp dir nor the old copy remain
    loaded = load_compressed(target)
    assert loaded.config.lrkv["ranks_k"] == [[8, 8], [8, 8]]
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, full(ids).logits)


def test_failure_during_save_leaves_nothing_behind(compressed, monkeypatch, tmp_path) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(lrkv_io, "save_model", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        save_compressed(compressed[0], tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_failure_while_replacing_keeps_the_old_directory(
    make_tiny, compress, compressed, monkeypatch, tmp_path
) -> None:
    target = tmp_path / "m"
    save_compressed(compressed[0], target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    monkeypatch.setattr(
        lrkv_io, "save_model", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("disk full"))
    )
    with pytest.raises(RuntimeError, match="disk full"):
        save_compressed(compress(make_tiny("llama", 2, seed=1), 1)[0], target)
    assert _siblings(target) == {"m"}
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


def test_uncompressed_model_is_refused(make_tiny, tmp_path) -> None:
    with pytest.raises(ValueError, match="compress it first"):
        save_compressed(make_tiny("llama", 2), tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_load_compressed_rejects_non_lrkv_and_remote_paths(make_tiny, tmp_path) -> None:
    make_tiny("llama", 2).save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="not an lrkv compressed model"):
        load_compressed(tmp_path / "plain")
    with pytest.raises(ValueError, match="unknown model scheme 'runs'"):  # remote refs go to scheme plugins
        load_compressed("runs:/0123/model")


def test_load_model_dispatches_to_load_compressed(compressed, tmp_path) -> None:
    model, _ = compressed
    out = save_compressed(model, tmp_path / "m")
    loaded, tokenizer = load_model(str(out))
    assert tokenizer is None
    assert isinstance(get_adapter(loaded.config).attention(loaded, 1), LatentAttention)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    as64, _ = load_model(str(out), dtype="float64")
    assert as64.dtype == torch.float64
    with torch.no_grad():
        assert (as64(ids).logits - model(ids).logits.double()).abs().max() <= 1e-4


def test_plain_from_pretrained_loads_the_compressed_model(compressed, tmp_path) -> None:
    """config.json's quant_method "lrkv" sends AutoModelForCausalLM.from_pretrained to lrkv's quantizer."""
    model, _ = compressed
    out = save_compressed(model, tmp_path / "m")
    assert json.loads((out / "config.json").read_text())["quantization_config"] == {"quant_method": "lrkv"}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(get_adapter(loaded.config).attention(loaded, 0), LatentAttention)
    ids = _ids()
    with torch.no_grad():
        got = loaded(ids, use_cache=True)
        assert torch.equal(got.logits, model(ids).logits)
    assert isinstance(got.past_key_values, LatentCache)
    assert torch.equal(_generate(loaded, ids), _generate(model, ids))
    # and what it saves with save_pretrained loads back the same way, and strictly
    loaded.save_pretrained(tmp_path / "again")
    again_dir = tmp_path / "again"
    for again in (AutoModelForCausalLM.from_pretrained(again_dir), load_compressed(again_dir)):
        with torch.no_grad():
            assert torch.equal(again(ids).logits, got.logits)


def test_lrkv_quant_method_cannot_compress_on_the_fly(make_tiny, tmp_path) -> None:
    make_tiny("llama", 2).save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="pre-quantized"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "plain", quantization_config=LrkvConfig())


def test_every_saved_file_is_readable_by_the_umask(compressed, tmp_path) -> None:
    """safetensors writes 0600 whatever the umask; an exported model must be as readable as its config."""
    old = os.umask(0o022)
    try:
        out = save_compressed(compressed[0], tmp_path / "m")
    finally:
        os.umask(old)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        name: 0o644 for name in EXPECTED_FILES
    }
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_truncated_weights_are_one_clear_error_naming_the_file(compressed, tmp_path) -> None:
    out = save_compressed(compressed[0], tmp_path / "m")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(
        ModelFileError, match=r"model\.safetensors: unreadable safetensors file \(truncated or"
    ):
        load_compressed(out)
    weights.unlink()
    with pytest.raises(ModelFileError, match=r"model\.safetensors: missing"):
        load_compressed(out)


def test_ranks_that_do_not_match_the_weights_are_one_clear_error(compressed, tmp_path) -> None:
    out = save_compressed(compressed[0], tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    config["lrkv"]["ranks_k"] = [[16], [8]]  # the weights hold rank 8 in layer 0
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=r"model\.safetensors: tensor shapes do not match the ranks"):
        load_compressed(out)


def test_a_newer_format_version_is_refused_and_format_1_is_migrated(compressed, tmp_path) -> None:
    model, plan = compressed
    out = save_compressed(model, tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    newer = {**config, "lrkv": {**config["lrkv"], "format_version": FORMAT_VERSION + 1}}
    (out / "config.json").write_text(json.dumps(newer))
    with pytest.raises(ModelFileError, match=f"lrkv format {FORMAT_VERSION + 1}, newer than the format"):
        load_compressed(out)
    section = config["lrkv"]
    v1 = {  # what lrkv 0.1.0 wrote
        "version": "0.1.0", "method": "palu", "decomposition": "whitened", "group_size": 2,
        "ranks_k": section["ranks_k"], "ranks_v": section["ranks_v"], "rank_multiple": 8,
        "target_ratio": 0.5, "achieved_ratio": 0.5, "allocator": "uniform", "rope": "reconstruct-then-rope",
        "qkv_bias": False, "o_bias": False, "rotation": None, "bits": None,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps({**config, "lrkv": v1}))
    loaded = load_compressed(out)
    fmt = LrkvFormat.of(loaded.config)
    assert fmt.decomposition == {"name": "whitened"} and fmt.cache == {"name": "dense"}
    assert fmt.lrkv_version == "0.1.0" and fmt.format_version == FORMAT_VERSION
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_format_2_is_migrated_to_no_rotation_and_format_3_records_it(compressed, tmp_path) -> None:
    model, _ = compressed
    out = save_compressed(model, tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    assert config["lrkv"]["rotation"] == "none" and config["lrkv"]["rotation_seed"] == 0
    v2 = {k: v for k, v in config["lrkv"].items() if k not in ("rotation", "rotation_seed", "weights_sha256")}
    (out / "config.json").write_text(json.dumps({**config, "lrkv": {**v2, "format_version": 2}}))
    loaded = load_compressed(out)
    fmt = LrkvFormat.of(loaded.config)
    assert fmt.rotation == "none" and fmt.format_version == FORMAT_VERSION == 4
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    bad = {**v2, "format_version": 2, "rotation": "auto"}
    (out / "config.json").write_text(json.dumps({**config, "lrkv": bad}))
    with pytest.raises(ModelFileError, match="format 2 section with a rotation"):
        load_compressed(out)
    (out / "config.json").write_text(json.dumps({**config, "lrkv": {**config["lrkv"], "rotation": "spin"}}))
    with pytest.raises(ModelFileError, match="unknown rotation 'spin'"):
        load_compressed(out)


def test_a_changed_byte_in_the_weights_is_refused_unless_the_check_is_skipped(compressed, tmp_path) -> None:
    """config.json records the sha256 of model.safetensors; load_compressed (and load_model, which ``lrkv
    eval`` uses) refuses weights that no longer match it, even where the file still parses."""
    model, _ = compressed
    out = save_compressed(model, tmp_path / "m")
    weights = out / "model.safetensors"
    section = json.loads((out / "config.json").read_text())["lrkv"]
    assert section["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10  # a byte of the last tensor: the header, and so the file's structure, is intact
    weights.write_bytes(bytes(data))
    for load in (load_compressed, load_model):
        with pytest.raises(ModelFileError, match=r"model\.safetensors: corrupt or modified: its sha256 is"):
            load(out)
    assert not load_compressed(out, verify=False).training  # the opt-out loads it as it is


def test_format_3_without_a_checksum_still_loads(compressed, tmp_path) -> None:
    model, _ = compressed
    out = save_compressed(model, tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    v3 = {k: v for k, v in config["lrkv"].items() if k != "weights_sha256"} | {"format_version": 3}
    (out / "config.json").write_text(json.dumps({**config, "lrkv": v3}))
    loaded = load_compressed(out)
    fmt = LrkvFormat.of(loaded.config)
    assert fmt.weights_sha256 is None and fmt.format_version == FORMAT_VERSION
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    bad = {**v3, "weights_sha256": config["lrkv"]["weights_sha256"]}
    (out / "config.json").write_text(json.dumps({**config, "lrkv": bad}))
    with pytest.raises(ModelFileError, match="format 3 section with weights_sha256"):
        load_compressed(out)
