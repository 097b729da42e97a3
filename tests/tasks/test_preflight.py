"""Checks that run before any work: what they refuse, in one line, and what they leave untouched."""

import os
import pickle

import pytest

from lrkv_core import convert, load_model, save_compressed
from lrkv_core.conversion.convert import CompressionConfig
from lrkv_tasks.recipes.convert_recipe import load_recipe
from lrkv_tasks.recipes.preflight import prepare
from tests.support.models import tiny_model, tiny_model_dir, token_parquet


class Planted:
    """Unpickling this creates ``path``: the proof that a pickle was read."""

    def __init__(self, path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@pytest.fixture
def data(tmp_path):
    return f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"


def _recipe(model, data, out=None, eval_dataset="heldout"):
    return load_recipe(
        None,
        {
            "model": str(model),
            "calibration": {"dataset": data, "n_samples": 8, "seq_len": 32},
            "compression": {"ratio": 0.5, "group_size": 2},
            "eval": {"dataset": eval_dataset, "seq_len": 32, "decode_prefix": 16},
            "out": str(out) if out else None,
        },
    )


def test_an_out_that_cannot_be_written_is_refused_before_any_work(tmp_path, data):
    model_dir = tiny_model_dir(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match=f"--out {blocker}/m/out cannot be created: {blocker} is"):
        prepare(_recipe(model_dir, data, blocker / "m" / "out"))
    assert blocker.read_text() == "not a directory"
    prepare(_recipe(model_dir, data, tmp_path / "new" / "out"))  # a directory that does not exist yet is fine
    assert not (tmp_path / "new").exists()  # and checking it created nothing


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_parent_of_out_is_refused(tmp_path, data):
    model_dir = tiny_model_dir(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=f"--out {locked}/out is not writable"):
            prepare(_recipe(model_dir, data, locked / "out"))
    finally:
        locked.chmod(0o755)


def test_a_compressed_model_as_the_source_is_refused_in_one_line(tmp_path, data):
    model_dir = tiny_model_dir(tmp_path)
    model, _ = load_model(model_dir)
    compressed = tmp_path / "compressed"
    save_compressed(
        convert(model, None, CompressionConfig(ratio=0.5, decomposition="plain", allocator="uniform")),
        compressed,
    )
    with pytest.raises(ValueError, match=f"--model {compressed} is already an lrkv compressed model") as err:
        prepare(_recipe(compressed, data))
    assert "\n" not in str(err.value)


def test_pickle_weights_are_refused_without_being_read(tmp_path, data):
    model_dir = tmp_path / "pickled"
    tiny_model().save_pretrained(model_dir)
    (model_dir / "model.safetensors").unlink()  # the weights as a pickle only, one that leaves a mark if read
    marker = tmp_path / "unpickled"
    (model_dir / "pytorch_model.bin").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(ValueError) as err:
        prepare(_recipe(model_dir, data))
    assert str(err.value) == (
        f"--model {model_dir} has no model.safetensors (only pytorch_model.bin); lrkv reads safetensors "
        "weights only, never pickle: save the model with safe_serialization=True first"
    )
    with pytest.raises(FileNotFoundError, match="only pytorch_model.bin"):
        load_model(model_dir)
    assert not marker.exists()


def test_evaluation_on_the_calibration_data_is_warned_about(tmp_path, data):
    model_dir = tiny_model_dir(tmp_path)
    notes = prepare(_recipe(model_dir, data, eval_dataset=data)).notes
    assert any(n.startswith("warning: the evaluation data") and "quality gate" in n for n in notes), notes
    notes = prepare(_recipe(model_dir, data)).notes  # the held-out default
    assert not any(n.startswith("warning:") for n in notes), notes


@pytest.mark.parametrize(
    ("cache", "rotation", "warned"),
    [
        ({"name": "quantized", "bits": 3}, "none", True),
        ({"name": "quantized", "bits": 3}, "auto", False),
        ({"name": "quantized", "bits": 16}, "none", False),
        ({"name": "quantized", "bits": 8}, "none", False),
        ({"name": "gear", "bits": 4}, "none", True),
        ({"name": "gear", "bits": 4}, "hadamard", False),
        ("dense", "none", False),
    ],
)
def test_integer_codes_of_unrotated_latents_are_warned_about(tmp_path, data, cache, rotation, warned):
    recipe = _recipe(tiny_model_dir(tmp_path), data)
    compression = recipe.compression.model_copy(update={"cache": cache, "rotation": rotation})
    notes = prepare(recipe.model_copy(update={"compression": compression})).notes
    warnings = [n for n in notes if n.startswith("warning:") and "unrotated latents" in n]
    assert len(warnings) == warned, notes
    if warned:
        assert f"stores {cache['bits']}-bit codes" in warnings[0] and "--rotation auto" in warnings[0]


def test_accepting_refine_steps_on_rows_the_calibration_lacks_is_refused_before_any_work(tmp_path, data):
    model_dir = tiny_model_dir(tmp_path)
    recipe = _recipe(model_dir, data)
    refine = {"steps": 1, "rows": 4, "accept_rows": 5}  # 9 rows; calibration.n_samples is 8
    too_many = recipe.model_copy(
        update={"compression": recipe.compression.model_copy(update={"refine": refine})}
    )
    with pytest.raises(ValueError, match="it needs 9 calibration rows, got 8: raise calibration.n_samples"):
        prepare(load_recipe(None, too_many.model_dump(mode="json")))
    fits = too_many.model_dump(mode="json")
    fits["compression"]["refine"]["accept_rows"] = 4
    prepare(load_recipe(None, fits))
    capped = too_many.model_dump(mode="json")  # at most 4 rows of 32 tokens each: 4 + 4 fit in 8
    capped["compression"]["refine"]["tokens"] = 4 * 32
    notes = prepare(load_recipe(None, capped)).notes
    assert "each refinement step is priced on 4 and accepted on 4 rows of 32 tokens" in notes


def test_long_calibration_rows_say_how_many_rows_the_kl_response_reads(tmp_path, data):
    model_dir = tiny_model_dir(tmp_path)
    recipe = _recipe(model_dir, data).model_dump(mode="json")
    recipe["compression"]["allocator"] = "kl"
    assert not [n for n in prepare(load_recipe(None, recipe)).notes if "rows of 32 tokens" in n]  # no cap
    recipe["compression"]["statistics"] = [{"name": "kl_response", "tokens": 64}]
    assert "kl_response reads 2 calibration rows of 32 tokens" in prepare(load_recipe(None, recipe)).notes


def test_bench_contexts_default_to_the_ones_the_model_holds(tmp_path):
    """Given contexts are measured as given (shortest first); without them the defaults, each past the
    model's positions (with the decode steps after it) replaced by the longest that fits; a model that
    cannot be read keeps the defaults (its own check says what is wrong)."""
    from lrkv_tasks.recipes.preflight import BENCH_CONTEXTS, bench_contexts

    llama = tiny_model_dir(tmp_path)  # 128 positions
    assert bench_contexts(str(llama), [64, 16], 18) == [16, 64]
    assert bench_contexts(str(llama), None, 18) == [110]
    assert bench_contexts(str(tmp_path / "nope"), None, 18) == list(BENCH_CONTEXTS)
