"""How long the default decomposition's statistics pass takes, the decoder stack in float32 and in bfloat16.

The conversion's passes over the calibration rows (statistics, KL response, refinement) can run the decoder
stack's matrix products in bfloat16 (``calibration.precision``, :mod:`lrkv_core.statistics.precision`). This
script collects the Gram, the attention Gram and the output Fisher in one joint pass (the conversion's first
and largest pass) on ``--rows`` rows of a real model both ways, alternating, ``--repeats`` times, and prints
each way's seconds (best of the repeats), their ratio, the peak RSS, and how far each bfloat16 statistic lies
from the float32 one (relative Frobenius distance, the largest over the layers' matrices), next to how far
the output Fisher's own sampled targets move it (a float32 pass with the targets drawn under another seed).
Then, on the first ``--gradient-rows`` rows, the seconds per row of a bare gradient pass with one loss (the KL
response's) and with two losses through one forward pass (a refinement pricing pass), each way:

    OMP_NUM_THREADS=2 python benchmarks/calibration_precision.py --threads 2 --rows 32
"""

from __future__ import annotations

import functools
import time

import torch
from joint_statistics import NAMES, alternate, frobenius_gap  # benchmarks/, the script's own directory
from refine_time import load_rows, rows_parser

from lrkv_core.statistics import STATISTICS
from lrkv_core.statistics.gradients import row_seeded_targets, shared_gradient_passes
from lrkv_core.statistics.joint import collect_joint
from lrkv_core.statistics.precision import PRECISIONS, calibration_precision
from lrkv_core.system.memory import gib


def main() -> None:
    p = rows_parser(__doc__.splitlines()[0], 32, "calibration rows")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--gradient-rows", type=int, default=8, help="rows of the bare gradient passes (0: none)")
    args = p.parse_args()
    model, rows = load_rows(p, args)
    stats = [STATISTICS.create(n) for n in NAMES]
    print(
        f"{len(rows)} rows of {args.seq_len} tokens, {args.batch_size} row(s) per pass, "
        f"{torch.get_num_threads()} thread(s), best of {args.repeats}; {', '.join(NAMES)} in one pass",
        flush=True,
    )

    def collect(precision: str) -> list:
        with calibration_precision(precision):
            return [v for v, _ in collect_joint(stats, model, rows, batch_size=args.batch_size)]

    ways = {precision: functools.partial(collect, precision) for precision in PRECISIONS}
    best, peak, values = alternate(ways, args.repeats)
    reseeded = STATISTICS.create({"name": "output_fisher", "seed": 1})
    [(other_draws, _)] = collect_joint([reseeded], model, rows, batch_size=args.batch_size)
    base = best["float32"]
    print("| decoder stack | seconds | ratio | peak RSS, GiB |")
    print("|---|---|---|---|")
    for precision in PRECISIONS:
        print(
            f"| {precision} | {best[precision]:.1f} | {best[precision] / base:.3f} | {gib(peak[precision])} |"
        )
    print("| statistic | bfloat16 from float32 (relative Frobenius, largest matrix) |")
    print("|---|---|")
    for s, low, full in zip(stats, values["bfloat16"], values["float32"], strict=True):
        print(f"| {s.name} | {frobenius_gap(low, full):.2e} |")
    moved = frobenius_gap(other_draws, values["float32"][NAMES.index("output_fisher")])
    print(f"| output_fisher, float32 with targets drawn under seed 1 | {moved:.2e} |")
    if args.gradient_rows:
        _gradient_passes(model, rows[: args.gradient_rows], args)


def _gradient_passes(model: torch.nn.Module, rows: torch.Tensor, args) -> None:
    """Seconds per row of a gradient pass with one and two sampled losses (visits that keep nothing), best of
    ``--repeats``, each precision in turn."""
    ignore = lambda *_: None  # noqa: E731
    best: dict[tuple[int, str], float] = {}
    for _ in range(args.repeats):
        for losses in (1, 2):
            for precision in PRECISIONS:
                with calibration_precision(precision):
                    start = time.perf_counter()
                    shared_gradient_passes(
                        model, rows, [(ignore, row_seeded_targets(0))] * losses, batch_size=args.batch_size
                    )
                    seconds = (time.perf_counter() - start) / len(rows)
                best[(losses, precision)] = min(best.get((losses, precision), seconds), seconds)
    print(f"| gradient pass ({len(rows)} rows) | float32, s/row | bfloat16, s/row | ratio |")
    print("|---|---|---|---|")
    for losses in (1, 2):
        full, low = best[(losses, "float32")], best[(losses, "bfloat16")]
        print(f"| {losses} loss{'es' if losses > 1 else ''} | {full:.3f} | {low:.3f} | {low / full:.3f} |")


if __name__ == "__main__":
    main()
