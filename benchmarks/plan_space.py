"""Every rank plan of a small model at one ratio, measured: which would an allocator have to find?

Enumerates every plan that uses the whole budget (each group's rank on the grid of ``--rank-multiple``,
the kept width within one rank step below ``⌊ratio · full width⌋``, as every allocator fills it),
optionally with each kind's ranks bounded (``--bounds k=8:32,v=16:64``), cuts the model to each
(:class:`lrkv_core.conversion.refine.PlanWeights`: the fused latent model's logits) and measures the loss of
the rows' own next tokens on ``--measure-rows`` calibration rows (what the refinement lowers) and the prefill
perplexity rise on the first ``--first`` windows of each ``--eval`` split. Writes one CSV row per plan
(ranks as ``K ranks/V ranks`` in rank steps, layer by layer) and prints the best plans by each measure and
Spearman's ρ between them. Only for models with few groups: the plan count grows combinatorially
(shakespeare-llama at 0.3 with the bounds below: 2,948 plans).

    S=../shared/data/shakespeare
    OMP_NUM_THREADS=2 python benchmarks/plan_space.py --model ../shared/models/shakespeare-llama \\
        --calibration "text:$S/train.txt" --eval "test=text:$S/valid.txt[:50%]" \\
        --eval "dev=text:$S/valid.txt[50%:]" --group-size 2 --ratio 0.3 --bounds k=8:32,v=16:64 \\
        --out docs/allocation/shakespeare-plans-0.3.csv
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import time
from pathlib import Path

from kl_response import spearman  # benchmarks/, the script's own directory
from plan_objectives import held_out, perplexity
from transformers.utils import logging as hf_logging

from lrkv_core.allocation.problem import KINDS, RankProblem
from lrkv_core.conversion.convert import CompressionConfig, decompose_model
from lrkv_core.conversion.refine import PlanWeights, measured_nll
from lrkv_core.data.datasets import calibration_windows
from lrkv_core.model.loading import load_model


def every_plan(factors, ratio: float, multiple: int, bounds: dict[str, tuple[int, int]]) -> list[dict]:
    """Every ``ranks`` dict on the allocators' grid that fills the budget as they do (kept width at most
    ``⌊ratio · full width⌋`` and less than one rank step below it), each kind's ranks within ``bounds``."""
    width = factors[0].groups["k"][0].up.shape[0]  # s·D, a group's width in the cache
    problem = RankProblem([f.spectra() for f in factors], width, ratio, multiple)
    choices = []
    for i, spec in enumerate(problem.groups):
        low, high = bounds.get(spec.kind, (0, spec.max_rank))
        choices.append([r for r in problem.grid(i) if low <= r <= high])
    if math.prod(len(c) for c in choices) > 10**8:
        raise SystemExit(f"{len(choices)} groups: too many plans to enumerate; bound the ranks (--bounds)")
    fills = range(problem.budget - multiple + 1, problem.budget + 1)
    return [problem.nest(ranks) for ranks in itertools.product(*choices) if sum(ranks) in fills]


def label(ranks: dict, multiple: int) -> str:
    return "/".join(".".join("".join(str(r // multiple) for r in layer) for layer in ranks[k]) for k in KINDS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--calibration", required=True, help="dataset spec of the calibration windows")
    p.add_argument("--eval", action="append", required=True, help="NAME=SPEC of a held-out split (repeat)")
    p.add_argument("--ratio", type=float, required=True)
    p.add_argument("--bounds", default="", help="rank bounds per kind, e.g. k=8:32,v=16:64 (default: none)")
    p.add_argument("--rows", type=int, default=256, help="calibration windows (the Gram's, seed 0)")
    p.add_argument("--measure-rows", type=int, default=64, help="calibration rows the loss is measured on")
    p.add_argument("--first", type=int, default=16, help="windows of each split (issue 8: 16; 0: all)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--rank-multiple", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", type=Path, required=True, help="CSV, one row per plan")
    args = p.parse_args()
    hf_logging.set_verbosity_error()
    bounds = {}
    for item in filter(None, args.bounds.split(",")):
        kind, _, span = item.partition("=")
        low, _, high = span.partition(":")
        if kind not in KINDS or not low.isdigit() or not high.isdigit():
            raise SystemExit(f"--bounds takes KIND=LOW:HIGH with KIND k or v, got {item!r}")
        bounds[kind] = (int(low), int(high))

    model, tok = load_model(args.model)
    rows = calibration_windows(args.calibration, tok, n_samples=args.rows, seq_len=args.seq_len, seed=0)
    splits = held_out(args.eval, tok, args.seq_len, args.first)
    factors, _ = decompose_model(model, rows, CompressionConfig(group_size=args.group_size))
    plans = every_plan(factors, args.ratio, args.rank_multiple, bounds)
    base = {name: perplexity(model, w, args.batch_size) for name, w in splits.items()}
    print(f"{len(plans)} plans; original perplexity: " + ", ".join(f"{k} {v:.3f}" for k, v in base.items()))
    weights = PlanWeights(model, factors)
    calibration = rows[: args.measure_rows]
    table, started = [], time.perf_counter()
    try:
        for i, ranks in enumerate(plans):
            row = {"plan": label(ranks, args.rank_multiple)}
            row["calibration_nll"] = measured_nll(model, weights, ranks, calibration, args.batch_size)
            for name, windows in splits.items():  # the model is still cut to the plan
                row[f"rise_{name}"] = perplexity(model, windows, args.batch_size) - base[name]
            table.append(row)
            if i % 100 == 0:
                print(f"{i}/{len(plans)} plans, {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        weights.restore()
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    table.sort(key=lambda r: r["calibration_nll"])
    for measure in ("calibration_nll", *(f"rise_{n}" for n in splits)):
        best = sorted(table, key=lambda r: r[measure])[:5]
        print(f"lowest {measure}: " + "; ".join(
            f"{r['plan']} (loss rank {table.index(r) + 1}, " + ", ".join(
                f"{n} {r[f'rise_{n}']:+.3f}" for n in splits) + ")" for r in best))  # fmt: skip
    for a, b in itertools.combinations(["calibration_nll", *(f"rise_{n}" for n in splits)], 2):
        print(f"ρ({a}, {b}) = {spearman([r[a] for r in table], [r[b] for r in table]):+.2f}")


if __name__ == "__main__":
    main()
