"""Peak RSS per block. The measurements run in a fresh process each (tests.support.fresh): in a long test
session the allocator may serve a large tensor from memory it kept, and then no RSS moves at all."""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from lrkv_core.system import memory
from tests.support.fresh import run_fresh

SIZE = 256 * 2**20
exact = pytest.mark.skipif(
    not memory._reset_high_water_mark(), reason="the system lets no process reset its RSS high-water mark"
)


def _until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(memory.INTERVAL_S)


def _sampled() -> None:
    """The way taken where the kernel's mark cannot be reset: a sampling thread."""
    memory._CLEAR_REFS = "/nonexistent/clear_refs"


def _peak_freed_at_once() -> None:
    before = memory.current_rss()
    with memory.peak_rss() as watch:
        assert memory._TRACKER.thread is None  # nothing polls
        x = torch.ones(SIZE // 4)  # touched: resident
        del x
    assert watch.peak >= before + 0.9 * SIZE, (before, watch.peak)
    assert memory.current_rss() < before + 0.5 * SIZE  # it was freed: only the peak remembers it


def _blocks_at_once() -> None:
    x = torch.ones(SIZE // 4)
    del x  # a peak before any block: the process's all-time mark, which no block below may report
    before = memory.current_rss()
    with memory.peak_rss() as outer:
        with memory.peak_rss() as first:
            pass
        x = torch.ones(SIZE // 4)
        with memory.peak_rss() as inner:  # opened while x is held
            del x
        with memory.peak_rss() as last:
            pass
        assert outer.peak >= before + 0.9 * SIZE  # read while the block is open
    assert first.peak < before + 0.5 * SIZE and last.peak < before + 0.5 * SIZE, (
        before,
        first.peak,
        last.peak,
    )
    assert inner.peak >= before + 0.9 * SIZE
    assert outer.peak >= inner.peak


def _sampler_sees_the_peak() -> None:
    _sampled()
    before = memory.current_rss()
    with memory.peak_rss() as watch:
        x = torch.ones(SIZE // 4)
        _until(lambda: watch.peak >= before + 0.9 * SIZE)  # however busy the machine, the sampler comes
        del x
    assert watch.peak >= before + 0.9 * SIZE, (before, watch.peak)


def _sampler_stops() -> None:
    _sampled()
    with memory.peak_rss():
        assert any(t.name == "lrkv-rss" for t in threading.enumerate())
    _until(lambda: not any(t.name == "lrkv-rss" for t in threading.enumerate()))
    assert not any(t.name == "lrkv-rss" for t in threading.enumerate())
    with memory.peak_rss():  # and starts again for the next one
        assert any(t.name == "lrkv-rss" for t in threading.enumerate())


def _freed_memory_goes_back() -> None:
    blocks = [torch.ones(2**16) for _ in range(2048)]  # 512 MiB in small allocations the allocator may keep
    held = memory.current_rss()
    del blocks
    memory.release_freed()
    assert memory.current_rss() < held - 256 * 2**20


def _mapped_temporaries_leave_no_holes() -> None:
    """A loop keeps 64 blocks of 1 MiB, each allocated while a temporary is alive that is freed next and is
    larger than every one before it (as in a long row's gradient pass): on the heap no earlier hole fits the
    next temporary, and the holes between the kept blocks would count in the RSS (up to 632 MiB)."""
    raised = torch.ones(24 * 2**20 // 4)  # freed: glibc's moving threshold takes blocks ≤ 24 MiB to the heap
    del raised
    memory.release_freed()
    start, kept = memory.current_rss(), []
    with memory.mapped_allocations(), memory.mapped_allocations():  # nested blocks share the setting
        for i in range(64):
            temporary = torch.ones((2 * 2**20 + i * 2**18) // 4)
            kept.append(torch.ones(2**18))
            del temporary
        grown = memory.current_rss() - start
    assert grown < (64 + 16) * 2**20, grown / 2**20


@pytest.mark.skipif(memory._libc() is None, reason="the C library is not glibc: nothing to set")
def test_temporaries_freed_between_kept_blocks_go_back_while_allocations_are_mapped():
    run_fresh("tests.core.test_memory:_mapped_temporaries_leave_no_holes")


@exact
def test_a_block_sees_a_peak_it_freed_at_once_without_any_sampling():
    run_fresh("tests.core.test_memory:_peak_freed_at_once")


@exact
def test_blocks_at_once_see_each_others_peaks_and_none_from_before_they_opened():
    run_fresh("tests.core.test_memory:_blocks_at_once")


def test_where_the_mark_cannot_be_reset_a_sampler_sees_the_peak():
    run_fresh("tests.core.test_memory:_sampler_sees_the_peak")


def test_the_sampler_stops_when_no_block_is_open():
    run_fresh("tests.core.test_memory:_sampler_stops")


def test_freed_memory_goes_back_to_the_operating_system():
    run_fresh("tests.core.test_memory:_freed_memory_goes_back")


def test_an_idle_block_reports_about_the_memory_it_started_with():
    with memory.peak_rss() as outer:
        x = torch.ones(128 * 2**20 // 4)
        held = memory.current_rss()
        with memory.peak_rss() as inner:  # opened after the allocation
            pass
        del x
    assert abs(inner.peak - held) < 16 * 2**20
    assert outer.peak >= inner.peak  # what the inner block saw counts for the block around it


def test_the_high_water_mark_never_falls_below_the_current_rss():
    assert memory.high_water_mark() >= memory.current_rss() > 0
    assert memory.gib(3 * 2**29) == "1.50 GiB"


_ARENAS = """
import ctypes, sys, threading
from lrkv_core.system import memory
if sys.argv[1] != "none":
    assert memory.limit_malloc_arenas(int(sys.argv[1]))
together = threading.Barrier(8)
def work():  # every thread allocates while the others hold the arenas they allocated from
    blocks = [ctypes.create_string_buffer(4096) for _ in range(64)]
    together.wait()
    del blocks
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
ctypes.CDLL("libc.so.6").malloc_stats()  # one "Arena N:" block per arena, on standard error
"""


def _arenas(limit: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != memory.ARENAS_ENV}
    run = subprocess.run([sys.executable, "-c", _ARENAS, limit], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return sum(line.startswith("Arena ") for line in run.stderr.splitlines())


@pytest.mark.skipif(memory._libc() is None, reason="the C library is not glibc: nothing to limit")
def test_a_process_that_limits_its_malloc_arenas_keeps_that_many_while_threads_allocate():
    """Eight threads that allocate get arenas of their own (glibc: up to eight per core), but not once the
    process has limited them."""
    assert _arenas("none") > 2
    assert _arenas("2") <= 2
    assert _arenas("1") == 1


def test_a_user_setting_of_the_malloc_arenas_is_kept(monkeypatch):
    """The limit goes into the environment the processes it starts inherit, unless the user set one there
    (a value that is not a number is left alone too); fewer than one arena is refused."""
    monkeypatch.setenv(memory.ARENAS_ENV, "3")
    memory.limit_malloc_arenas()
    assert os.environ[memory.ARENAS_ENV] == "3"
    monkeypatch.setenv(memory.ARENAS_ENV, "many")
    assert memory.limit_malloc_arenas() is False
    monkeypatch.delenv(memory.ARENAS_ENV)
    if memory._libc() is not None:
        assert memory.limit_malloc_arenas() is True
        assert os.environ[memory.ARENAS_ENV] == str(memory.MALLOC_ARENAS)
    with pytest.raises(ValueError, match="≥ 1"):
        memory.limit_malloc_arenas(0)
