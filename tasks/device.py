"""The device the tasks compute on: ``LRKV_DEVICE`` (``cpu``, ``cuda``, ``cuda:N`` or ``auto``; default
``cpu``), which the CLI's ``--device`` and ``lrkv deploy --device`` set.

It is read when each task runs, never part of a task's cache key: a step computed on a GPU is the same step
on the CPU to float rounding, so a conversion started on one resumes on the other. Dask workers on other
hosts need it in their own environment (a local cluster inherits the command's).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lrkv_core.model.loading import parse_device
from lrkv_core.system.memory import release_freed

from .progress import current_task_run_id, run_logger

ENV = "LRKV_DEVICE"


def task_device() -> str:
    """``LRKV_DEVICE`` (default ``cpu``), checked: a clear error for a name torch does not know or a GPU it
    cannot see."""
    value = os.environ.get(ENV, "cpu")
    parse_device(value)
    return value


PASSES_ENV = "LRKV_MODEL_PASSES"


def pass_limit() -> int:
    """``LRKV_MODEL_PASSES`` (default 1), checked: one clear line for anything but a whole number ≥ 1."""
    value = os.environ.get(PASSES_ENV, "1")
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit < 1:
        raise ValueError(f"{PASSES_ENV} must be a whole number ≥ 1, got {value!r}")
    return limit


_PASSES: threading.BoundedSemaphore | None = None
_PASSES_LOCK = threading.Lock()
_WAITED: dict[Any, float] = {}  # task run id -> seconds it waited for a slot


@contextmanager
def model_pass() -> Iterator[None]:
    """Hold one of this process's ``LRKV_MODEL_PASSES`` slots (default 1) while a task loads a whole model
    and runs it over its data (a statistic, the refinement, an evaluation, a build).

    Each such task holds its own copy of the model, its activations and its full-vocabulary logits, and
    torch already spreads one pass over every core, so passes that run at once in one process (the thread
    runner) add their memory without finishing sooner: by default they take turns. Tasks that only read
    a layer's weights or small files (decompositions, summaries, the plan) do not wait. Dask workers are
    processes, each with its own slots."""
    global _PASSES
    with _PASSES_LOCK:
        if _PASSES is None:
            _PASSES = threading.BoundedSemaphore(pass_limit())
        slots = _PASSES
    if not slots.acquire(blocking=False):
        run_logger().info("waiting for another whole-model pass to finish (%s=%d)", PASSES_ENV, pass_limit())
        start = time.monotonic()
        slots.acquire()
        run = current_task_run_id()
        if run is not None:
            with _PASSES_LOCK:
                _WAITED[run] = _WAITED.get(run, 0.0) + time.monotonic() - start
    try:
        release_freed()  # what earlier tasks dropped (their threads' allocator arenas) leaves the RSS first
        yield
    finally:
        release_freed()  # and the model and activations this pass dropped
        slots.release()


def waited_seconds(task_run_id: Any) -> float:
    """Seconds task run ``task_run_id`` waited in this process for a model-pass slot (once; 0 if none)."""
    with _PASSES_LOCK:
        return _WAITED.pop(task_run_id, 0.0)
