"""A thread hands its OpenMP pool back when its torch work ends (lrkv_core.system.openmp)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# In a fresh process: the main thread runs a parallel product (its pool: one worker), then a second thread
# runs one too and, with argv[1] == "release", hands its pool back; while that thread is still alive the
# process's OS threads are counted (the main thread's count plus the second thread, plus its worker if its
# pool is still there). The workers of a released pool end on their own: counted until they have, or 30 s.
_POOLS = """
import json, os, sys, threading, time
import torch
from lrkv_core.system.openmp import release_thread_pool

torch.set_num_threads(2)
x = torch.arange(1 << 20, dtype=torch.float32)

def threads():
    return len(os.listdir("/proc/self/task"))

assert torch.equal(x * 2, x + x)  # the main thread's pool
before = threads()
ready, done, out = threading.Event(), threading.Event(), {}

def work():
    out["right"] = torch.equal(x * 3, x + x + x)
    if sys.argv[1] == "release":
        out["released"] = release_thread_pool()
        out["threads_after"] = torch.get_num_threads()
    ready.set()
    done.wait()
    out["right_after"] = torch.equal(x * 4, x + x + x + x)  # a new pool

thread = threading.Thread(target=work)
thread.start()
ready.wait()
deadline = time.monotonic() + 30
while sys.argv[1] == "release" and threads() > before + 1 and time.monotonic() < deadline:
    time.sleep(0.05)
out["extra"] = threads() - before
done.set()
thread.join()
print(json.dumps(out))
"""


def _pools(mode: str) -> dict:
    run = subprocess.run([sys.executable, "-c", _POOLS, mode], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_a_thread_that_hands_its_pool_back_leaves_only_itself_and_keeps_its_thread_count():
    kept = _pools("keep")
    assert kept["extra"] == 2 and kept["right"] and kept["right_after"]  # the thread and its pool's worker
    released = _pools("release")
    if not released["released"]:
        pytest.skip("torch here does not run on a libgomp that can hand a pool back")
    assert released["extra"] == 1  # the thread alone: its worker is gone
    assert released["threads_after"] == 2
    assert released["right"] and released["right_after"]  # its next product makes a new pool, and is right
