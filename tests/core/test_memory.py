import threading
import time

import torch

from lrkv_core import memory


def test_a_block_sees_the_peak_of_memory_it_freed_before_it_ended():
    size = 256 * 2**20
    before = memory.current_rss()
    with memory.peak_rss() as watch:
        x = torch.ones(size // 4)  # touched: resident
        time.sleep(5 * memory.INTERVAL_S)
        del x
    assert watch.peak >= before + 0.9 * size, (before, watch.peak)
    assert memory.current_rss() < before + 0.5 * size  # it was freed: only the peak remembers it


def test_an_idle_block_reports_about_the_memory_it_started_with():
    with memory.peak_rss() as outer:
        x = torch.ones(128 * 2**20 // 4)
        held = memory.current_rss()
        with memory.peak_rss() as inner:  # opened after the allocation: nested watches share one sampler
            pass
        del x
    assert abs(inner.peak - held) < 16 * 2**20
    assert outer.peak >= inner.peak  # what the inner block saw counts for the block around it


def test_the_sampler_stops_when_no_block_is_open():
    with memory.peak_rss():
        assert any(t.name == "lrkv-rss" for t in threading.enumerate())
    deadline = time.monotonic() + 5
    while any(t.name == "lrkv-rss" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(memory.INTERVAL_S)
    assert not any(t.name == "lrkv-rss" for t in threading.enumerate())


def test_the_high_water_mark_never_falls_below_the_current_rss():
    assert memory.high_water_mark() >= memory.current_rss() > 0
    assert memory.gib(3 * 2**29) == "1.50 GiB"


def test_freed_memory_goes_back_to_the_operating_system():
    blocks = [torch.ones(2**16) for _ in range(2048)]  # 512 MiB in small allocations the allocator may keep
    held = memory.current_rss()
    del blocks
    memory.release_freed()
    assert memory.current_rss() < held - 256 * 2**20
