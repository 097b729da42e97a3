"""How many calibration rows the keys' output Fisher needs: the same ranks, the Fisher of more or fewer rows.

The default decomposition weighs each key group's error by the Fisher of the k_proj outputs (statistic
``output_fisher``), a gradient pass over its rows, where the Gram and the attention Gram need only a
forward pass. This script collects the Gram and the attention Gram on ``--rows`` calibration rows of a
real model, and the output Fisher in one gradient pass over them, keeping its sums over each of the first
``--prefixes`` rows (the sums of a prefix are the statistic of those rows: the targets are drawn per row).
For each prefix it decomposes every layer with that Fisher and the same Grams, cuts every group to the same
rank (uniform ranks at ``--ratio``, no refinement: only the keys' factors differ) and measures the
compressed model against the original on ``--eval-windows`` held-out windows (``--eval``: a slice of
``--text``): KL per token, top-1 agreement, prefill perplexity. ``0`` is the decomposition without the Fisher
(``keys: projection``, Palu's), the scale of what the Fisher changes. Printed with the seconds of the
gradient pass per row and each prefix's Fisher's distance from the last one's (relative Frobenius norm of the
key blocks):

    OMP_NUM_THREADS=2 python benchmarks/fisher_rows.py --threads 2 --rows 256 --prefixes 0,32,64,128,256
"""

from __future__ import annotations

import copy
import time

import torch
from refine_time import load_rows, rows_parser  # benchmarks/, the script's own directory
from transformers import AutoTokenizer

from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from lrkv_core.data.datasets import eval_windows
from lrkv_core.evaluation.metrics import kl_and_agreement, prefill_perplexity
from lrkv_core.statistics import STATISTICS
from lrkv_core.statistics.base import add_sums
from lrkv_core.statistics.joint import collect_joint


def main() -> None:
    p = rows_parser(__doc__.splitlines()[0], 256, "calibration rows of the Grams (and the most Fisher rows)")
    p.add_argument("--prefixes", default="0,32,64,128,256", help="Fisher rows to compare (0: no Fisher)")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--eval", default="[80%:90%]", help="the slice of --text to evaluate on")
    p.add_argument("--eval-windows", type=int, default=64)
    args = p.parse_args()
    prefixes = sorted({int(x) for x in args.prefixes.split(",")})
    if not prefixes or prefixes[0] < 0 or prefixes[-1] > args.rows:
        p.error(f"--prefixes must lie in 0..--rows ({args.rows}), got {args.prefixes}")
    model, rows = load_rows(p, args)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    windows = eval_windows(
        f"text:{args.text}{args.eval}", tokenizer, seq_len=args.seq_len, max_windows=args.eval_windows
    )
    print(
        f"{len(rows)} calibration rows of {args.seq_len} tokens, {torch.get_num_threads()} thread(s); "
        f"evaluated on {len(windows)} windows of text:{args.text}{args.eval}",
        flush=True,
    )
    start = time.perf_counter()
    grams = collect_joint([STATISTICS.create("gram"), STATISTICS.create("attention_gram")], model, rows)
    grams = {"gram": grams[0][0], "attention_gram": grams[1][0]}
    print(f"  the Grams (one forward pass): {time.perf_counter() - start:.1f} s", flush=True)
    fisher = STATISTICS.create("output_fisher")
    sums, fishers, done, seconds = None, {}, 0, 0.0
    for n in (n for n in prefixes if n > 0):
        start = time.perf_counter()
        part = fisher.accumulate(
            model, rows[done:n], first_row=done, batch_size=args.batch_size, progress=None
        )
        seconds += time.perf_counter() - start
        sums = part if sums is None else add_sums(sums, part)
        fishers[n] = fisher.finish(*sums)[0]
        done = n
    if done:
        print(f"  the output Fisher (one gradient pass): {seconds / done:.2f} s per row", flush=True)
    base_ppl = prefill_perplexity(model, windows)["ppl"]
    print(f"  original: prefill PPL {base_ppl:.4f}", flush=True)
    print("| Fisher rows | KL, nats/token | top-1 | prefill PPL | rise | Fisher's distance from the last |")
    print("|---|---|---|---|---|---|")
    last = fishers.get(prefixes[-1])
    for n in prefixes:
        keys = "fisher" if n else "projection"
        decomposition = {"name": "whitened", "keys": keys}
        config = CompressionConfig(
            ratio=args.ratio, allocator="uniform", refine={"steps": 0}, decomposition=decomposition
        )
        stats = dict(grams) | ({"output_fisher": fishers[n]} if n else {})
        conversion = plan_conversion(model, None, config, statistics=stats)
        compressed = conversion.apply(copy.deepcopy(model))
        kl = kl_and_agreement(model, compressed, windows)
        ppl = prefill_perplexity(compressed, windows)["ppl"]
        gap = _distance(fishers[n], last) if n and last is not None else float("nan")
        rise = 100 * (ppl / base_ppl - 1)
        cells = f"{kl['kl']:.5f} | {kl['top1_agreement']:.4f} | {ppl:.4f} | {rise:+.2f} % | {gap:.3f}"
        print(f"| {n} | {cells} |", flush=True)
        del compressed


def _distance(a: list, b: list) -> float:
    """The largest relative Frobenius distance between two Fishers' key blocks, over the layers."""
    return max(float((x["k"] - y["k"]).norm() / y["k"].norm()) for x, y in zip(a, b, strict=True))


if __name__ == "__main__":
    main()
