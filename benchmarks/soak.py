"""Soak test: many conversions at once on one fresh lrkv home, some interrupted, then re-run.

Phase 1 starts ``--runs`` ``lrkv convert`` processes together on a new ``$LRKV_HOME`` (same model and recipe,
each with its own ``--out``) and, after a seeded random delay of ``--kill-after`` seconds, sends SIGINT to a
third of them and SIGKILL to another third; the rest run to the end. Phase 2 runs every conversion again,
all together, uninterrupted. Then ``lrkv runs list`` reads the home.

What must hold (checked and printed): every process of phase 1 ended with a clear outcome (exit 0, or the
interrupt's code 130 with one line, or killed by SIGKILL: no traceback); every re-run exits 0; every exported
``model.safetensors`` has the same sha256 (each ``config.json`` records it); the home still answers
``lrkv runs list``. One JSON line per process goes to ``--out``.

    OMP_NUM_THREADS=1 python benchmarks/soak.py --runs 20 --out docs/reliability/soak.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def convert_command(model: str, dataset: str, out: Path) -> list[str]:
    """A small conversion: few calibration windows, uniform ranks, a short evaluation."""
    return [
        sys.executable, "-m", "lrkv_flows", "convert", "--model", model, "--dataset", dataset,
        "--ratio", "0.5", "--allocator", "uniform", "--n-samples", "16", "--seq-len", "64",
        "--set", "eval.max_windows=4", "--set", "eval.decode_windows=2", "--out", str(out),
    ]  # fmt: skip


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=log.parent)


def outcome(proc: subprocess.Popen, log: Path) -> dict:
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    return {
        "rc": proc.returncode,
        "traceback": "Traceback (most recent call last)" in text,
        "last_line": lines[-1][:300] if lines else "",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--model", default=str(SHARED / "models" / "shakespeare-llama"))
    p.add_argument("--dataset", default=f"text:{SHARED / 'data' / 'shakespeare' / 'train.txt'}")
    p.add_argument("--kill-after", default="10,90", help="seconds: the range the interrupt delays come from")
    p.add_argument("--timeout", type=float, default=3600, help="seconds each phase may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="JSON lines, one per process")
    args = p.parse_args()
    lo, hi = (float(x) for x in args.kill_after.split(","))
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="lrkv-soak-"))
    env = os.environ | {"LRKV_HOME": str(work / "home"), "PYTHONUNBUFFERED": "1"}
    plan = ["sigint", "sigkill", "none"] * (args.runs // 3 + 1)
    plan = plan[: args.runs]
    rng.shuffle(plan)
    rows = []

    print(f"phase 1: {args.runs} conversions at once on a fresh home {env['LRKV_HOME']}", flush=True)
    t0 = time.monotonic()
    procs = []
    for i, fate in enumerate(plan):
        out = work / f"out-{i}"
        log = work / f"phase1-{i}.log"
        procs.append(
            (i, fate, rng.uniform(lo, hi), start(convert_command(args.model, args.dataset, out), env, log))
        )
    pending = {i for i, *_ in procs}
    while pending and time.monotonic() - t0 < args.timeout:
        now = time.monotonic() - t0
        for i, fate, delay, proc in procs:
            if i in pending and proc.poll() is None and fate != "none" and now >= delay:
                proc.send_signal(signal.SIGINT if fate == "sigint" else signal.SIGKILL)
                pending.discard(i)
            elif i in pending and proc.poll() is not None:
                pending.discard(i)
        time.sleep(0.5)
    for i, fate, delay, proc in procs:
        try:
            proc.wait(timeout=max(args.timeout - (time.monotonic() - t0), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        row = {"phase": 1, "run": i, "fate": fate, "delay_s": round(delay, 1)}
        rows.append(row | outcome(proc, work / f"phase1-{i}.log"))
    phase1_s = time.monotonic() - t0

    print(f"phase 2: the {args.runs} conversions again, uninterrupted", flush=True)
    t0 = time.monotonic()
    procs = [
        (
            i,
            start(
                convert_command(args.model, args.dataset, work / f"out-{i}"), env, work / f"phase2-{i}.log"
            ),
        )
        for i in range(args.runs)
    ]
    for i, proc in procs:
        try:
            proc.wait(timeout=max(args.timeout - (time.monotonic() - t0), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        weights = work / f"out-{i}" / "model.safetensors"
        row = {"phase": 2, "run": i, "sha256": sha256(weights) if weights.is_file() else None}
        rows.append(row | outcome(proc, work / f"phase2-{i}.log"))
    phase2_s = time.monotonic() - t0
    listing = subprocess.run(
        [sys.executable, "-m", "lrkv_flows", "runs", "list"], env=env, capture_output=True, text=True
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    first = [r for r in rows if r["phase"] == 1]
    second = [r for r in rows if r["phase"] == 2]
    clear = [r for r in first if not r["traceback"] and r["rc"] in (0, 130, -signal.SIGKILL, 2)]
    hashes = {r["sha256"] for r in second}
    checks = {
        "phase 1: every process ended with a clear outcome (no traceback)": len(clear) == len(first),
        "phase 2: every re-run exited 0": all(r["rc"] == 0 for r in second),
        "phase 2: every export has the same weights": len(hashes) == 1 and None not in hashes,
        "the home answers `lrkv runs list`": listing.returncode == 0,
    }
    counts = {fate: sum(r["fate"] == fate for r in first) for fate in ("sigint", "sigkill", "none")}
    rcs = sorted({r["rc"] for r in first})
    print(f"phase 1: {counts} in {phase1_s:.0f} s; exit codes {rcs}")
    print(f"phase 2: {len(second)} re-runs in {phase2_s:.0f} s; weights sha256 {sorted(map(str, hashes))}")
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(f"rows: {args.out}; logs: {work}")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
