"""Cache keys of the tasks: content fingerprints, the parameters that matter, and the code the step runs.

A task's key hashes its name, its parameters (artifact references carry content hashes, so an identical
re-run recomputes nothing and a killed run resumes from the last finished task) and its step code: the lrkv
version plus the fingerprint of the code the task function can run (:func:`step_code`).

The step code is computed, not listed: :class:`lrkv_core.system.code_fingerprint.CodeIndex` follows the task
function through the lrkv_core, lrkv_tasks and lrkv_kernels sources, one top-level statement at a time:

- the task function, and everything each statement it reaches reads: names of its own module, imported
  names (through re-exports: ``from lrkv_core.statistics import STATISTICS`` is ``statistics/base.py``'s
  binding, not the whole package), attributes of imported modules (``pipeline.statistic_file``, not all of
  ``pipeline.py``) and every import inside a function;
- every method registered in a registry the step reaches (``STATISTICS`` brings in every statistic class;
  a ``@X.register`` or ``register_*(...)`` at a module's top level registers into the module defining X);
- every other import-time effect of any lrkv module (``hf_quantizer``'s registration with transformers,
  the Triton interpreter patch), since importing lrkv runs them in every process.

So a change to any statement a step can run changes its key, and a change elsewhere (another step's
pipeline function, evaluation code for a statistics pass) does not. Sources are compared after dropping
docstrings, comments and formatting (:func:`lrkv_core.system.code_fingerprint.normalized_dump`). A task
function outside these packages (a test's) gets the fingerprint of all of them. :func:`code_version`, the
whole packages' hash, is provenance for MLflow only.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from prefect.context import TaskRunContext
from pydantic import BaseModel

import lrkv_core
from lrkv_core.data.datasets import parse_dataset_spec
from lrkv_core.model.loading import resolve_model_dir
from lrkv_core.system.code_fingerprint import CodeIndex
from lrkv_core.system.fingerprint import hash_bytes, hash_sources
from lrkv_core.version import __version__


@functools.cache
def code_version() -> str:
    """The lrkv version plus a hash of all lrkv_core and lrkv_tasks sources (provenance, not cache keys)."""
    sources = hash_sources(Path(lrkv_core.__file__).parent, Path(__file__).parent)
    return f"{__version__}+{sources[:16]}"


@functools.cache
def code_index() -> CodeIndex:
    """The lrkv packages whose code a step's key covers (lrkv_kernels where installed), read once per
    process: keys describe the code the process loaded, even if the files change while it runs."""
    packages = {"lrkv_core": Path(lrkv_core.__file__).parent, "lrkv_tasks": Path(__file__).parent}
    spec = importlib.util.find_spec("lrkv_kernels")
    if spec is not None and spec.submodule_search_locations:
        packages["lrkv_kernels"] = Path(next(iter(spec.submodule_search_locations)))
    return CodeIndex(packages)


def step_code(module: str, name: str) -> str:
    """The lrkv version plus the fingerprint of the code function ``module.name`` can run (module docstring);
    for a function outside the lrkv packages, that of all their code."""
    index = code_index()
    if index.is_module(module) and name in index.source(module).bindings:
        entries = [("name", module, name)]
    else:
        entries = [("module", m) for m in index.modules()]
    return f"{__version__}+{index.fingerprint(entries)[:16]}"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    return str(obj)


def fingerprint(obj: Any) -> str:
    """Hash of a JSON-able structure of parameters and artifact references (key order does not matter)."""
    return hash_bytes(json.dumps(obj, sort_keys=True, default=_jsonable).encode())


def task_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    """Cache key: task name + the code of the task's step + the (fingerprint-carrying) parameters."""
    fn = ctx.task.fn
    code = step_code(fn.__module__, fn.__name__)
    return fingerprint({"task": ctx.task.name, "code": code, "params": params})


def stat_signature(path: Path) -> list:
    """Cheap identity of files (name, size, mtime) used to decide whether to re-hash them."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def resolve_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    model_dir = resolve_model_dir(params["ref"])
    code = step_code(ctx.task.fn.__module__, ctx.task.fn.__name__)
    key = {"task": "resolve_model", "code": code, "dir": str(model_dir), "files": stat_signature(model_dir)}
    return fingerprint(key)


def _dataset_signature(dataset: str) -> object:
    """The local file behind a ``text:``/``parquet:`` spec (slices stripped), so an edited file is re-read."""
    spec = parse_dataset_spec(dataset)
    path = Path(spec.name) if spec.kind in ("text", "parquet") else None
    return stat_signature(path) if path is not None and path.exists() else dataset


def calibration_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    return task_key(ctx, {**params, "dataset_files": _dataset_signature(params["dataset"])})


def lora_run_id(params: dict[str, Any]) -> str:
    """Identity of a LoRA recovery run: the compressed model, the options, the data files, the step's code.

    The task's cache key and the directory its checkpoints go to (so a killed run resumes) both derive from
    it; the run in the store that parameter set names is always the same one.
    """
    lora = params["lora"]
    files = {name: _dataset_signature(lora[name]) for name in ("dataset", "eval_dataset") if lora[name]}
    code = step_code("lrkv_tasks.lora", "lora_recover")
    return fingerprint({"task": "lora_recover", "code": code, "params": params, "files": files})


def lora_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    return lora_run_id(params)
