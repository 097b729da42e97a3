"""Progress of long steps, as log lines that reach the logs wherever lrkv runs, and as bars on a terminal.

A task wraps a long step in :func:`step`, which logs when it starts, at every quarter of its progress, when
it finishes (with its duration and the process's peak resident memory while it ran, from
:mod:`lrkv_core.system.memory`), and, while it reports nothing, every :data:`HEARTBEAT_S` seconds, so a step
that is slow or has no progress to report is never silent. Each line goes to Prefect's logger of the current
task or flow run (the run's logs in the UI and on a worker's console) and to the ``lrkv`` Python logger
(which the CLI prints when its output is not a terminal; anyone may attach a handler). A reporter installed
with :func:`set_reporter` (the CLI's rich progress bars on a terminal) gets every update as well. A task's
peak is kept for its flow's table of tasks (:func:`run_peak_rss`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from lrkv_core.system.memory import gib, peak_rss

log = logging.getLogger("lrkv")

# factory(description) -> context manager yielding a (done, total) callback
_factory: Callable[[str], object] | None = None
_lock = threading.Lock()
HEARTBEAT_S = float(os.environ.get("LRKV_PROGRESS_HEARTBEAT", "60"))  # seconds of silence before a line
_PEAKS: dict[Any, int] = {}  # task run id -> the largest peak RSS of the steps it ran in this process, bytes


def set_reporter(factory: Callable[[str], object] | None) -> None:
    """Install a progress factory (``description -> context manager yielding callback(done, total)``)."""
    global _factory
    with _lock:
        _factory = factory


def current_task_run_id() -> Any:
    """The current Prefect task run's id, or None outside one (Prefect is not imported for it)."""
    if "prefect" not in sys.modules:
        return None
    from prefect.context import TaskRunContext

    ctx = TaskRunContext.get()
    return None if ctx is None else ctx.task_run.id


def run_peak_rss(task_run_id: Any) -> int | None:
    """The peak RSS (bytes) of the steps task run ``task_run_id`` ran in this process, once; None for a run
    that ran no step here (a cache hit, or a task on another worker: its log lines carry the figure)."""
    with _lock:
        return _PEAKS.pop(task_run_id, None)


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's logger of the current task or flow run (its lines reach the run's logs in the UI), else
    the ``lrkv`` logger. Prefect is not imported for it: no run is active where it is not loaded yet, and
    importing it here (the CLI's progress before it points Prefect at an API) would fix Prefect's settings
    before ``PREFECT_API_URL`` is set."""
    if "prefect" not in sys.modules:
        return log
    from prefect.context import FlowRunContext, TaskRunContext

    if TaskRunContext.get() is None and FlowRunContext.get() is None:
        return log
    from prefect.logging import get_run_logger

    return get_run_logger()


def note(message: str) -> None:
    """One line to the current run's log and the ``lrkv`` logger (a step's result, as it is known)."""
    for logger in {run_logger(), log}:
        logger.info("%s", message)


class _Lines:
    """The log lines of one step: start, each quarter, a heartbeat while quiet, the end."""

    def __init__(self, description: str, heartbeat: float) -> None:
        self.description = description
        self.loggers = {run_logger(), log}  # the run's logger (if in a run) and the lrkv logger
        self.start = self.last_line = time.monotonic()
        self.done: tuple[int, int] | None = None
        self.quarter = -1
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.heartbeat = threading.Thread(target=self._beat, args=(heartbeat,), daemon=True)
        self.memory = ExitStack()
        self.task_run = current_task_run_id()

    def emit(self, message: str, *args) -> None:
        with self.lock:
            self.last_line = time.monotonic()
        for logger in self.loggers:
            logger.info(message, *args)

    def __enter__(self) -> _Lines:
        self.emit("%s: started", self.description)
        self.watch = self.memory.enter_context(peak_rss())
        self.heartbeat.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stopped.set()
        self.heartbeat.join()
        self.memory.close()
        took, peak = time.monotonic() - self.start, self.watch.peak
        if self.task_run is not None:
            with _lock:
                _PEAKS[self.task_run] = max(peak, _PEAKS.get(self.task_run, 0))
        where = f" at {self.done[0]}/{self.done[1]}" if self.done else ""
        if exc_type is None:
            self.emit("%s: done in %.1f s, peak RSS %s", self.description, took, gib(peak))
        else:
            self.emit(
                "%s: stopped%s after %.1f s (%s), peak RSS %s",
                self.description, where, took, exc_type.__name__, gib(peak),
            )  # fmt: skip

    def advance(self, done: int, total: int) -> None:
        self.done = (done, total)
        quarter = 4 * done // max(total, 1)
        if quarter != self.quarter or done == total:
            self.quarter = quarter
            self.emit("%s: %d/%d", self.description, done, total)

    def _beat(self, every: float) -> None:
        while not self.stopped.wait(max(every / 4, 0.01)):
            with self.lock:
                quiet = time.monotonic() - self.last_line
            if quiet >= every:
                where = f" at {self.done[0]}/{self.done[1]}" if self.done else ""
                self.emit(
                    "%s: still running%s after %.0f s", self.description, where, time.monotonic() - self.start
                )


@contextmanager
def step(description: str, *, heartbeat: float | None = None) -> Iterator[Callable[[int, int], None]]:
    """``with step("stats") as advance: ... advance(done, total)``.

    Logs the step's start, each quarter of its progress, its end, and a line after every ``heartbeat``
    seconds (default :data:`HEARTBEAT_S`) without one; updates also go to the installed reporter.
    """
    with _Lines(description, HEARTBEAT_S if heartbeat is None else heartbeat) as lines:
        if _factory is None:
            yield lines.advance
            return
        with _factory(description) as show:

            def advance(done: int, total: int) -> None:
                show(done, total)
                lines.advance(done, total)

            yield advance
