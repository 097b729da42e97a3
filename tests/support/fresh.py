"""Run a test's measurement in a new Python process, where nothing earlier tests did (memory the allocator
kept, threads, caches) changes what the operating system reports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_fresh(target: str, timeout: float = 600) -> None:
    """Call ``module:function`` (no arguments) in a new interpreter with one torch thread; an assertion (or
    any error) it raises fails the calling test with the process's traceback."""
    module, function = target.split(":")
    code = f"import {module} as m; m.{function}()"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{target} failed in a fresh process:\n{proc.stderr[-4000:]}"
