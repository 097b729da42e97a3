"""Progress of long steps: tasks ask for a callback; the CLI installs a rich reporter; milestones are
logged to the Prefect run (the UI shows them)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("lrkv")

# factory(description) -> context manager yielding a (done, total) callback
_factory: Callable[[str], object] | None = None
_lock = threading.Lock()


def set_reporter(factory: Callable[[str], object] | None) -> None:
    """Install a progress factory (``description -> context manager yielding callback(done, total)``)."""
    global _factory
    with _lock:
        _factory = factory


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's logger of the current task or flow run (its lines reach the run's logs in the UI), else
    the ``lrkv`` logger."""
    from prefect.context import FlowRunContext, TaskRunContext

    if TaskRunContext.get() is None and FlowRunContext.get() is None:
        return log
    from prefect.logging import get_run_logger

    return get_run_logger()


@contextmanager
def step(description: str) -> Iterator[Callable[[int, int], None]]:
    """``with step("stats") as advance: ... advance(done, total)``.

    Progress goes to the installed reporter (the CLI's progress bars) and, every quarter, to the run's log.
    """
    logger = run_logger()
    last = [-1]

    def milestone(done: int, total: int) -> None:
        pct = int(100 * done / max(total, 1))
        if pct // 25 != last[0] // 25 or done == total:
            last[0] = pct
            logger.info("%s: %d/%d", description, done, total)

    if _factory is None:
        yield milestone
        return
    with _factory(description) as show:

        def advance(done: int, total: int) -> None:
            show(done, total)
            milestone(done, total)

        yield advance
