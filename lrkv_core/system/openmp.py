"""The OpenMP thread pools of the threads that run torch's CPU kernels.

torch's CPU kernels run on OpenMP; its Linux builds ship GNU libgomp. libgomp gives every thread that starts
a parallel region a pool of worker threads of its own, keeps it until that thread exits, and counts the
workers of every pool. While that count exceeds the CPUs, each worker spins only 100 times (instead of
300,000) before it sleeps after a region, so every region after a short pause has to wake its workers
first. A pass over a model is thousands of small regions (one per elementwise operation and norm): once a
second thread has run torch work while the first still holds its pool (the flow's task threads, a script's
worker thread beside its main thread), the whole pass slows down. On the 2-core machine a small
elementwise product took 72 µs instead of 14, a gradient pass of SmolLM2 1.3–1.5× as long
(``benchmarks/thread_pools.py``).

:func:`release_thread_pool` hands the calling thread's pool back (``omp_pause_resource_all``, OpenMP 5.0):
a thread that has finished its torch work (a flow's task) no longer counts, and its next parallel region
starts a new pool (a few microseconds). Another thread's pool is never touched.
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the pool's threads end; nothing else the runtime holds is lost
_MAPS = "/proc/self/maps"


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process's torch runs on (loaded by torch, found in the process's mappings), if it
    offers ``omp_pause_resource_all``; None elsewhere (macOS and Windows builds use other runtimes)."""
    import torch  # noqa: F401  (loads its OpenMP runtime)

    try:
        with open(_MAPS) as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith("libgomp") and os.path.exists(path):
            lib = ctypes.CDLL(path)  # the mapped library itself: dlopen of a loaded path returns it
            if hasattr(lib, "omp_pause_resource_all"):
                lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                return lib
    return None


def release_thread_pool() -> bool:
    """Hand the calling thread's OpenMP worker threads back, keeping its thread count; True if released,
    False where torch does not run on a libgomp that can (nothing changes then). Call it from Python, after
    the thread's torch work: its next operation makes a new pool."""
    lib = _libgomp()
    if lib is None:
        return False
    import torch

    threads = torch.get_num_threads()
    released = lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    if torch.get_num_threads() != threads:  # a runtime that forgets the thread's setting with its pool
        torch.set_num_threads(threads)
    return released
