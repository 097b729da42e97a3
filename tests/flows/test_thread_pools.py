"""A flow's tasks hand their threads' OpenMP pools back when they end, so the task that computes next is the
only one holding workers (lrkv_core.system.openmp; the hooks of every cached task, tasks/convert.py)."""

from __future__ import annotations

import os
import threading
import time

import torch
from prefect import flow, task
from prefect.task_runners import ThreadPoolTaskRunner

from lrkv_tasks.convert import CACHED


def _native_threads() -> int:
    """This process's OS threads that are not Python threads (OpenMP workers among them)."""
    python = {t.native_id for t in threading.enumerate()}
    return sum(1 for tid in os.listdir("/proc/self/task") if int(tid) not in python)


def _parallel_product() -> bool:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a pool with a worker, whatever the session's setting
    try:
        x = torch.arange(1 << 20, dtype=torch.float32)
        return torch.equal(x * 2, x + x)
    finally:
        torch.set_num_threads(threads)


hooks = {key: CACHED[key] for key in ("on_completion", "on_failure")}
computes = task(name="computes")(_parallel_product)
computes_and_hands_back = task(name="computes_and_hands_back", **hooks)(_parallel_product)


def _extra_threads(step, settle: float = 0.0) -> int:
    """Native threads one flow running ``step`` in its one worker thread leaves while that thread lives,
    given ``settle`` seconds to go (a released pool's workers end on their own, just after)."""

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=1))
    def one_step() -> int:
        before = _native_threads()
        assert step.submit().result()
        deadline = time.monotonic() + settle
        while _native_threads() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        return _native_threads() - before  # while the task's thread is still alive in the runner

    return one_step()


def test_a_task_leaves_no_openmp_worker_behind(prefect_api):
    _extra_threads(computes_and_hands_back)  # the first flow with torch work starts threads of its own
    assert _extra_threads(computes) == 1  # without the hooks its thread keeps a pool and its worker
    assert _extra_threads(computes_and_hands_back, 30) == 0
