"""The registry on the embedded default (SQLite under ``$LRKV_HOME``, no MLflow variables): a registered
lrkv model is found by ``lrkv pull``, ``load_compressed("models:/...")`` and ``load_pyfunc("models:/...")``,
each run as a real process in a fresh directory, and none of them leaves an ``mlflow.db`` there."""

import json
import os
import subprocess
import sys

import pytest
import torch

from lrkv_core import convert, load_compressed, save_compressed
from lrkv_core.conversion.convert import CompressionConfig
from lrkv_core.system.fingerprint import hash_dir
from lrkv_tasks.tracking.mlflow_runs import close_run, open_run
from lrkv_tasks.tracking.model_registry import log_model, register_version
from tests.support.models import tiny_model

NAME = "lrkv-tiny-llama"
IDS = [[5, 9, 17, 33, 2, 41, 8, 12]]
LOAD = """
import json, sys, torch
torch.set_num_threads(1)
from lrkv_core import load_compressed
from lrkv_tasks.tracking.remote_refs import load_pyfunc
ids = json.loads(sys.argv[1])
with torch.no_grad():
    logits = load_compressed(sys.argv[2])(torch.tensor(ids)).logits
torch.save(logits, "logits.pt")
print(json.dumps(load_pyfunc(sys.argv[2]).predict(ids, params={"max_new_tokens": 3})))
"""


def _default_env(home) -> dict[str, str]:
    env = {**os.environ, "LRKV_HOME": str(home)}
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "PREFECT_API_URL"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """A home whose default registry holds ``lrkv-tiny-llama`` v1 (champion), registered by lrkv's own tasks
    from a directory other than the ones the tests run in: ``(home, model_dir, sha256)``."""
    root = tmp_path_factory.mktemp("default-registry")
    home, work = root / "home", root / "work"
    work.mkdir()
    model_dir = root / "compressed"
    config = CompressionConfig(ratio=0.5, decomposition="plain", allocator="uniform")
    save_compressed(convert(tiny_model("llama"), None, config), model_dir)
    sha = hash_dir(model_dir)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _default_env(home).items():
            mp.setenv(name, value)
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
            mp.delenv(name, raising=False)
        mp.chdir(work)
        run = open_run(None, "lrkv", "registered", {})
        assert run["tracking_uri"] == f"sqlite:///{home / 'mlflow.db'}"
        logged = log_model(run, model_dir, sha)
        quality = {"ppl": 10.0, "base_ppl": 10.0, "protocol": "p"}
        reg = register_version(run, logged, sha, NAME, quality, max_ppl_rise=0.05)
        close_run(run, "FINISHED")
    assert reg["aliases"] == ["candidate", "champion"]
    assert list(work.iterdir()) == []
    return home, model_dir, sha


def test_pull_finds_the_default_registry_and_leaves_no_mlflow_db_behind(registered, tmp_path):
    home, model_dir, sha = registered
    res = subprocess.run(
        [sys.executable, "-m", "lrkv_flows.cli", "pull", f"{NAME}@champion", "--out", "pulled"],
        cwd=tmp_path,
        env=_default_env(home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"pulled {NAME} v1" in res.stdout
    assert hash_dir(tmp_path / "pulled") == sha
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pulled"]


def test_models_uris_load_from_the_default_registry(registered, tmp_path):
    """``load_compressed`` and the pyfunc loader, by ``models:/`` URI, in a fresh process and directory."""
    home, model_dir, _ = registered
    res = subprocess.run(
        [sys.executable, "-c", LOAD, json.dumps(IDS), f"models:/{NAME}@champion"],
        cwd=tmp_path,
        env=_default_env(home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    original = load_compressed(model_dir)
    with torch.no_grad():
        expected = original(torch.tensor(IDS)).logits
        greedy = original.generate(torch.tensor(IDS), max_new_tokens=3, do_sample=False)
    assert torch.equal(torch.load(tmp_path / "logits.pt"), expected)
    assert json.loads(res.stdout.strip().splitlines()[-1]) == greedy.tolist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.pt"]
