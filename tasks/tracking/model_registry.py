"""The compressed model in MLflow: logged as a pyfunc model, registered as ``lrkv-<model-slug>``, aliased.

The MLflow model is the lrkv model directory under ``data/lrkv-model`` plus an MLmodel whose pyfunc
``loader_module`` is :mod:`lrkv_tasks.mlflow_model` (it calls ``load_compressed``): no pickle, no code
copied into the model. Registration (:func:`register_version`) tags the version with the model's content
hash and evaluation, sets the ``candidate`` alias and, when the quality gate passes (:func:`quality_gate`),
``champion``. It is all-or-nothing: a failure at any step deletes the new version and puts the aliases back
where they were, and a re-run first deletes versions an earlier, killed attempt left without the
``lrkv.complete`` tag, moving an alias such a version took back to the version it named before (each version
is created with tags ``lrkv.previous.<alias>`` recording that).
"""

from __future__ import annotations

import re
import tempfile
import warnings
from pathlib import Path

from lrkv_core.version import __version__

from .mlflow_runs import client

LOADER = "lrkv_tasks.mlflow_model"
DATA_NAME = "lrkv-model"
CANDIDATE, CHAMPION = "candidate", "champion"
SHA_TAG, COMPLETE_TAG = "lrkv.sha256", "lrkv.complete"
PPL_TAG, BASE_PPL_TAG, PROTOCOL_TAG, GATE_TAG = "lrkv.ppl", "lrkv.base_ppl", "lrkv.protocol", "lrkv.gate"
KL_TAG = "lrkv.kl"  # KL(original ‖ compressed) per token on the evaluation's prefill windows
PREVIOUS_TAG = "lrkv.previous."  # + alias: the version the alias named before this version took it


def model_name(model_ref: str) -> str:
    """``lrkv-<slug>`` of a model reference (``meta-llama/Llama-2-7b-hf`` -> ``lrkv-llama-2-7b-hf``)."""
    last = re.split(r"[/:]", model_ref.rstrip("/"))[-1]
    slug = re.sub(r"[^a-z0-9]+", "-", last.lower()).strip("-")
    return f"lrkv-{slug or 'model'}"


def log_model(run: dict, model_dir: Path, sha256: str) -> dict[str, str]:
    """Log the compressed model directory as an MLflow (pyfunc) model of ``run``.

    Returns ``{"model_id", "source"}``: the logged model's id and its artifact location (what a registered
    version points at; a ``models:/m-...`` source would be resolved through MLflow's global tracking URI).
    """
    import mlflow.pyfunc
    from mlflow.entities import LoggedModelOutput

    from ..mlflow_model import signature

    mc = client(run["tracking_uri"])
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / DATA_NAME
        data.symlink_to(Path(model_dir).resolve(), target_is_directory=True)  # copied once, by save_model
        saved = Path(tmp) / "mlflow-model"
        with warnings.catch_warnings():  # the signature declares the input; an example would be token ids
            warnings.filterwarnings("ignore", ".*An input example was not provided", UserWarning)
            mlflow.pyfunc.save_model(
                path=str(saved),
                loader_module=LOADER,
                data_path=str(data),
                pip_requirements=[f"lrkv=={__version__}"],
                signature=signature(),  # declares predict's params, which MLflow would otherwise drop
            )
        logged = mc.create_logged_model(
            run["experiment_id"], name="model", source_run_id=run["run_id"], tags={SHA_TAG: sha256}
        )
        try:
            mc.log_model_artifacts(logged.model_id, str(saved))
        except BaseException:
            mc.finalize_logged_model(logged.model_id, "FAILED")
            raise
    mc.finalize_logged_model(logged.model_id, "READY")
    mc.log_outputs(run["run_id"], [LoggedModelOutput(logged.model_id, 0)])
    return {"model_id": logged.model_id, "source": logged.artifact_location}


