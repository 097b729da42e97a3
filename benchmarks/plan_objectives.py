"""Which objective orders rank plans as held-out perplexity does? Each plan of an allocation run, measured.

For every plan (the ``ranks`` of each row of a ``benchmarks/allocation.py`` JSON-lines file, optionally only
some ``--ratios``), the model is cut to it (:class:`lrkv_core.conversion.refine.PlanWeights`: the fused latent
model's logits) and measured on calibration rows and on each ``--eval`` split:

- ``kl``: mean per-token KL(original ‖ cut), nats, what ``kl`` and the refinement minimise;
- ``rise``: prefill perplexity over the original's on the text's own next tokens.

Per ratio it prints Spearman's ρ of each objective against the rise on each split, so one sees whether the
calibration KL, the calibration perplexity or the KL on held-out text orders plans as held-out perplexity
does. With ``--neighbors`` each plan also brings every plan one rank step away from it (one group gives a
rank step to another: the same budget), so one sees whether two texts agree on which of those close plans
is better. The statistics are recomputed here only for the decomposition (the Gram, ``--rows`` windows,
seed 0, whitened), as ``benchmarks/allocation.py`` does.

    S=../shared/data/shakespeare
    OMP_NUM_THREADS=1 python benchmarks/plan_objectives.py --model ../shared/models/shakespeare-llama \\
        --calibration "text:$S/train.txt" --plans docs/allocation/shakespeare-allocators.jsonl \\
        --eval "test=text:$S/valid.txt[:50%]" --eval "dev=text:$S/valid.txt[50%:]" --first 0 --group-size 2 \\
        --out docs/allocation/shakespeare-objectives.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from kl_response import spearman  # benchmarks/, the script's own directory
from transformers.utils import logging as hf_logging

from lrkv_core.conversion.convert import CompressionConfig, decompose_model
from lrkv_core.conversion.refine import PlanWeights, measured_kl
from lrkv_core.data.datasets import calibration_windows, eval_windows
from lrkv_core.model.loading import load_model


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int) -> float:
    """Perplexity of the windows' own next tokens (every position, one pass per batch, no cache)."""
    nll, n = 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        nll += float(
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        )
        n += batch[:, 1:].numel()
    return float(torch.tensor(nll / n).exp())


def held_out(items: list[str], tokenizer, seq_len: int, first: int) -> dict[str, torch.Tensor]:
    """``--eval NAME=SPEC`` items: each split's first ``first`` windows (0: all), by name."""
    splits = {}
    for item in items:
        name, _, spec = item.partition("=")
        if not spec:
            raise SystemExit(f"--eval takes NAME=SPEC, got {item!r}")
        windows = eval_windows(spec, tokenizer, seq_len=seq_len)
        splits[name] = windows[:first] if first else windows
    return splits


def neighbors(plan: dict, factors, step: int) -> list[dict]:
    """Every plan that moves one rank ``step`` from one group of ``plan`` to another (same kept width),
    within each group's 1 step .. full rank."""
    groups = [
        (kind, f.layer, g, f.groups[kind][g].max_rank)
        for f in factors
        for kind in ("k", "v")
        for g in range(len(f.groups[kind]))
    ]
    rank = {(kind, layer, g): plan["ranks"][kind][layer][g] for kind, layer, g, _ in groups}
    out = []
    for src in groups:
        for dst in groups:
            if src == dst or rank[src[:3]] - step < step or rank[dst[:3]] + step > dst[3]:
                continue
            ranks = json.loads(json.dumps(plan["ranks"]))
            (sk, sl, sg, _), (dk, dl, dg, _) = src, dst
            ranks[sk][sl][sg] -= step
            ranks[dk][dl][dg] += step
            out.append(
                plan | {"setting": f"{plan['setting']}, {sk}{sl}.{sg} → {dk}{dl}.{dg}", "ranks": ranks}
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--calibration", required=True, help="dataset spec of the calibration windows")
    p.add_argument("--plans", type=Path, required=True, help="JSON lines of benchmarks/allocation.py")
    p.add_argument("--eval", action="append", required=True, help="NAME=SPEC of a held-out split (repeat)")
    p.add_argument("--ratios", default=None, help="comma-separated ratios to keep (default: all)")
    p.add_argument("--rows", type=int, default=256, help="calibration windows (the Gram's, seed 0)")
    p.add_argument("--measure-rows", type=int, default=64, help="calibration rows the objectives use")
    p.add_argument("--first", type=int, default=16, help="windows of each split (issue 8: 16; 0: all)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--neighbors", action="store_true", help="add every plan one rank step from each plan")
    p.add_argument("--rank-multiple", type=int, default=8, help="the rank step of --neighbors")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    hf_logging.set_verbosity_error()

    model, tok = load_model(args.model)
    rows = calibration_windows(args.calibration, tok, n_samples=args.rows, seq_len=args.seq_len, seed=0)
    splits = {"calibration": rows[: args.measure_rows], **held_out(args.eval, tok, args.seq_len, args.first)}
    ratios = {float(r) for r in args.ratios.split(",")} if args.ratios else None
    plans = [json.loads(line) for line in args.plans.read_text().splitlines() if line.strip()]
    plans = [r for r in plans if ratios is None or r["ratio"] in ratios]
    if not plans:
        raise SystemExit(f"no plans in {args.plans} at ratios {sorted(ratios or [])}")

    factors, _ = decompose_model(model, rows, CompressionConfig(group_size=args.group_size))
    if args.neighbors:
        plans = [n for plan in plans for n in (plan, *neighbors(plan, factors, args.rank_multiple))]
    weights = PlanWeights(model, factors)
    base = {name: perplexity(model, w, args.batch_size) for name, w in splits.items()}
    print("original perplexity: " + ", ".join(f"{k} {v:.3f}" for k, v in base.items()), flush=True)
    table = []
    try:
        for plan in plans:
            row = {"setting": plan["setting"], "ratio": plan["ratio"], "ranks": plan["ranks"]}
            for name, windows in splits.items():
                row[f"kl_{name}"] = measured_kl(model, weights, plan["ranks"], windows, args.batch_size)
                weights.cut(plan["ranks"])
                row[f"rise_{name}"] = perplexity(model, windows, args.batch_size) - base[name]
            weights.restore()
            table.append(row)
            print(f"{row['ratio']} {row['setting']}: " + ", ".join(
                f"{name} kl {row[f'kl_{name}']:.4f} rise {row[f'rise_{name}']:+.3f}" for name in splits
            ), flush=True)  # fmt: skip
    finally:
        weights.restore()
    args.out.write_text("".join(json.dumps(r) + "\n" for r in table))
    for ratio in sorted({r["ratio"] for r in table}, reverse=True):
        at = [r for r in table if r["ratio"] == ratio]
        for target in (n for n in splits if n != "calibration"):
            target_rise = [r[f"rise_{target}"] for r in at]
            print(f"{ratio}: ρ with the {target} rise ({len(at)} plans): " + ", ".join(
                f"{obj} {spearman([r[obj] for r in at], target_rise):+.2f}"
                for obj in (f"{m}_{n}" for n in splits for m in ("kl", "rise")) if obj != f"rise_{target}"
            ))  # fmt: skip


if __name__ == "__main__":
    main()
