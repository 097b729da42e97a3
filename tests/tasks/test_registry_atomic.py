"""Registration is all-or-nothing, against a real ``mlflow server`` on loopback: a failure after the new
version exists rolls it back, and versions a killed attempt left incomplete are cleaned up on the next one."""

import json
import uuid

import pytest
from mlflow.tracking import MlflowClient

from lrkv_tasks.tracking.model_registry import (
    CANDIDATE,
    CHAMPION,
    COMPLETE_TAG,
    PREVIOUS_TAG,
    SHA_TAG,
    log_model,
    register_version,
)

BASE_PPL = 10.0


def _quality(ppl: float) -> dict:
    return {"ppl": ppl, "base_ppl": BASE_PPL, "protocol": "p1"}


def _logged(uri: str, tmp_path, content: str) -> tuple[dict, dict, str]:
    """A run holding a logged (pyfunc) model of a small directory: ``(run, logged, sha256)``."""
    mc = MlflowClient(uri)
    exp = mc.get_experiment_by_name("registry-atomic") or mc.get_experiment(
        mc.create_experiment("registry-atomic")
    )
    run = mc.create_run(exp.experiment_id)
    run = {"run_id": run.info.run_id, "experiment_id": exp.experiment_id, "tracking_uri": uri}
    model_dir = tmp_path / f"model-{content}"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"content": content}))
    sha = uuid.uuid4().hex * 2  # stands for the directory's content hash
    return run, log_model(run, model_dir, sha), sha


def _state(mc: MlflowClient, name: str) -> tuple[list[str], dict[str, str]]:
    """The registered model's versions and its aliases (alias -> version)."""
    versions = sorted(v.version for v in mc.search_model_versions(f"name='{name}'"))
    return versions, dict(mc.get_registered_model(name).aliases)


@pytest.mark.parametrize("failing", ["champion alias", "complete tag"])
def test_a_failure_after_the_version_is_created_removes_it_and_puts_the_aliases_back(
    mlflow_server, tmp_path, monkeypatch, failing
):
    """Whichever step after creating v2 fails, v2 is deleted and both aliases name v1 again."""
    name = f"lrkv-atomic-{uuid.uuid4().hex[:8]}"
    mc = MlflowClient(mlflow_server)
    run, logged, sha = _logged(mlflow_server, tmp_path, "v1")
    first = register_version(run, logged, sha, name, _quality(10.4), max_ppl_rise=0.05)
    assert _state(mc, name) == (["1"], {CANDIDATE: "1", CHAMPION: "1"})

    def fail_champion(self, model, alias, version):
        if alias == CHAMPION and str(version) != first["version"]:  # candidate has moved to v2 already
            raise RuntimeError("injected: the registry went away")
        return set_alias(self, model, alias, version)

    def fail_complete(self, model, version, key, value):
        if key == COMPLETE_TAG:  # both aliases have moved to v2 already
            raise RuntimeError("injected: the registry went away")
        return set_tag(self, model, version, key, value)

    set_alias, set_tag = MlflowClient.set_registered_model_alias, MlflowClient.set_model_version_tag
    if failing == "champion alias":
        monkeypatch.setattr(MlflowClient, "set_registered_model_alias", fail_champion)
    else:
        monkeypatch.setattr(MlflowClient, "set_model_version_tag", fail_complete)
    run2, logged2, sha2 = _logged(mlflow_server, tmp_path, "v2")
    with pytest.raises(RuntimeError, match="injected"):
        register_version(run2, logged2, sha2, name, _quality(10.2), max_ppl_rise=0.05)  # would be champion
    assert _state(mc, name) == (["1"], {CANDIDATE: "1", CHAMPION: "1"})


def test_versions_a_killed_attempt_left_incomplete_are_removed_and_their_aliases_returned(
    mlflow_server, tmp_path
):
    """The incomplete v2 is deleted and its aliases return to v1 before the gate, which v3 (worse) fails."""
    name = f"lrkv-atomic-{uuid.uuid4().hex[:8]}"
    mc = MlflowClient(mlflow_server)
    run, logged, sha = _logged(mlflow_server, tmp_path, "v1")
    register_version(run, logged, sha, name, _quality(10.2), max_ppl_rise=0.05)

    # what an attempt killed after moving both aliases leaves: v2 without lrkv.complete, holding the aliases
    run2, logged2, sha2 = _logged(mlflow_server, tmp_path, "v2")
    tags = {SHA_TAG: sha2, PREVIOUS_TAG + CANDIDATE: "1", PREVIOUS_TAG + CHAMPION: "1"}
    planted = mc.create_model_version(
        name, logged2["source"], run_id=run2["run_id"], tags=tags, model_id=logged2["model_id"]
    )
    for alias in (CANDIDATE, CHAMPION):
        mc.set_registered_model_alias(name, alias, planted.version)
    assert _state(mc, name) == (["1", "2"], {CANDIDATE: "2", CHAMPION: "2"})

    reg = register_version(run2, logged2, sha2, name, _quality(10.4), max_ppl_rise=0.05)  # worse than v1
    assert reg["version"] == "3" and reg["aliases"] == [CANDIDATE], reg
    assert "does not beat champion v1" in reg["gate"]["reason"]
    assert _state(mc, name) == (["1", "3"], {CANDIDATE: "3", CHAMPION: "1"})
    assert mc.get_model_version(name, "3").tags[COMPLETE_TAG] == "true"


def test_registrations_of_one_model_at_once_take_turns_through_the_gate(mlflow_server, tmp_path, monkeypatch):
    """Two registrations started together: without turns both would read "no champion" and both become
    the first champion; with them exactly one does and the other is compared with it."""
    import threading

    from lrkv_tasks.tracking import model_registry as registry

    monkeypatch.setenv("LRKV_HOME", str(tmp_path / "home"))
    name = f"lrkv-together-{uuid.uuid4().hex[:8]}"
    both_read = threading.Barrier(2)
    real = registry._alias_version

    def read_then_wait(mc, model, alias):  # hold each registration after it read the champion
        version = real(mc, model, alias)
        if alias == CHAMPION:
            try:
                both_read.wait(timeout=3)  # only reached by both at once when nothing serializes them
            except threading.BrokenBarrierError:
                pass
        return version

    monkeypatch.setattr(registry, "_alias_version", read_then_wait)
    logged = [_logged(mlflow_server, tmp_path, f"v{i}") for i in (1, 2)]
    results: list[dict] = []
    threads = [
        threading.Thread(
            target=lambda r=r, lg=lg, sha=sha: results.append(
                register_version(r, lg, sha, name, _quality(10.4), max_ppl_rise=0.05)
            )
        )
        for r, lg, sha in logged
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reasons = sorted(r["gate"]["reason"] for r in results)
    assert len(results) == 2 and sum("first champion" in why for why in reasons) == 1, reasons
    first = next(r for r in results if "first champion" in r["gate"]["reason"])
    assert _state(MlflowClient(mlflow_server), name)[1][CHAMPION] == first["version"]