def quality_gate(
    quality: dict | None, champion: dict | None, max_ppl_rise: float, max_kl: float | None = None
) -> tuple[bool, str]:
    """Whether a version becomes champion. Returns ``(ok, why)``. It must:

    - have been evaluated on data that does not overlap its calibration data
      (``quality["calibration_overlap"]`` says when it does);
    - raise its perplexity at most ``max_ppl_rise`` (relative) over the original's;
    - stay within ``max_kl`` nats/token of the original (KL(original ‖ compressed), ``quality["kl"]``), when
      given;
    - after LoRA recovery, be no further from the original than before it (``quality["before_lora_kl"]``):
      a recovery that lowers perplexity by fitting the evaluation text's domain while its predictions move
      away from the original's is not a better compression of that model;
    - beat the current champion measured on the same protocol: on KL to the original where both measured
      it (the closer one reproduces the original better), else on perplexity.
    """
    if quality is None:
        return False, "not evaluated"
    if quality.get("calibration_overlap"):
        return False, quality["calibration_overlap"]
    rise = quality["ppl"] / quality["base_ppl"] - 1
    if rise > max_ppl_rise:
        return False, f"perplexity rise {rise:+.2%} exceeds the gate's {max_ppl_rise:.2%}"
    kl = quality.get("kl")
    within = f"perplexity rise {rise:+.2%} within {max_ppl_rise:.2%}"
    if max_kl is not None:
        if kl is None:
            return False, "KL to the original was not measured: the gate's max_kl cannot be checked"
        if kl > max_kl:
            return False, f"KL to the original {kl:.5f} nats/token exceeds the gate's {max_kl:g}"
        within += f", KL {kl:.5f} within {max_kl:g}"
    before = quality.get("before_lora_kl")
    if kl is not None and before is not None and kl > before:
        return False, (
            f"LoRA recovery moved the model away from the original (KL {before:.5f} → {kl:.5f} nats/token; "
            "lora.objective=distill trains on the original's predictions)"
        )
    if champion is None:
        return True, within + ", first champion"
    if champion.get("protocol") != quality["protocol"]:
        return False, f"champion v{champion['version']} was measured on another protocol: not comparable"
    if kl is not None and champion.get("kl") is not None:
        if kl >= champion["kl"]:
            return False, (
                f"KL to the original {kl:.5f} nats/token does not beat champion v{champion['version']}'s "
                f"{champion['kl']:.5f}"
            )
        return True, within + f", closer to the original than champion v{champion['version']}"
    if quality["ppl"] >= champion["ppl"]:
        return False, f"perplexity {quality['ppl']:.4f} does not beat champion v{champion['version']}'s"
    return True, within + f", better than champion v{champion['version']}"


def _alias_version(mc, name: str, alias: str):
    return _version_or_none(mc.get_model_version_by_alias, name, alias)


def _version_or_none(get, *args):
    """``get(*args)``, a model version, or None when MLflow says there is no such version or alias."""
    from mlflow.exceptions import MlflowException

    try:
        return get(*args)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def _quality_of(version) -> dict | None:
    if version is None or PPL_TAG not in version.tags:
        return None
    return {
        "version": version.version,
        "ppl": float(version.tags[PPL_TAG]),
        "protocol": version.tags.get(PROTOCOL_TAG),
        "kl": float(version.tags[KL_TAG]) if KL_TAG in version.tags else None,
    }


