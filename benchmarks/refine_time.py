"""How long the plan's refinement takes: with and without the original's hidden states kept between passes,
or with each candidate measured by a forward pass of its own or by the pass that prices the next step.

The KL objective reads the original model's predictions on every refinement row at every use: the first
measured value, then each step's costs and measured value. :func:`lrkv_core.conversion.refine.refine_plan`
keeps the original's last hidden states (up to ``ORIGINAL_BYTES``) so its decoder stack runs once per row
(``--compare original``). It also measures each candidate plan in the pass that prices the step after it
(``--compare measuring``): one forward pass per row and step less. This script plans a conversion of a real
model (uniform ranks at ``--ratio``: the starting plan), then refines it on ``--rows`` calibration rows each
way, alternating, ``--repeats`` times, and prints the seconds, their ratio and whether the plans and
measured values are the same (they must be identical for ``original``; for ``measuring`` the same plan and
values within float rounding where every step is kept).

    OMP_NUM_THREADS=1 python benchmarks/refine_time.py --threads 1 \\
        --model ~/.cache/lrkv-assets/smollm2-135m --text ../shared/data/wikitext-2/valid.txt
    OMP_NUM_THREADS=2 python benchmarks/refine_time.py --threads 2 --compare measuring --objective nll \\
        --steps 3 --rows 16
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from lrkv_core.conversion.refine import ORIGINAL_BYTES, refine_plan
from lrkv_core.data.datasets import calibration_windows
from lrkv_core.model.loading import load_model


def rows_parser(description: str, rows: int, help_rows: str) -> argparse.ArgumentParser:
    """The options of a benchmark over calibration rows of a real model: --model, --text, --rows, --seq-len,
    --batch-size, --threads (read by :func:`load_rows`)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=os.path.expanduser("~/.cache/lrkv-assets/smollm2-135m"))
    p.add_argument(
        "--text", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext-2/valid.txt")
    )
    p.add_argument("--rows", type=int, default=rows, help=help_rows)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1, help="rows per pass (the flow's at 256 tokens: 1)")
    p.add_argument("--threads", type=int, default=None)
    return p


def load_rows(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model and ``--rows`` calibration windows of ``--seq-len`` tokens of ``--text`` ``[:80%]``."""
    for path in (args.model, args.text):
        if not Path(path).exists():
            p.error(f"{path} does not exist")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    rows = calibration_windows(
        f"text:{args.text}[:80%]", tok, n_samples=args.rows, seq_len=args.seq_len, seed=0
    )
    return model, rows


def main() -> None:
    p = rows_parser(__doc__.splitlines()[0], 32, "refinement rows (the default conversion: 128)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--objective", choices=["kl", "nll"], default="kl")
    p.add_argument("--compare", choices=["original", "measuring"], default="original")
    args = p.parse_args()
    model, rows = load_rows(p, args)
    start = time.perf_counter()
    conv = plan_conversion(model, rows, CompressionConfig(ratio=args.ratio, allocator="uniform"))
    print(
        f"{Path(args.model).name}: {args.rows} rows of {args.seq_len} tokens, {args.steps} {args.objective} "
        f"steps, {args.batch_size} row(s) per pass, {torch.get_num_threads()} thread(s); starting plan in "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )
    config = {"steps": args.steps, "objective": args.objective, "rows": args.rows}
    ways = {  # label: refine_plan's keywords
        "original": {
            "recomputed at every use": {"original_bytes": 0},
            f"kept (≤ {ORIGINAL_BYTES // 2**20} MiB)": {"original_bytes": ORIGINAL_BYTES},
        },
        "measuring": {
            "a forward pass of its own": {"measure_while_pricing": False},
            "the next step's pricing pass": {"measure_while_pricing": True},
        },
    }[args.compare]
    seconds: dict[str, list[float]] = {label: [] for label in ways}
    plans = {}
    for _ in range(args.repeats):
        for label, keywords in ways.items():
            start = time.perf_counter()
            plans[label] = refine_plan(
                model, conv.factors, conv.plan, rows, config, batch_size=args.batch_size, **keywords
            )
            seconds[label].append(time.perf_counter() - start)
            print(f"  {label}: {seconds[label][-1]:.1f} s", flush=True)
    (first, one), (_, other) = plans.items()
    steps = [s for plan in (one, other) for s in plan.details["refine"]["steps"]]
    print(f"steps kept: {[s.get('kept') for s in one.details['refine']['steps'][1:]]}")
    print(f"measured {args.objective} (each way in turn): {[round(s[args.objective], 6) for s in steps]}")
    column = {"original": "original's hidden states", "measuring": "a candidate measured by"}[args.compare]
    print(f"| {column} | seconds (best) | ratio |")
    print("|---|---|---|")
    base = min(seconds[first])
    for label in ways:
        print(f"| {label} | {min(seconds[label]):.1f} | {min(seconds[label]) / base:.3f} |")
    print(f"same plans: {one.ranks == other.ranks}")
    print(f"identical measured values: {one.details['refine'] == other.details['refine']}")


if __name__ == "__main__":
    main()
