"""The resident memory (RSS) a piece of work holds at its peak, as the operating system counts it.

``with peak_rss() as watch: ...`` then ``watch.peak`` (bytes): the largest RSS of this process seen while the
block ran. One background thread samples the RSS for every open watch (every :data:`INTERVAL_S`), and on
exit the kernel's own high-water mark (``VmHWM``) is read too: if it rose while the block ran, the process
reached a new peak then, and that exact figure counts. Blocks that run at once in one process (threads)
share the process's memory, so each sees the others' allocations: the figure is the process's peak during
the block. On systems without ``/proc`` the peak is the process's high-water mark so far
(``getrusage``), which can only be an upper bound of the block's.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import resource
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

INTERVAL_S = 0.02
_PROC = "/proc/self/status"


def _status_kb(field: str) -> int | None:
    try:
        with open(_PROC) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int:
    """This process's resident set size now, bytes (its high-water mark so far where /proc is missing)."""
    kb = _status_kb("VmRSS")
    return kb * 1024 if kb is not None else high_water_mark()


def high_water_mark() -> int:
    """The largest RSS this process has had, bytes (``VmHWM``; ``ru_maxrss`` where /proc is missing)."""
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


class Watch:
    """One block's peak RSS so far (:attr:`peak`, bytes)."""

    def __init__(self) -> None:
        self.start_mark = high_water_mark()
        self.peak = current_rss()

    def see(self, rss: int) -> None:
        self.peak = max(self.peak, rss)

    def close(self) -> None:
        self.see(current_rss())
        mark = high_water_mark()
        if mark > self.start_mark:  # the process's all-time peak was reached during the block
            self.see(mark)


class _Sampler:
    """One daemon thread sampling the RSS for every open watch; it ends when none is open."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watches: set[Watch] = set()
        self.running = False

    def add(self, watch: Watch) -> None:
        with self.lock:
            self.watches.add(watch)
            if not self.running:
                self.running = True
                threading.Thread(target=self._run, name="lrkv-rss", daemon=True).start()

    def tell(self, rss: int) -> None:
        """A reading taken outside the thread counts for every open watch."""
        with self.lock:
            for watch in self.watches:
                watch.see(rss)

    def remove(self, watch: Watch) -> None:
        with self.lock:
            self.watches.discard(watch)

    def _run(self) -> None:
        while True:
            time.sleep(INTERVAL_S)
            rss = current_rss()
            with self.lock:
                if not self.watches:
                    self.running = False
                    return
            self.tell(rss)


_SAMPLER = _Sampler()


@contextmanager
def peak_rss() -> Iterator[Watch]:
    """``with peak_rss() as watch: work()`` then ``watch.peak``: the process's peak RSS while the block ran,
    bytes (the module doc)."""
    watch = Watch()
    _SAMPLER.add(watch)
    _SAMPLER.tell(watch.peak)  # a block's first and last readings count for the blocks around it
    try:
        yield watch
    finally:
        _SAMPLER.tell(current_rss())
        _SAMPLER.remove(watch)
        watch.close()


def release_freed() -> None:
    """Hand memory freed by Python and torch back to the operating system where the C library can (glibc's
    ``malloc_trim``): a task's model and activations, once dropped, stop counting in the process's RSS
    instead of staying in the allocator's arenas of the thread that ran it."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, loaded once; None where it is not the C library (nothing to trim)."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def gib(n_bytes: int | float) -> str:
    """``1.23 GiB``."""
    return f"{n_bytes / 2**30:.2f} GiB"
