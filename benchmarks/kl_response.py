"""Does the ``kl`` allocator's estimate predict the KL really measured? Single groups, then whole plans.

1. Every group cut alone to ``--rank``: the KL divergence from the original measured by cutting it in the
   model (its weight set to the truncated ``B_r A_r``, whose outputs are the fused model's:
   :class:`lrkv_core.conversion.refine.PlanWeights`) against the second-order estimate ``kl_response`` gives
   for it; also the Fisher-weighted truncation error ``fisher-greedy`` reads, for comparison. Spearman ρ over
   groups.
2. Every allocator's plan at each ratio, fused into a copy of the model: the sum of its groups' estimates
   (what ``kl`` minimises) against the KL measured through the compressed model.

Estimates come from ``--n-samples`` calibration windows; the KL is measured on the first ``--measure-rows``
of them (nats per token; whole plans through the compressed model's cache), so this checks the approximation
(second order, groups adding up), not how a plan carries over to other text (benchmarks/allocation.py).

    W=../shared/data/wikitext-2/valid.txt
    OMP_NUM_THREADS=1 python benchmarks/kl_response.py --model ~/.cache/lrkv-assets/smollm2-135m \\
        --calibration "text:$W[:80%]" --out docs/allocation/smollm2-kl-response.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from lrkv_core.conversion.convert import (
    CompressionConfig,
    collect_statistics,
    decompose_model,
    plan_conversion,
)
from lrkv_core.conversion.refine import PlanWeights, measured_kl, single_cut
from lrkv_core.data.datasets import calibration_windows
from lrkv_core.evaluation import metrics
from lrkv_core.model.loading import load_model
from lrkv_core.statistics import STATISTICS

ALLOCATORS = ["uniform", "fisher", "eigen", "fisher-greedy", {"name": "kl", "solver": "greedy"}, "kl"]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties expected among measured floats)."""
    ra, rb = (torch.tensor(x, dtype=torch.float64).argsort().argsort().double() for x in (a, b))
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--calibration", required=True)
    p.add_argument("--n-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--measure-rows", type=int, default=8)
    p.add_argument("--rank", type=int, default=64, help="the rank each group is cut to alone")
    p.add_argument("--ratios", default="0.7,0.5,0.3")
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    hf_logging.set_verbosity_error()

    model, tok = load_model(args.model)
    rows = calibration_windows(args.calibration, tok, n_samples=args.n_samples, seq_len=args.seq_len, seed=0)
    measure = rows[: args.measure_rows]
    started = time.perf_counter()
    wanted = [STATISTICS.create(s) for s in ("gram", "fisher")]
    stats = collect_statistics(model, rows, wanted)
    factors, _ = decompose_model(model, rows, CompressionConfig(group_size=args.group_size), statistics=stats)
    every_row = STATISTICS.create({"name": "kl_response", "n_samples": None})  # the curves of all the rows
    stats |= collect_statistics(model, rows, [every_row], factors=factors)
    print(f"statistics: {time.perf_counter() - started:.0f} s", flush=True)

    groups = []
    weights = PlanWeights(model, factors)
    for f in factors:
        for kind in "kv":
            for g, group in enumerate(f.groups[kind]):
                r = min(args.rank, group.max_rank)
                try:
                    ranks = single_cut(factors, f.layer, kind, g, r)
                    measured = measured_kl(model, weights, ranks, measure, batch_size=8)
                finally:
                    weights.restore()
                fisher_error = _error_curve(f, stats, kind, g, r)
                groups.append(
                    {
                        "layer": f.layer,
                        "kind": kind,
                        "group": g,
                        "rank": r,
                        "measured_kl": measured,
                        "estimated_kl": float(stats["kl_response"][f.layer][kind][g, r]),
                        "fisher_error": fisher_error,
                    }
                )
    rho_kl = spearman([x["measured_kl"] for x in groups], [x["estimated_kl"] for x in groups])
    rho_fisher = spearman([x["measured_kl"] for x in groups], [x["fisher_error"] for x in groups])
    ratios = sorted(x["estimated_kl"] / x["measured_kl"] for x in groups if x["measured_kl"] > 0)
    print(f"single groups at rank {args.rank}: Spearman ρ(measured, kl estimate) {rho_kl:.3f}, "
          f"ρ(measured, Fisher-weighted error) {rho_fisher:.3f}; estimate / measured: median "
          f"{ratios[len(ratios) // 2]:.2f}, range {ratios[0]:.2f}–{ratios[-1]:.2f}", flush=True)  # fmt: skip

    plans = []
    for ratio in [float(r) for r in args.ratios.split(",")]:
        for allocator in ALLOCATORS:
            config = CompressionConfig(  # the allocators' own plans: the estimate is what they minimise
                ratio=ratio, group_size=args.group_size, allocator=allocator, refine={"steps": 0}
            )
            planned = plan_conversion(model, rows, config, statistics=stats)
            estimate = sum(
                float(stats["kl_response"][layer][kind][g, r])
                for kind in "kv"
                for layer, ranks in enumerate(planned.plan.ranks[kind])
                for g, r in enumerate(ranks)
            )
            compressed = planned.apply(copy.deepcopy(model))
            measured = metrics.kl_and_agreement(model, compressed, measure)["kl"]
            plans.append(
                {
                    "ratio": ratio,
                    "allocator": config.allocator.to_dict(),
                    "estimated_kl": estimate,
                    "measured_kl": measured,
                }
            )
            print(
                f"{ratio} {config.allocator.to_dict()}: estimated {estimate:.4f}, measured {measured:.4f}",
                flush=True,
            )
    rho_plans = spearman([x["measured_kl"] for x in plans], [x["estimated_kl"] for x in plans])
    print(f"whole plans: Spearman ρ(measured, Σ estimates) {rho_plans:.3f}")
    args.out.write_text(
        json.dumps(
            {
                "protocol": {k: str(v) for k, v in vars(args).items()},
                "single_groups": {
                    "spearman_kl": rho_kl,
                    "spearman_fisher_error": rho_fisher,
                    "groups": groups,
                },
                "plans": {"spearman": rho_plans, "plans": plans},
            },
            indent=1,
        )
    )


def _error_curve(factors, stats, kind: str, g: int, r: int) -> float:
    """The Fisher-weighted truncation error Σ F ⊙ (W − B_r A_r)² of one group (what fisher-greedy reads)."""
    from lrkv_core.allocation.features import group_rows, weighted_error_curve

    group = factors.groups[kind][g]
    block = group_rows(stats["fisher"][factors.layer][kind], group.up.shape[0])[g]
    return float(weighted_error_curve(group, block)[r])


if __name__ == "__main__":
    main()
