"""Model references to remote artifacts, plugged into lrkv_core's resolver by entry points (pyproject.toml):

- ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``: a version in the MLflow model registry lrkv logs to
  (``$MLFLOW_REGISTRY_URI``, else ``$MLFLOW_TRACKING_URI``, else lrkv's local SQLite under ``$LRKV_HOME``),
  downloaded from the version's own artifact location: MLflow's resolution of a ``models:/`` URI would
  look in its global registry instead (a ``./mlflow.db`` when nothing is configured);
- ``s3://bucket/prefix/models/<sha256>``: a model directory in an S3 artifact store.

So ``lrkv_core.load_compressed("models:/lrkv-llama@champion")`` and ``load_model`` work once lrkv is
installed, without lrkv_core importing MLflow or boto3. Both download into a local cache under
``$LRKV_HOME/cache`` keyed by content (the version's ``lrkv.sha256`` tag; the store's content hash), through a
temporary directory that is renamed into place only after the content hash was verified: a partial
download is never used, and a second resolution of the same content downloads nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import yaml

from lrkv_core.system.fingerprint import hash_dir
from lrkv_core.system.paths import lrkv_home, writable_home

from .mlflow_runs import client, tracking_uri
from .model_registry import SHA_TAG, _alias_version

_MODELS_REF = re.compile(r"/?(?P<name>[^/@]+)(?:@(?P<alias>[\w-]+)|/(?P<version>\d+))")


class RegistryLookupError(ValueError):
    """A registered model, version or alias that does not exist (one line, naming what exists)."""


def registered_version(ref: str):
    """The MLflow ``ModelVersion`` that ``NAME@ALIAS`` or ``NAME/VERSION`` names."""
    m = _MODELS_REF.fullmatch(ref.removeprefix("models:"))
    if m is None:
        raise RegistryLookupError(
            f"bad registered model reference {ref!r}: use models:/NAME@ALIAS or NAME/VERSION"
        )
    from mlflow.exceptions import MlflowException

    mc, name = client(), m["name"]
    try:
        model = mc.get_registered_model(name)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise RegistryLookupError(f"no registered model {name!r} at {tracking_uri()}") from None
        raise
    if m["alias"]:
        version = _alias_version(mc, name, m["alias"])
        if version is None:
            known = ", ".join(f"{a}→v{v}" for a, v in sorted(model.aliases.items())) or "none"
            raise RegistryLookupError(f"model {name!r} has no alias {m['alias']!r} (aliases: {known})")
        return version
    try:
        return mc.get_model_version(name, m["version"])
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise RegistryLookupError(f"model {name!r} has no version {m['version']}") from None
        raise


def resolve_registered_model(rest: str) -> Path:
    """Local directory of the lrkv model a ``models:`` reference names (downloaded once, verified)."""
    return _download_version(rest, "models", whole=False)


def resolve_registered_mlflow_model(ref: str) -> Path:
    """Local directory of the whole MLflow model (MLmodel + data) a ``models:`` reference names."""
    return _download_version(ref, "mlflow-models", whole=True)


def _download_version(ref: str, folder: str, whole: bool) -> Path:
    """Download the registered MLflow model ``ref`` names once into ``$LRKV_HOME/cache/<folder>/<sha256>``
    (its lrkv data directory, or with ``whole`` the MLflow model directory), renamed into place after the
    content hash (the version's ``lrkv.sha256`` tag) was checked."""
    import mlflow.artifacts

    version = registered_version(ref)
    sha = version.tags.get(SHA_TAG)
    if not sha:
        raise RegistryLookupError(
            f"{version.name} v{version.version} is not an lrkv model (no {SHA_TAG} tag)"
        )
    dest = lrkv_home() / "cache" / folder / sha
    if dest.is_dir():
        return dest
    writable_home()  # one clear error if the download has nowhere to go
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{sha[:12]}."))
    try:
        source = client().get_model_version_download_uri(version.name, version.version)
        model = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=source, dst_path=str(tmp), tracking_uri=tracking_uri()
            )
        )
        mlmodel = yaml.safe_load((model / "MLmodel").read_text())
        data = model / mlmodel["flavors"]["python_function"]["data"]
        got = hash_dir(data)
        if got != sha:
            raise OSError(
                f"{version.name} v{version.version}: downloaded model hash {got[:12]}… is not {sha[:12]}…"
            )
        os.replace(model if whole else data, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve_s3_model(rest: str) -> Path:
    """Local directory of a model directory artifact in an S3 store (``s3://bucket/.../models/<sha256>``)."""
    from ..store.s3 import S3Store

    uri = f"s3:{rest}"
    return S3Store.for_uri(uri).local(uri)


def load_pyfunc(model_uri: str):
    """``mlflow.pyfunc.load_model`` of a registered lrkv model: ``models:/NAME@ALIAS`` or ``NAME/VERSION``
    resolved in lrkv's registry (``$MLFLOW_REGISTRY_URI``, else ``$MLFLOW_TRACKING_URI``, else the local
    SQLite under ``$LRKV_HOME``); other URIs go to MLflow as given."""
    import mlflow.pyfunc

    if model_uri.startswith("models:/"):
        model_uri = str(resolve_registered_mlflow_model(model_uri))
    return mlflow.pyfunc.load_model(model_uri)
