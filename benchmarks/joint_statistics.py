"""How long the default decomposition's three statistics take collected in one pass against one pass each.

The default conversion reads the Gram, the attention Gram and the output Fisher of the same calibration
rows. Collected apart they cost two forward passes and a gradient pass per row; in one pass
(:func:`lrkv_core.statistics.joint.collect_joint`, what the conversion does) one gradient pass, which the
forward statistics observe. This script collects them both ways on ``--rows`` rows of a real model,
alternating, ``--repeats`` times, and prints each way's seconds (best of the repeats), their ratio, the peak
RSS, and how far each joint statistic lies from its own pass's (relative to its largest entry; the output
Fisher also as the relative Frobenius distance: a pass with the attention Gram runs eager attention, whose
rounding can move a target drawn from the model's predictions, so its value may differ by a few draws):

    OMP_NUM_THREADS=2 python benchmarks/joint_statistics.py --threads 2 --rows 32

With ``--fisher-rows K`` it compares instead the joint pass with the output Fisher on every row against the
joint pass with the output Fisher on the first K rows (a gradient pass over K rows, a forward pass over the
rest), and how far the K-row Fisher lies from the all-row one:

    OMP_NUM_THREADS=2 python benchmarks/joint_statistics.py --threads 2 --rows 16 --fisher-rows 8
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from refine_time import load_rows, rows_parser  # benchmarks/, the script's own directory

from lrkv_core.statistics import STATISTICS
from lrkv_core.statistics.joint import collect_joint
from lrkv_core.system.memory import gib, peak_rss, release_freed

NAMES = ("attention_gram", "gram", "output_fisher")


def _tensors(values) -> list[torch.Tensor]:
    return [v for value in values for v in ([value] if isinstance(value, torch.Tensor) else value.values())]


def frobenius_gap(got, want) -> float:
    """The largest relative Frobenius distance between two statistics' matrices, ``|got − want| / |want|``."""
    pairs = zip(_tensors(got), _tensors(want), strict=True)
    return max(float((a - b).norm() / b.norm()) for a, b in pairs)


def alternate(ways: dict[str, Callable[[], Any]], repeats: int) -> tuple[dict, dict, dict]:
    """Run each of ``ways`` in turn, ``repeats`` times, printing each run's seconds; by name, the best
    seconds, the peak RSS (bytes) and the last run's values."""
    best: dict[str, float] = {}
    peak: dict[str, int] = {}
    values: dict[str, Any] = {}
    for _ in range(repeats):
        for name, run in ways.items():
            release_freed()
            with peak_rss() as watch:
                start = time.perf_counter()
                values[name] = run()
                seconds = time.perf_counter() - start
            best[name] = min(best.get(name, seconds), seconds)
            peak[name] = max(peak.get(name, 0), watch.peak)
            print(f"  {name}: {seconds:.1f} s", flush=True)
    return best, peak, values


def main() -> None:
    p = rows_parser(__doc__.splitlines()[0], 32, "calibration rows")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--fisher-rows", type=int, default=None, help="the output Fisher on the first K rows")
    args = p.parse_args()
    model, rows = load_rows(p, args)
    if args.fisher_rows is not None and not 1 <= args.fisher_rows <= len(rows):
        p.error(f"--fisher-rows must be between 1 and --rows ({len(rows)}), got {args.fisher_rows}")
    stats = [STATISTICS.create(n) for n in NAMES]
    if args.fisher_rows is None:
        first, second = "one pass each", "one joint pass"
        other = stats
        ways = {first: lambda: [s.collect(model, rows, batch_size=args.batch_size) for s in stats]}
    else:
        first, second = "one joint pass", f"one joint pass, the output Fisher on {args.fisher_rows} rows"
        other = [*stats[:2], STATISTICS.create({"name": "output_fisher", "n_samples": args.fisher_rows})]
        ways = {first: lambda: collect_joint(stats, model, rows, batch_size=args.batch_size)}
    ways[second] = lambda: collect_joint(other, model, rows, batch_size=args.batch_size)
    print(
        f"{len(rows)} rows of {args.seq_len} tokens, {args.batch_size} row(s) per pass, "
        f"{torch.get_num_threads()} thread(s), best of {args.repeats}",
        flush=True,
    )
    best, peak, values = alternate(ways, args.repeats)
    base = best[first]
    print("| collection | seconds | ratio | peak RSS, GiB |")
    print("|---|---|---|---|")
    for name in ways:
        print(f"| {name} | {best[name]:.1f} | {best[name] / base:.3f} | {gib(peak[name])} |")
    print("| statistic | largest entry gap (relative) | Frobenius gap (relative) |")
    print("|---|---|---|")
    apart, together = values[first], values[second]
    for s, (alone, _), (joint, _) in zip(stats, apart, together, strict=True):
        pairs = zip(_tensors(joint), _tensors(alone), strict=True)
        entry = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)
        print(f"| {s.name} | {entry:.2e} | {frobenius_gap(joint, alone):.2e} |")


if __name__ == "__main__":
    main()
