"""The resident memory (RSS) a piece of work holds at its peak, as the operating system counts it.

``with peak_rss() as watch: ...`` then ``watch.peak`` (bytes): the largest RSS of this process while the
block ran. On Linux the figure is exact and needs no polling: the kernel keeps the process's high-water mark
(``VmHWM``) and lets the process reset it to the current RSS (``/proc/self/clear_refs``). Whenever a block
opens or closes (or a block's peak is read), the mark is read, counted for every block open since the last
such event, and reset; each block's peak is then the largest mark over the intervals it spanned. Blocks that
run at once in one process (threads) share the process's memory, so each sees the others' allocations: the
figure is the process's peak during the block. Where the mark cannot be reset, one background thread samples
the RSS every :data:`INTERVAL_S` for the open blocks, and the mark counts when it rose during a block; on
systems without ``/proc`` the peak is the process's high-water mark so far (``getrusage``), an upper bound.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

INTERVAL_S = 0.02
_PROC = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_RESET_PEAK = "5"  # clear_refs: set the high-water mark to the current RSS (Linux 4.0 and later)


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
    """The largest RSS this process has had since the mark was last reset, bytes (``VmHWM``; ``ru_maxrss``
    where /proc is missing)."""
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


def _reset_high_water_mark() -> bool:
    """Set the kernel's high-water mark to the current RSS; False where the system does not allow it."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write(_RESET_PEAK)
    except OSError:
        return False
    return True


class Watch:
    """One block's peak RSS so far (:attr:`peak`, bytes)."""

    def __init__(self, tracker: _Tracker) -> None:
        self.tracker = tracker
        self.open = True
        self.start_mark = high_water_mark()
        self._peak = current_rss()

    @property
    def peak(self) -> int:
        if self.open:
            self.tracker.fold()
        return self._peak

    def see(self, rss: int) -> None:
        self._peak = max(self._peak, rss)


class _Tracker:
    """The open watches, and how their peaks are taken: by resetting the kernel's mark at each event (exact),
    or by one daemon sampling thread that ends when no watch is open."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watches: set[Watch] = set()
        self.thread: threading.Thread | None = None

    def fold(self) -> None:
        """Count the mark since the last event for every open watch, then reset it (the exact way)."""
        with self.lock:
            self._fold()

    def _fold(self) -> bool:
        mark = high_water_mark()
        if not _reset_high_water_mark():
            return False
        for watch in self.watches:
            watch.see(mark)
        return True

    def open(self) -> Watch:
        with self.lock:
            exact = self._fold()
            watch = Watch(self)
            self.watches.add(watch)
            if not exact:  # sampled: a block's first reading counts for the blocks around it
                for other in self.watches:
                    other.see(watch._peak)
                if self.thread is None or not self.thread.is_alive():
                    self.thread = threading.Thread(target=self._sample, name="lrkv-rss", daemon=True)
                    self.thread.start()
            return watch

    def close(self, watch: Watch) -> None:
        with self.lock:
            if not self._fold():  # sampled: the block's last reading, and the mark if it rose meanwhile
                rss = current_rss()
                for other in self.watches:
                    other.see(rss)
                mark = high_water_mark()
                if mark > watch.start_mark:  # the process's all-time peak was reached during the block
                    watch.see(mark)
            self.watches.discard(watch)
            watch.open = False

    def _sample(self) -> None:
        while True:
            time.sleep(INTERVAL_S)
            rss = current_rss()
            with self.lock:
                if not self.watches:
                    self.thread = None
                    return
                for watch in self.watches:
                    watch.see(rss)


_TRACKER = _Tracker()


@contextmanager
def peak_rss() -> Iterator[Watch]:
    """``with peak_rss() as watch: work()`` then ``watch.peak``: the process's peak RSS while the block ran,
    bytes (the module doc)."""
    watch = _TRACKER.open()
    try:
        yield watch
    finally:
        _TRACKER.close(watch)


def release_freed() -> None:
    """Hand memory freed by Python and torch back to the operating system where the C library can (glibc's
    ``malloc_trim``): a task's model and activations, once dropped, stop counting in the process's RSS
    instead of staying in the allocator's arenas of the thread that ran it."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters
# allocator arenas a process running flows keeps (glibc's default: eight per core, one for each thread that
# meets a busy arena)
MALLOC_ARENAS = 2
ARENAS_ENV = "MALLOC_ARENA_MAX"


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Let the C library keep at most ``arenas`` allocator arenas in this process, and in the processes it
    starts (``MALLOC_ARENA_MAX``, e.g. Dask workers); a limit the user set in ``MALLOC_ARENA_MAX`` is kept.

    A flow runs each task in a worker thread of its own, and glibc gives a thread that finds the arenas busy
    a new one, up to eight per core: each keeps memory its thread freed (a model, activations) that the
    next task, in another thread, cannot reuse. With two arenas a SmolLM2 conversion's steps peaked about
    0.15–0.2 GiB lower (docs/long-context.md: calibration memory). Call it early, before the threads that
    run tasks start. False where the C library is not glibc, or the user's value is not a number (nothing
    set)."""
    if arenas < 1:
        raise ValueError(f"malloc arenas must be ≥ 1, got {arenas}")
    libc = _libc()
    if libc is None:
        return False
    try:
        wanted = int(os.environ.setdefault(ARENAS_ENV, str(arenas)))
    except ValueError:  # the user's setting, not a number: glibc ignores it, and so does this
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, wanted))


# while mapping: allocations above this many bytes get a mapping of their own (glibc's initial threshold)
MAPPED_ABOVE = 128 * 1024
# after: allocations up to this many bytes come from the heap again, and free memory above the heap's top
# returns to the system past twice that: where glibc's own moving thresholds settle once a large block has
# been freed (their maximum on 64-bit systems)
HEAP_UP_TO = 32 * 2**20
_mapping = {"depth": 0}
_mapping_lock = threading.Lock()


@contextmanager
def mapped_allocations(on: bool = True) -> Iterator[None]:
    """While open (and ``on``), every allocation of more than :data:`MAPPED_ABOVE` bytes is a mapping of its
    own (glibc's ``M_MMAP_THRESHOLD``), handed back to the operating system the moment it is freed.

    A gradient pass over a long row keeps every layer's input and k/v outputs until its backward pass while
    it frees each layer's larger temporaries; on the heap those holes between the kept blocks are not
    reused by the next, larger temporaries, and the RSS climbs by the holes (about 1 GiB in a conversion's
    refinement at 2,048 tokens). Mapped, they cost a page fault per page instead: the pass runs 10–20 %
    slower, so this is for long rows only. The setting is the process's; nested and concurrent blocks
    share it, and the last to close sets the limits back (:data:`HEAP_UP_TO`). A no-op where the C library is
    not glibc."""
    libc = _libc() if on else None
    if libc is None:
        yield
        return
    with _mapping_lock:
        _mapping["depth"] += 1
        if _mapping["depth"] == 1:
            libc.mallopt(_M_MMAP_THRESHOLD, MAPPED_ABOVE)
    try:
        yield
    finally:
        with _mapping_lock:
            _mapping["depth"] -= 1
            if _mapping["depth"] == 0:
                libc.mallopt(_M_MMAP_THRESHOLD, HEAP_UP_TO)
                libc.mallopt(_M_TRIM_THRESHOLD, 2 * HEAP_UP_TO)


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
