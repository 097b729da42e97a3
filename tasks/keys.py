"""Cache keys of the tasks: content fingerprints, the parameters that matter, and the code version.

The code version is the lrkv version plus a hash of the lrkv_core and lrkv_tasks sources, so a changed
algorithm never reuses results of the old one; fingerprints come from the artifacts' content hashes, so an
identical re-run recomputes nothing and a killed run resumes from the last finished task.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from prefect.context import TaskRunContext
from pydantic import BaseModel

import lrkv_core
from lrkv_core.data import parse_dataset_spec
from lrkv_core.fingerprint import hash_bytes, hash_sources
from lrkv_core.models import resolve_model_dir
from lrkv_core.version import __version__


@functools.cache
def code_version() -> str:
    """The lrkv version plus a fingerprint of the code that computes results (lrkv_core, lrkv_tasks)."""
    sources = hash_sources(Path(lrkv_core.__file__).parent, Path(__file__).parent)
    return f"{__version__}+{sources[:16]}"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    return str(obj)


def fingerprint(obj: Any) -> str:
    """Hash of a JSON-able structure of parameters and artifact references (key order does not matter)."""
    return hash_bytes(json.dumps(obj, sort_keys=True, default=_jsonable).encode())


def task_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    """Cache key: task name + code version + the (fingerprint-carrying) parameters."""
    return fingerprint({"task": ctx.task.name, "code": code_version(), "params": params})


def stat_signature(path: Path) -> list:
    """Cheap identity of files (name, size, mtime) used to decide whether to re-hash them."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def resolve_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    model_dir = resolve_model_dir(params["ref"])
    return fingerprint({"task": "resolve_model", "dir": str(model_dir), "files": stat_signature(model_dir)})


def _dataset_signature(dataset: str) -> object:
    """The local file behind a ``text:``/``parquet:`` spec (slices stripped), so an edited file is re-read."""
    spec = parse_dataset_spec(dataset)
    path = Path(spec.name) if spec.kind in ("text", "parquet") else None
    return stat_signature(path) if path is not None and path.exists() else dataset


def calibration_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    return task_key(ctx, {**params, "dataset_files": _dataset_signature(params["dataset"])})


def lora_run_id(params: dict[str, Any]) -> str:
    """Identity of a LoRA recovery run: the compressed model, the options, the data files, the code version.

    The task's cache key and the directory its checkpoints go to (so a killed run resumes) both derive from
    it; the run in the store that parameter set names is always the same one.
    """
    lora = params["lora"]
    files = {name: _dataset_signature(lora[name]) for name in ("dataset", "eval_dataset") if lora[name]}
    return fingerprint({"task": "lora_recover", "code": code_version(), "params": params, "files": files})


def lora_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    return lora_run_id(params)
