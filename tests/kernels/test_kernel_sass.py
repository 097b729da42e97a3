"""The decode kernels compiled for an H100/H200 (sm_90) without a GPU, by ``benchmarks/kernel_sass.py``
(Triton's own ptxas and cuobjdump): what the interpreter, which runs the kernels' semantics but never
compiles them, cannot check. Both kernels compile for dense latents and 3-bit codes; the kernel over
latents of rotated keys keeps every value in registers (no local memory) and reads a dense tile 128 bits
at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_decode_kernels_compile_for_sm90_without_spilling_or_narrow_loads(tmp_path) -> None:
    triton = pytest.importorskip("triton", reason="the kernels need Triton (installed by scripts/setup.sh)")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no ptxas to compile for a GPU")
    out = tmp_path / "rows.jsonl"
    env = os.environ | {"TRITON_CACHE_DIR": str(tmp_path / "cache")}  # compiled here, not read from a cache
    command = [
        sys.executable,
        "benchmarks/kernel_sass.py",
        "--bits",
        "0,3",
        "--context",
        "256",
        "--batch",
        "2",
    ]
    subprocess.run(
        [*command, "--out", str(out)], cwd=ROOT, env=env, check=True, capture_output=True, timeout=900
    )
    rows = {(r["kernel"], r["bits"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {("absorbed", 0), ("absorbed", 3), ("rebuilt", 0), ("rebuilt", 3)}
    for row in rows.values():
        assert row["instructions"] > 0 and row["mma"] > 0 and row["registers"] <= 255
    assert rows["absorbed", 0]["local_bytes"] == rows["absorbed", 3]["local_bytes"] == 0
    dense = rows["absorbed", 0]
    assert 2 * dense["global_loads_128bit"] > dense["global_loads"]  # the tiles' rows, 8 bfloat16 a load
