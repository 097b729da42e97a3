"""The model resolver: local directories, hub ids, pluggable schemes and their entry-point discovery."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import pytest

from lrkv_core.data import refs
from lrkv_core.data.refs import (
    DATASET_SCHEMES,
    MODEL_GROUP,
    MODEL_SCHEMES,
    absolute_dataset_spec,
    absolute_model_ref,
    register_dataset_scheme,
    register_model_scheme,
    resolve_model_dir,
)
from lrkv_core.model.loading import resolve_model_dir as reexported


def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record hub downloads instead of making them."""
    calls: list[str] = []

    def fake_download(repo_id: str, allow_patterns: list[str]) -> str:
        calls.append(repo_id)
        raise AssertionError(f"tried to download {repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    return calls


@pytest.fixture
def toy(tmp_path: Path):
    """A model scheme ``toy:NAME`` registered from this module: ``<tmp>/models/NAME``."""
    calls: list[str] = []

    def resolve(rest: str) -> Path:
        calls.append(rest)
        return tmp_path / "models" / rest

    register_model_scheme("toy", resolve)
    yield resolve, calls
    MODEL_SCHEMES.unregister("toy")


def test_local_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_hub) -> None:
    model = _model_dir(tmp_path / "m")
    assert resolve_model_dir(str(model)) == model == resolve_model_dir(model) == reexported(str(model))
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("./m") == Path("m") and resolve_model_dir("m") == Path("m")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_dir("~/m") == model
    _model_dir(tmp_path / "odd:name")
    assert resolve_model_dir("./odd:name") == Path("odd:name")  # './' makes it a path, not a scheme
    assert no_hub == []


def test_local_paths_are_made_absolute_and_other_refs_kept(tmp_path: Path, monkeypatch, toy, no_hub) -> None:
    """What a task on another process or host needs: the same files, whatever its working directory."""
    _model_dir(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    assert absolute_model_ref("./m") == absolute_model_ref("m") == str(tmp_path / "m")
    assert absolute_model_ref("../" + tmp_path.name + "/m") == str(tmp_path / "m")
    assert absolute_model_ref("./odd:name") == str(tmp_path / "odd:name")  # a path, though not there yet
    for ref in ("toy:m", "meta-llama/Llama-2-7b-hf", str(tmp_path / "m")):  # a scheme, a hub id, absolute
        assert absolute_model_ref(ref) == ref
    assert absolute_dataset_spec("text:data/train.txt[:90%]") == f"text:{tmp_path}/data/train.txt[:90%]"
    assert absolute_dataset_spec("parquet:rows.parquet") == f"parquet:{tmp_path}/rows.parquet"
    for spec in ("hf:wikitext:wikitext-2-raw-v1:train", f"text:{tmp_path}/a.txt[10%:]", "text:~/a.txt"):
        assert absolute_dataset_spec(spec) == spec
    assert resolve_model_dir(absolute_model_ref("m")) == tmp_path / "m" and no_hub == []


def test_local_errors_name_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_hub) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"empty has no config\.json"):
        resolve_model_dir(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="file is not a directory"):
        resolve_model_dir(str(tmp_path / "file"))
    monkeypatch.chdir(tmp_path)
    for ref in ("./nope", "/nope/at/all", "~/nope-lrkv-test", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="does not exist|not a local directory"):
            resolve_model_dir(ref)
    with pytest.raises(FileNotFoundError, match=r"'gpt-17' not found: .*hub id ORG/NAME.*known schemes"):
        resolve_model_dir("gpt-17")  # no '/': not a hub id
    assert no_hub == []


def test_hub_id_has_exactly_one_slash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = _model_dir(tmp_path / "snapshot")
    calls = []

    def fake_download(repo_id: str, allow_patterns: list[str]) -> str:
        calls.append((repo_id, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("org/model-1.5") == snapshot
    assert calls == [("org/model-1.5", refs.HUB_PATTERNS)]


def test_registered_scheme_resolves(toy, tmp_path: Path, no_hub) -> None:
    resolve, calls = toy
    model = _model_dir(tmp_path / "models" / "tiny")
    assert resolve_model_dir("toy:tiny") == model and calls == ["tiny"]
    register_model_scheme("toy", resolve)  # the same resolver again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register_model_scheme("toy", lambda rest: rest)
    (tmp_path / "models" / "half").mkdir()
    with pytest.raises(FileNotFoundError, match=r"half has no config\.json"):
        resolve_model_dir("toy:half")
    with pytest.raises(FileNotFoundError, match=r"gone does not exist \(from toy:gone\)"):
        resolve_model_dir("toy:gone")
    assert no_hub == []


def test_unknown_scheme_lists_known_schemes(toy, no_hub) -> None:
    expected = r"unknown model scheme 'nosuch' in 'nosuch:x'; known schemes: .*toy"
    with pytest.raises(ValueError, match=expected) as e:
        resolve_model_dir("nosuch:x")
    assert "./nosuch:x" in str(e.value)  # the way to name a local directory called that
    assert no_hub == []


@pytest.mark.parametrize("scheme", ["Bad", "a_b", "", "9x"])
def test_bad_scheme_names_are_refused(scheme: str) -> None:
    with pytest.raises(ValueError, match="bad model scheme"):
        register_model_scheme(scheme, str)


def test_core_dataset_kinds_cannot_be_taken() -> None:
    for kind in ("hf", "text", "parquet"):
        with pytest.raises(ValueError, match="built-in dataset kind"):
            register_dataset_scheme(kind, str)
    with pytest.raises(TypeError, match="must be callable"):
        register_model_scheme("notcallable", "not a function")
    assert "notcallable" not in MODEL_SCHEMES.names() and "text" not in DATASET_SCHEMES.names()


class FakeEntryPoint:
    """Stands for an installed ``lrkv.model_refs`` entry point; counts its loads."""

    def __init__(self, name: str, target: object) -> None:
        self.name, self.target, self.loads = name, target, 0

    def load(self) -> object:
        self.loads += 1
        return self.target


def test_entry_points_load_lazily_on_first_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model_dir(tmp_path / "plugged")
    ep = FakeEntryPoint("plug", lambda rest: tmp_path / rest)

    def fake_entry_points(group: str, name: str | None = None) -> list[FakeEntryPoint]:
        return [ep] if group == MODEL_GROUP and name in (None, ep.name) else []

    monkeypatch.setattr(refs, "entry_points", fake_entry_points)
    try:
        assert "plug" in MODEL_SCHEMES.names() and ep.loads == 0  # listed without loading
        assert MODEL_SCHEMES.loaded("plug") is None
        assert resolve_model_dir("plug:plugged") == model and ep.loads == 1
        assert resolve_model_dir("plug:plugged") == model and ep.loads == 1  # registered now
        assert MODEL_SCHEMES.loaded("plug") is ep.target
    finally:
        MODEL_SCHEMES.unregister("plug")
