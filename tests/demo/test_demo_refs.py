"""The ``builtin`` scheme: lrkv_demo plugs into lrkv_core's resolver through entry points, building nothing
until a ``builtin:`` reference is resolved."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from lrkv_core.data.datasets import check_dataset, heldout, parse_dataset_spec, resolve_spec
from lrkv_core.data.refs import (
    DATASET_GROUP,
    DATASET_SCHEMES,
    MODEL_GROUP,
    MODEL_SCHEMES,
    DatasetSpec,
    resolve_model_dir,
)
from lrkv_core.data.slices import PercentSlice
from lrkv_demo import builtin, refs
from lrkv_demo.builtin import DEFAULT_BUILTIN


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ``$LRKV_HOME``, the ``builtin`` scheme not yet loaded, and any build an error."""

    def no_build(*args, **kwargs):
        raise AssertionError("built the demo model")

    monkeypatch.setenv("LRKV_HOME", str(tmp_path))
    monkeypatch.setattr(builtin, "build_builtin_model", no_build)
    MODEL_SCHEMES.unregister("builtin")
    DATASET_SCHEMES.unregister("builtin")
    return tmp_path


@pytest.fixture
def finished(home: Path) -> Path:
    """A fake finished build of the default model under ``$LRKV_HOME/builtin``."""
    path = home / "builtin" / DEFAULT_BUILTIN
    path.mkdir(parents=True)
    for name, text in [("config.json", "{}"), ("train.txt", "a b\n"), ("valid.txt", "c d\n")]:
        (path / name).write_text(text)
    (path / "build_info.json").write_text(json.dumps({"steps": 600, "seed": 0}))
    return path


def test_entry_points_are_installed() -> None:
    (model_ep,) = entry_points(group=MODEL_GROUP, name="builtin")
    (data_ep,) = entry_points(group=DATASET_GROUP, name="builtin")
    assert model_ep.value == "lrkv_demo.refs:resolve_builtin_model"
    assert data_ep.value == "lrkv_demo.refs:BUILTIN_DATASETS"


def test_builtin_model_is_discovered_and_not_rebuilt(finished: Path) -> None:
    assert MODEL_SCHEMES.loaded("builtin") is None and "builtin" in MODEL_SCHEMES.names()
    assert resolve_model_dir(f"builtin:{DEFAULT_BUILTIN}") == finished
    assert MODEL_SCHEMES.loaded("builtin") is refs.resolve_builtin_model


def test_builtin_dataset_is_discovered_and_resolves_beside_the_model(finished: Path) -> None:
    assert DATASET_SCHEMES.loaded("builtin") is None
    spec = parse_dataset_spec(f"builtin:{DEFAULT_BUILTIN}:valid")
    assert spec == DatasetSpec("builtin", f"{DEFAULT_BUILTIN}:valid")
    assert DATASET_SCHEMES.loaded("builtin") is refs.BUILTIN_DATASETS
    assert resolve_spec(spec) == DatasetSpec("text", str(finished / "valid.txt"))
    sliced = resolve_spec(f"builtin:{DEFAULT_BUILTIN}:train[:90%]")
    assert sliced == DatasetSpec("text", str(finished / "train.txt"), part=PercentSlice(0, 90))


def test_parse_check_and_heldout_build_nothing(home: Path) -> None:
    spec = f"builtin:{DEFAULT_BUILTIN}:train"
    check_dataset(spec, has_tokenizer=True)
    calib, evaluation, words = heldout(spec)
    assert (str(calib), str(evaluation)) == (spec, f"builtin:{DEFAULT_BUILTIN}:valid")
    assert words == f"the valid split of builtin:{DEFAULT_BUILTIN} (held out of its training and calibration)"
    calib, evaluation, _ = heldout(f"builtin:{DEFAULT_BUILTIN}:valid")  # no third split: slices
    assert (calib.part, evaluation.part) == (PercentSlice(0, 90), PercentSlice(90, 100))
    assert not (home / "builtin").exists()


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("builtin:x", "expected builtin:NAME:SPLIT"),
        ("builtin:x:y:z", "expected builtin:NAME:SPLIT"),
        ("builtin::valid", "expected builtin:NAME:SPLIT"),
        ("builtin:gpt-17:train", "unknown builtin model 'gpt-17'; available: pydoc-llama"),
        (f"builtin:{DEFAULT_BUILTIN}:test", "splits train, valid, not 'test'"),
    ],
)
def test_bad_builtin_specs_fail_at_parse(home: Path, spec: str, why: str) -> None:
    with pytest.raises(ValueError, match=rf"{why}.*accepted forms: .*builtin:NAME:SPLIT"):
        parse_dataset_spec(spec)


def test_unknown_builtin_model(home: Path) -> None:
    with pytest.raises(ValueError, match="unknown builtin model 'gpt-17'; available: pydoc-llama"):
        resolve_model_dir("builtin:gpt-17")
