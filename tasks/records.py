"""Cached task results that hold no executable data and never point at deleted artifacts.

Task results are persisted as JSON (Prefect's ``json`` serializer): dicts of numbers and strings, and
:class:`~lrkv_tasks.store.artifacts.ArtifactRef` objects, which Prefect's JSON encoder writes as
``{"__class__": "lrkv_tasks.store.artifacts.ArtifactRef", "data": {...}}``. Prefect reads a record with
whatever serializer the record itself names, so a writable shared store could otherwise hand it a pickle.
Before Prefect looks a key up, :func:`checked` reads the record itself (as plain JSON, never unpickling or
importing anything) and accepts it only if

- it names the ``json`` serializer and every ``__class__`` in it is one of :data:`ALLOWED_CLASSES`;
- every artifact it references still exists and, in a local store, still hashes to the sha256 its name
  records (a deleted or corrupt store file means the task is computed again).

A record that fails is expired in place (its metadata gets an expiration in the past, which Prefect treats
as a miss), so the task runs and writes a fresh record under the same key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from prefect.context import TaskRunContext

from .progress import run_logger
from .store.artifact_store import ArtifactStore, artifact_problem, open_store
from .store.artifacts import ArtifactRef

REF_CLASS = f"{ArtifactRef.__module__}.{ArtifactRef.__qualname__}"
ALLOWED_CLASSES = frozenset({REF_CLASS})
URI_META_KEYS = ("heatmap", "history", "loss_curve")  # meta fields of a ref naming further artifacts
EXPIRED = {
    "metadata": {"expiration": "1970-01-01T00:00:00Z", "serializer": {"type": "json"}, "storage_key": None},
    "result": "null",
}


class UnsafeRecord(ValueError):
    """A result record that is not plain JSON of allowed classes."""


def _walk(obj: Any) -> Iterator[dict]:
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


def parse_record(raw: bytes) -> list[ArtifactRef]:
    """The artifact references in a result record; :class:`UnsafeRecord` if it is not safe JSON."""
    try:
        record = json.loads(raw)
        serializer = record["metadata"]["serializer"]["type"]
        result = record["result"]
    except (ValueError, KeyError, TypeError) as err:
        raise UnsafeRecord(f"not a JSON result record ({err})") from None
    if serializer != "json" or not isinstance(result, str):
        raise UnsafeRecord(f"serializer {serializer!r} (only 'json' is read)")
    try:
        value = json.loads(result)
    except ValueError as err:
        raise UnsafeRecord(f"result is not JSON ({err})") from None
    refs = []
    for node in _walk(value):
        if "__exc_type__" in node:
            raise UnsafeRecord("records an exception type")
        if "__class__" in node:
            if node["__class__"] not in ALLOWED_CLASSES:
                raise UnsafeRecord(f"names class {node['__class__']!r}")
            refs.append(ArtifactRef.model_validate(node["data"]))
    return refs


def ref_uris(ref: ArtifactRef) -> list[str]:
    """Every artifact a reference stands for (its own URI and those its meta names)."""
    return [ref.uri] + [ref.meta[k] for k in URI_META_KEYS if isinstance(ref.meta.get(k), str)]


def stale_reason(store: ArtifactStore, key: str) -> str | None:
    """Why the record at ``key`` must not be used (None: absent, or safe and complete)."""
    raw = store.read_record(key)
    if raw is None:
        return None
    try:
        refs = parse_record(raw)
    except UnsafeRecord as err:
        return f"unsafe record: {err}"
    if json.loads(raw)["metadata"].get("expiration") == EXPIRED["metadata"]["expiration"]:
        return None  # already expired by us: Prefect treats it as a miss
    problems = [(uri, artifact_problem(uri)) for ref in refs for uri in ref_uris(ref)]
    reasons = [
        f"artifacts {problem}: {', '.join(uri for uri, p in problems if p == problem)}"
        for problem in ("missing", "corrupt")
        if any(p == problem for _, p in problems)
    ]
    return "; ".join(reasons) or None


def checked(key_fn: Callable[[TaskRunContext, dict], str]) -> Callable[[TaskRunContext, dict], str]:
    """Wrap a ``cache_key_fn`` so a hit is only ever served from a safe, complete record."""

    def key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
        value = key_fn(ctx, params)
        store = open_store(params.get("store"))
        reason = stale_reason(store, value)
        if reason is not None:
            run_logger().warning(
                "%s: cached result %s not used (%s); computing it again", ctx.task.name, value, reason
            )
            store.write_record(value, json.dumps(EXPIRED).encode())
        return value

    key.__name__ = key_fn.__name__
    return key
