"""How long the forward-only statistics (``gram``, ``attention_gram``) take with and without the output
projection, and their peak RSS.

:func:`lrkv_core.statistics.base.forward_rows` runs the decoder stack only: every hook of these statistics
sits inside the layers, and the full-vocabulary logits are the largest tensor of a batch. This script
collects each statistic as the library does and with a pass that also runs the output projection (the
whole model's forward), alternating, ``--repeats`` times, and checks that both give the same values, bit for
bit:

    OMP_NUM_THREADS=2 python benchmarks/forward_statistics.py --threads 2 --rows 32 --batch-size 8
"""

from __future__ import annotations

import time
from unittest import mock

import torch
from refine_time import load_rows, rows_parser  # benchmarks/, the script's own directory

from lrkv_core.statistics import attention_gram, gram, joint
from lrkv_core.statistics.base import forward_rows
from lrkv_core.system.memory import peak_rss, release_freed


def whole_model_rows(model, rows, handles, *, batch_size, progress, after_batch=None) -> None:
    """:func:`forward_rows` with the output projection: the whole model's forward over each batch."""
    device = next(model.parameters()).device
    try:
        for start in range(0, rows.shape[0], batch_size):
            model(rows[start : start + batch_size].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()


def main() -> None:
    p = rows_parser(__doc__.splitlines()[0], 32, "calibration rows")
    p.set_defaults(batch_size=8)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    model, rows = load_rows(p, args)
    model.eval()
    runs = {"decoder stack (the library)": forward_rows, "with the output projection": whole_model_rows}
    print(
        f"{len(rows)} rows of {args.seq_len} tokens, {args.batch_size} rows per pass, "
        f"{torch.get_num_threads()} thread(s), best of {args.repeats}"
    )
    print("| statistic | pass | seconds | ratio | peak RSS, GiB |")
    print("|---|---|---|---|---|")
    statistics = ((joint, gram.collect_gram), (joint, attention_gram.collect_attention_gram))
    for module, collect in statistics:
        best, peak, values = {}, {}, {}
        for _ in range(args.repeats):
            for name, run in runs.items():
                release_freed()
                with mock.patch.object(module, "forward_rows", run), peak_rss() as watch:
                    start = time.perf_counter()
                    values[name] = collect(model, rows, batch_size=args.batch_size)[0]
                    seconds = time.perf_counter() - start
                best[name] = min(best.get(name, float("inf")), seconds)
                peak[name] = max(peak.get(name, 0), watch.peak)
        same = all(torch.equal(a, b) for a, b in zip(*values.values(), strict=True))
        base = best["with the output projection"]
        for name in reversed(runs):
            print(
                f"| {collect.__name__} | {name} | {best[name]:.2f} | {best[name] / base:.3f} | "
                f"{peak[name] / 2**30:.2f} |"
            )
        print(f"identical values ({collect.__name__}): {same}")


if __name__ == "__main__":
    main()
