"""Progress of long steps: tasks ask for a callback; the CLI installs a rich reporter, else it logs."""

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


@contextmanager
def step(description: str) -> Iterator[Callable[[int, int], None]]:
    """``with step("stats") as advance: ... advance(done, total)``."""
    if _factory is not None:
        with _factory(description) as advance:
            yield advance
        return
    last = [-1]

    def advance(done: int, total: int) -> None:
        pct = int(100 * done / max(total, 1))
        if pct // 25 != last[0] // 25 or done == total:
            last[0] = pct
            log.info("%s: %d/%d", description, done, total)

    yield advance