def _ensure_registered(mc, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        mc.create_registered_model(name, description="lrkv compressed models (latent KV cache)")
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def register_version(
    run: dict,
    logged: dict,
    sha256: str,
    name: str,
    quality: dict | None,
    max_ppl_rise: float,
    max_kl: float | None = None,
) -> dict:
    """Register the logged model as a new version of ``name`` (all-or-nothing; see the module docstring).

    ``quality``: ``{"ppl", "base_ppl", "protocol"}`` of the compressed model, with ``"kl"`` (and
    ``"before_lora_kl"``) where measured (None: not evaluated); the gate's bounds: :func:`quality_gate`.
    Returns ``{"name", "version", "aliases", "gate"}``.
    """
    bounds = {"max_ppl_rise": max_ppl_rise, "max_kl": max_kl}
    with _registration_lock(name):
        return _register_version(run, logged, sha256, name, quality, bounds)


def _registration_lock(name: str):
    """One registration of ``name`` at a time among the processes of this machine: the gate reads the
    champion and then moves the alias, so two at once could both find no champion (or the same one) and
    skip comparing with each other. The lock lives in ``$LRKV_HOME`` (the temporary directory if that
    cannot be written); registrations from other machines to one MLflow server are not serialized."""
    from lrkv_core.system.paths import HomeNotWritableError, setup_lock, writable_home

    try:
        directory = writable_home()
    except HomeNotWritableError:
        directory = Path(tempfile.gettempdir())
    return setup_lock(directory, f".lrkv-registry-{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.lock")


def _register_version(
    run: dict, logged: dict, sha256: str, name: str, quality: dict | None, bounds: dict
) -> dict:
    mc = client(run["tracking_uri"])
    _ensure_registered(mc, name)
    _remove_incomplete(mc, name, sha256)
    before = {alias: _alias_version(mc, name, alias) for alias in (CANDIDATE, CHAMPION)}
    tags = {SHA_TAG: sha256} | {PREVIOUS_TAG + a: v.version for a, v in before.items() if v is not None}
    if quality is not None:
        tags |= {
            PPL_TAG: repr(quality["ppl"]),
            BASE_PPL_TAG: repr(quality["base_ppl"]),
            PROTOCOL_TAG: quality["protocol"],
        }
        if quality.get("kl") is not None:
            tags[KL_TAG] = repr(quality["kl"])
    version = mc.create_model_version(
        name, logged["source"], run_id=run["run_id"], tags=tags, model_id=logged["model_id"]
    )
    try:
        ok, why = quality_gate(quality, _quality_of(before[CHAMPION]), **bounds)
        mc.set_model_version_tag(name, version.version, GATE_TAG, ("passed: " if ok else "failed: ") + why)
        mc.set_registered_model_alias(name, CANDIDATE, version.version)
        if ok:
            mc.set_registered_model_alias(name, CHAMPION, version.version)
        mc.set_model_version_tag(name, version.version, COMPLETE_TAG, "true")
    except BaseException:
        _roll_back(mc, name, version.version, before)
        raise
    aliases = [CANDIDATE, CHAMPION] if ok else [CANDIDATE]
    return {
        "name": name,
        "version": version.version,
        "aliases": aliases,
        "gate": {"passed": ok, "reason": why},
    }


def _remove_incomplete(mc, name: str, sha256: str) -> None:
    """Delete the versions of this content that a killed attempt left without ``lrkv.complete``; an alias
    one of them holds goes back to the version it named before (following ``lrkv.previous.<alias>``)."""
    stale = {
        v.version: v.tags
        for v in mc.search_model_versions(f"name='{name}'")
        if v.tags.get(SHA_TAG) == sha256 and v.tags.get(COMPLETE_TAG) != "true"
    }
    if not stale:
        return
    restore = {}
    for alias, version in mc.get_registered_model(name).aliases.items():
        previous = str(version)
        while previous in stale:  # a chain of killed attempts: back to the last complete holder
            previous = stale[previous].get(PREVIOUS_TAG + alias)
        if previous != str(version):
            restore[alias] = previous
    for version in stale:
        mc.delete_model_version(name, version)  # deleting a version drops the aliases it held
    for alias, previous in restore.items():
        if previous is not None and _version_or_none(mc.get_model_version, name, previous) is not None:
            mc.set_registered_model_alias(name, alias, previous)


def _roll_back(mc, name: str, version: str, before: dict) -> None:
    """Delete the half-made version and point the aliases back at the versions they named before."""
    mc.delete_model_version(name, version)
    for alias, old in before.items():
        if old is not None:
            mc.set_registered_model_alias(name, alias, old.version)
