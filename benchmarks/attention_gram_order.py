"""How long the default decomposition's joint statistics pass takes with the attention Gram summed through
``C = Σ_h P_hᵀ P_h`` against per head, on rows of a real model.

The attention Gram ``Σ_h (P_h X)ᵀ (P_h X)`` can be summed in two orders
(:func:`lrkv_core.statistics.attention_gram.mixed_input_gram`): through the T × T matrix C (H·T³
multiply-adds) or per head (H·T²·d); the statistic takes the cheaper one for the rows' length. This script
collects the joint pass (the Gram, the attention Gram and the output Fisher, as the conversion does) with
each order forced, alternating, ``--repeats`` times, and prints each order's seconds (best of the repeats),
their ratio, the peak RSS and how far the two attention Grams lie apart (relative to the largest entry):

    OMP_NUM_THREADS=2 python benchmarks/attention_gram_order.py --threads 2 --rows 2 --seq-len 2048
"""

from __future__ import annotations

import torch
from joint_statistics import NAMES, alternate  # benchmarks/, the script's own directory
from refine_time import load_rows, rows_parser

from lrkv_core.statistics import STATISTICS
from lrkv_core.statistics import attention_gram as ag
from lrkv_core.statistics.joint import collect_joint
from lrkv_core.system.memory import gib


def forced(per_head: bool, run):
    def collect():
        ag.PER_HEAD = per_head
        try:
            return run()
        finally:
            ag.PER_HEAD = None

    return collect


def main() -> None:
    p = rows_parser(__doc__.splitlines()[0], 2, "calibration rows")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    model, rows = load_rows(p, args)
    stats = [STATISTICS.create(n) for n in NAMES]
    run = lambda: collect_joint(stats, model, rows, batch_size=args.batch_size)  # noqa: E731
    ways = {"through C": forced(False, run), "per head": forced(True, run)}
    cfg = model.config
    per_head_first = ag.per_head_is_cheaper(cfg.num_attention_heads, rows.shape[1], cfg.hidden_size)
    cheaper = "per head" if per_head_first else "C"
    print(
        f"{len(rows)} rows of {rows.shape[1]} tokens, {args.batch_size} row(s) per pass, "
        f"{torch.get_num_threads()} thread(s), best of {args.repeats}; the statistic's own choice: {cheaper}",
        flush=True,
    )
    best, peak, values = alternate(ways, args.repeats)
    through_c, per_head = (values[name][0][0] for name in ways)  # each way's attention Gram (first statistic)
    gap = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(per_head, through_c, strict=True))
    base = best["through C"]
    print("| attention Gram | seconds | ratio | peak RSS, GiB |")
    print("|---|---|---|---|")
    for name in ways:
        print(f"| {name} | {best[name]:.1f} | {best[name] / base:.3f} | {gib(peak[name])} |")
    print(f"largest gap of the two attention Grams (any layer, relative to its largest entry): {gap:.1e}")


if __name__ == "__main__":
    main()
