"""Each convert task through ``task.fn()`` on a tiny saved Llama: refs in, refs + metrics out."""

import json
import subprocess
import sys

import pytest
import torch

import lrkv_core
from lrkv_core import load_compressed, load_model
from lrkv_core.system.fingerprint import hash_dir, hash_sources
from lrkv_tasks import convert as t
from lrkv_tasks.keys import code_version
from lrkv_tasks.store.artifacts import ArtifactRef
from lrkv_tasks.store.s3 import StoreIntegrityError
from tests.support.models import tiny_model_dir, token_parquet


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    model_dir = tiny_model_dir(root)
    data = token_parquet(root / "calib.parquet", rows=12, seq_len=32)
    return {"root": root, "model_dir": model_dir, "data": f"parquet:{data}", "store": str(root / "store")}


def test_task_chain_produces_an_exact_full_rank_model(setup):
    store = setup["store"]
    model = t.resolve_model.fn(str(setup["model_dir"]))
    assert model.meta["shape"] == {"L": 2, "d": 32, "H": 4, "Hkv": 2, "D": 8} and len(model.sha256) == 64
    calib = t.extract_calibration.fn(model, setup["data"], 8, 32, 0, store)
    assert calib.uri.startswith(store) and calib.meta["n_samples"] == 8 and calib.kind == "calibration"
    gram = t.collect_statistic.fn(model, calib, {"name": "gram"}, "float32", 4, store)
    assert gram.meta["n_tokens"] == 8 * 32 and gram.meta["statistic"] == {"name": "gram", "n_samples": None}
    fisher = t.collect_statistic.fn(model, calib, {"name": "fisher", "per_row": False}, "float32", 4, store)
    assert fisher.meta["n_samples"] == 2 and fisher.meta["per_row"] is False  # batches of 4
    mixed = t.collect_statistic.fn(model, calib, {"name": "attention_gram"}, "float32", 4, store)
    assert mixed.meta["n_tokens"] == 8 * 32 and mixed.uri != gram.uri
    keys = t.collect_statistic.fn(model, calib, {"name": "output_fisher"}, "float32", 4, store)
    assert keys.meta["n_tokens"] == 8 * 31 and keys.meta["labels"] == "sampled"
    stats = {"gram": gram, "attention_gram": mixed, "output_fisher": keys}
    layers = [t.decompose_layer.fn(model, stats, i, 2, {"name": "whitened"}, store) for i in range(2)]
    assert [f.meta["layer"] for f in layers] == [0, 1] and layers[0].meta["info"]["whitening"] == "cholesky"
    assert layers[0].meta["info"]["value_whitening"] == "cholesky"  # the default: values after the attention
    summaries = [t.summarize_layer.fn(f, {"fisher": fisher}, ["error_curves"], store) for f in layers]
    assert summaries[1].meta == {"layer": 1, "features": ["error_curves"]}
    plan = t.plan_ranks.fn(model, summaries, 1.0, 2, 8, {"name": "fisher-greedy"}, store)
    assert plan.meta["achieved_ratio"] == 1.0 and plan.meta["heatmap"].endswith(".png")
    assert json.loads(open(plan.uri).read())["ranks"]["k"] == [[16], [16]]
    built = t.build_model.fn(model, layers, plan, {"name": "whitened"}, {"name": "dense"}, "float32", store)
    assert built.uri.startswith(store) and len(built.sha256) == 64 and built.kind == "model"

    base, _ = load_model(setup["model_dir"])
    compressed = load_compressed(built.uri)
    ids = torch.randint(3, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (base(ids).logits - compressed(ids).logits).abs().max() < 1e-4

    out = setup["root"] / "export"
    assert not t.export_is_current(built, str(out))
    t.export_model.fn(built, str(out))
    assert t.export_is_current(built, str(out))
    (out / "README.md").write_text("edited card")  # not part of the fingerprint: still current
    assert t.export_is_current(built, str(out))

    ev = {
        "dataset": setup["data"],
        "seq_len": 32,
        "max_windows": 6,
        "decode_prefix": 16,
        "decode_windows": 3,
        "batch_size": 4,
    }
    base_eval = t.evaluate.fn(model, ev, "float32", "base")
    comp_eval = t.evaluate.fn(built, ev, "float32", "compressed")
    assert base_eval["prefill"]["protocol"]["dataset"] == setup["data"]
    assert abs(base_eval["prefill"]["nll"] - comp_eval["prefill"]["nll"]) < 1e-4
    assert abs(base_eval["decode"]["nll"] - comp_eval["decode"]["nll"]) < 1e-4
    assert comp_eval["kv"]["cache_class"] == "LatentCache"


def test_build_model_fuses_the_rotation_and_records_the_quantized_cache(setup):
    store = setup["store"]
    model = t.resolve_model.fn(str(setup["model_dir"]))
    calib = t.extract_calibration.fn(model, setup["data"], 8, 32, 0, store)
    gram = t.collect_statistic.fn(model, calib, {"name": "gram"}, "float32", 4, store)
    whitened = {"name": "whitened", "values": "projection", "keys": "projection"}
    layers = [t.decompose_layer.fn(model, {"gram": gram}, i, 2, whitened, store) for i in range(2)]
    summaries = [t.summarize_layer.fn(f, {}, [], store) for f in layers]
    plan = t.plan_ranks.fn(model, summaries, 0.5, 2, 8, {"name": "uniform"}, store)
    cache = {"name": "quantized", "bits": 4, "quant_group_size": 4, "residual": 0}
    plain = t.build_model.fn(model, layers, plan, whitened, {"name": "dense"}, "float32", store)
    built = t.build_model.fn(
        model, layers, plan, whitened, cache, "float32", store, rotation={"name": "hadamard", "seed": 3}
    )
    section = json.loads(open(f"{built.uri}/config.json").read())["lrkv"]
    assert section["cache"] == cache and (section["rotation"], section["rotation_seed"]) == ("hadamard", 3)
    rotated, unrotated = load_compressed(built.uri), load_compressed(plain.uri)
    ids = torch.randint(3, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        rotated.config.lrkv["cache"] = {"name": "dense"}  # without quantization the rotation changes nothing
        assert (rotated(ids).logits - unrotated(ids).logits).abs().max() < 1e-4
    ev = {"dataset": setup["data"], "seq_len": 32, "max_windows": 4, "decode_prefix": 16, "decode_windows": 2,
          "batch_size": 4}  # fmt: skip
    kv = t.evaluate.fn(built, ev, "float32", "compressed")["kv"]
    # per token and layer: 8 + 8 latents at 4 bits, 2 + 2 groups of 4 with fp16 scale and zero, a position
    # against the original's fp32 K and V: 2 layers × 2 KV heads × 8 dims × 2 × 4 bytes
    assert kv["kv_bytes_per_token"] == 2 * (4 + 4 + 4 * 2 * 2 + 4) and kv["dense_kv_bytes_per_token"] == 256
    assert kv["kv_compression_ratio"] == 256 / 56


def test_export_refuses_to_clobber_foreign_directories(setup, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep")
    with pytest.raises(FileExistsError):
        t.export_model.fn(ArtifactRef(kind="model", uri=str(setup["model_dir"]), sha256="x"), str(foreign))
    assert (foreign / "precious.txt").read_text() == "keep"


def test_code_version_changes_with_any_source_change(tmp_path):
    """Cache keys carry a hash of the sources, so a changed algorithm never reuses the old one's results."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "notes.txt").write_text("not code")
    before = hash_sources(pkg)
    (pkg / "notes.txt").write_text("edited")
    assert hash_sources(pkg) == before  # only Python sources count
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    changed = hash_sources(pkg)
    (pkg / "sub" / "b.py").rename(pkg / "b.py")
    assert len({before, changed, hash_sources(pkg)}) == 3
    assert code_version().startswith(lrkv_core.__version__ + "+")


def _model_dir(path, label: str):
    """A stand-in lrkv model directory: is_compressed_dir() holds, and its bytes say which one it is."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"lrkv": {"label": label}}))
    (path / "model.safetensors").write_bytes(label.encode() * 100)
    return path


CRASH_ON_RENAME_IN = """
import os, sys
from pathlib import Path
from lrkv_tasks.convert import copy_model_dir

out = Path(sys.argv[2])
rename = os.rename

def crash(src, dst, *args, **kwargs):  # the process dies the moment the new copy would be renamed in
    if Path(dst) == out:
        os._exit(9)
    return rename(src, dst, *args, **kwargs)

os.rename = crash
copy_model_dir(Path(sys.argv[1]), out)
"""


def test_a_crash_while_exporting_keeps_the_old_model(tmp_path):
    """The process dies between moving the old export out of the way and renaming the new one in: the old
    model is still complete on disk (beside --out), never deleted before the new one is in place."""
    new = _model_dir(tmp_path / "built", "new")
    out = _model_dir(tmp_path / "exports" / "out", "old")
    res = subprocess.run([sys.executable, "-c", CRASH_ON_RENAME_IN, str(new), str(out)], capture_output=True)
    assert res.returncode == 9, res.stderr.decode()[-2000:]
    kept = [
        p.parent for p in (tmp_path / "exports").rglob("model.safetensors") if p.read_bytes() == b"old" * 100
    ]
    assert len(kept) == 1 and json.loads((kept[0] / "config.json").read_text()) == {"lrkv": {"label": "old"}}
    t.copy_model_dir(new, out)  # the next export completes
    assert (out / "model.safetensors").read_bytes() == b"new" * 100


def test_an_export_leaves_another_exports_temporary_files_alone(tmp_path):
    """Each export stages under a name of its own: one to the same --out running alongside is not disturbed,
    and a finished export leaves only --out behind."""
    new = _model_dir(tmp_path / "built", "new")
    exports = tmp_path / "exports"
    out = _model_dir(exports / "out", "old")
    other = _model_dir(exports / ".out.tmp", "other")  # what a concurrent export is writing
    t.copy_model_dir(new, out)
    assert (other / "model.safetensors").read_bytes() == b"other" * 100
    assert (out / "model.safetensors").read_bytes() == b"new" * 100
    assert {p.name for p in exports.iterdir()} == {"out", ".out.tmp"}


def test_an_export_that_does_not_match_the_built_hash_is_not_installed(tmp_path):
    new = _model_dir(tmp_path / "built", "new")
    out = _model_dir(tmp_path / "exports" / "out", "old")
    with pytest.raises(StoreIntegrityError, match="does not hash to"):
        t.copy_model_dir(new, out, "0" * 64)
    assert (out / "model.safetensors").read_bytes() == b"old" * 100
    assert {p.name for p in out.parent.iterdir()} == {"out"}
    assert t.copy_model_dir(new, out, hash_dir(new)) == out


def test_the_task_chain_builds_latents_of_rotated_keys(setup):
    """``key_latents: rotated`` through the tasks: the decomposed layers' files hold the keys after RoPE too,
    the build fuses them as rotated-key attention, and at full rank the model is the original's."""
    from lrkv_core.decompositions import load_layer_factors
    from lrkv_core.model.attention_rotated import RotatedKeyAttention

    store = setup["store"]
    model = t.resolve_model.fn(str(setup["model_dir"]))
    calib = t.extract_calibration.fn(model, setup["data"], 8, 32, 0, store)
    gram = t.collect_statistic.fn(model, calib, {"name": "gram"}, "float32", 4, store)
    whitened = {"name": "whitened", "values": "projection", "keys": "projection"}
    decompose = t.decompose_layer.fn
    layers = [decompose(model, {"gram": gram}, i, 2, whitened, store, key_latents="rotated") for i in (0, 1)]
    assert all(list(load_layer_factors(f.uri).groups) == ["k", "v", "k_rot"] for f in layers)
    summaries = [t.summarize_layer.fn(f, {}, [], store) for f in layers]
    plan = t.plan_ranks.fn(model, summaries, 1.0, 2, 8, {"name": "uniform"}, store)
    built = t.build_model.fn(
        model, layers, plan, whitened, {"name": "dense"}, "float32", store, attention="rotated-keys"
    )
    compressed, (base, _) = load_compressed(built.uri), load_model(setup["model_dir"])
    assert compressed.config.lrkv["rope"] == "rotated-keys"
    assert isinstance(compressed.model.layers[0].self_attn, RotatedKeyAttention)
    ids = torch.randint(3, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (base(ids).logits - compressed(ids).logits).abs().max() < 1e-4
