"""What a second thread's torch work costs while the first thread keeps its OpenMP pool, and with it handed
back (:func:`lrkv_core.system.openmp.release_thread_pool`).

A flow runs each task in a worker thread of its own. Each thread that ran torch work keeps a libgomp pool,
and while the pools' workers outnumber the CPUs every worker sleeps almost at once after a parallel region,
so each of a pass's thousands of small regions waits for its workers to wake. This script times, in turn
and ``--repeats`` times: a small elementwise product (one row's hidden states of SmolLM2) and a refinement
pricing pass (one forward and two backward passes per row, the flow's costliest pass) in the main thread;
in a second thread while the main thread holds its pool; and in a second thread after the main thread
released it. Printed: microseconds per product, seconds per row (best of the repeats) and their ratios to
the main thread's.

    OMP_NUM_THREADS=2 python benchmarks/thread_pools.py --threads 2 --rows 4
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from refine_time import load_rows, rows_parser  # benchmarks/, the script's own directory

from lrkv_core.statistics.gradients import row_seeded_targets, shared_gradient_passes
from lrkv_core.system.openmp import release_thread_pool

PRODUCTS = 20_000


def main() -> None:
    p = rows_parser(__doc__.splitlines()[0], 4, "calibration rows per pricing pass")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    model, rows = load_rows(p, args)
    print(
        f"{Path(args.model).name}: {args.rows} rows of {args.seq_len} tokens, {torch.get_num_threads()} "
        "thread(s)",
        flush=True,
    )
    hidden = torch.randn(args.seq_len, model.config.hidden_size)

    def products() -> float:  # µs per product
        start = time.perf_counter()
        for _ in range(PRODUCTS):
            hidden * 1.0001
        return (time.perf_counter() - start) / PRODUCTS * 1e6

    def pricing_pass() -> float:  # s per row
        def keep_nothing(*_):
            return None

        losses = [(keep_nothing, None), (keep_nothing, row_seeded_targets(0))]
        start = time.perf_counter()
        shared_gradient_passes(model, rows, losses, batch_size=args.batch_size)
        return (time.perf_counter() - start) / rows.shape[0]

    def in_thread(work: Callable[[], float]) -> float:
        out: list[float] = []
        thread = threading.Thread(target=lambda: out.append(work()))
        thread.start()
        thread.join()  # an ended thread's pool ends with it
        return out[0]

    ways = (
        "main thread",
        "second thread, the main thread's pool held",
        "second thread, the main thread's pool released",
    )

    def run(way: str, work: Callable[[], float]) -> float:
        if way == ways[0]:
            return work()
        hidden * 1.0001  # the main thread starts (or keeps) a pool of its own
        if way == ways[2]:
            release_thread_pool()
        return in_thread(work)

    results: dict[str, dict[str, list[float]]] = {w: {"products": [], "pass": []} for w in ways}
    for _ in range(args.repeats):
        for way in ways:
            results[way]["products"].append(run(way, products))
            results[way]["pass"].append(run(way, pricing_pass))
            print(f"  {way}: {results[way]['products'][-1]:.1f} µs, {results[way]['pass'][-1]:.3f} s/row")
    base = {k: min(v) for k, v in results["main thread"].items()}
    print("| where | product, µs | ratio | pricing pass, s/row | ratio |")
    print("|---|---|---|---|---|")
    for way, got in results.items():
        prod, per_row = min(got["products"]), min(got["pass"])
        print(
            f"| {way} | {prod:.1f} | {prod / base['products']:.2f} | {per_row:.3f} | "
            f"{per_row / base['pass']:.2f} |"
        )


if __name__ == "__main__":
    main()
