"""Rank allocation on one model: every allocator at every ratio, and what moves a plan, with what it costs.

``--table allocators`` plans every allocator with ``--rows`` calibration windows for every statistic (lrkv's
default calibration is 256); ``--table factors`` changes one thing at a time from ``--rows``: the
calibration size of the Gram, the Fisher and the KL response (``--rows`` or all ``--n-samples``), per-row or
per-micro-batch Fisher (Palu's), Palu's score (rms or Σ F) and leftover rule, the rank multiple, the solver
of the curve allocators, sampled or data targets and label draws for the KL response.

Protocol: ``--n-samples`` windows of ``--seq-len`` tokens drawn from ``--calibration`` (seed ``--seed``,
0 by default); every statistic is collected once per setting and timed (its seconds are what the allocator
adds to a conversion). Each row plans, fuses the factors into a copy of the model (the deployed latent
attention) and measures prefill perplexity on every non-overlapping ``--seq-len`` window of ``--eval``, one
window at a time: ``rise`` is over the original on the first ``--first`` windows (against_palu.py's protocol),
``rise_all`` on all of them (``--eval`` given again: every plan is also measured on that text, one row per
text, without planning again: a plan depends on the calibration only); ``kl`` the mean per-token KL of the
compressed model's next-token distributions from the original's on the first windows (how far it moved,
whichever way; a rise can be negative where the cut happens to fit the held-out text better, a KL cannot).
``vs_half_palu`` is a 95 % paired bootstrap interval (windows resampled) of ``rise − ½ · rise(fisher)`` at
the same ratio: below zero, the row has at most half of Palu-style Fisher's rise; ``vs_uniform`` the same for
``rise − rise(uniform)``. Each row keeps the per-window NLLs (``nll``, the original's ``base_nll``), so
rows of different runs on the same text can be compared pairwise (``benchmarks/against_palu.py``).

    S=../shared/data/shakespeare
    OMP_NUM_THREADS=1 python benchmarks/allocation.py --model ../shared/models/shakespeare-llama \\
        --calibration "text:$S/train.txt" --eval "text:$S/valid.txt[:50%]" --table allocators \\
        --out docs/allocation/shakespeare-allocators.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from lrkv_core.conversion.convert import (
    CompressionConfig,
    collect_statistics,
    decompose_model,
    plan_conversion,
)
from lrkv_core.data.datasets import calibration_windows, eval_windows
from lrkv_core.evaluation import metrics
from lrkv_core.model.loading import load_model
from lrkv_core.statistics import STATISTICS


@dataclass(frozen=True)
class Setting:
    """One row: an allocator, the Gram's rows (None: all), the statistics' options, the rank multiple."""

    label: str
    allocator: str | dict
    gram_rows: int | None
    statistics: dict[str, dict] = field(default_factory=dict)
    rank_multiple: int = 8
    reference: str | None = None  # "fisher" / "uniform": the row others are compared with
    refine_steps: int = 0  # refinement steps after the allocator (lrkv_core.conversion.refine)
    refine_rows: int = 32  # calibration rows the refinement measures on (lrkv's default)
    refine_radius: int = 4  # rank steps a refine step may move a group: the documented rows' (lrkv's default)
    refine_objective: str = "kl"  # what the refinement lowers: the documented rows' (conversion.refine)
    refine_accept_rows: int = 0  # rows after refine_rows that keep or reject each step (0: the same rows)


def settings(
    table: str, rows: int, lorc_skips: tuple[float, ...] = (), error_rows: int = 32
) -> list[Setting]:
    """The rows of a table; ``rows`` is the calibration size of every statistic unless a row changes it;
    ``lorc_skips``: log κ̃ thresholds of LoRC's skip rule, each a progressive row and its uniform baseline;
    ``error_rows``: the rows of Eigen Attention's layer output errors in the row that names them."""

    def fisher(**options: Any) -> dict[str, dict]:
        return {"fisher": {"n_samples": rows, **options}}

    def kl(**options: Any) -> dict[str, dict]:
        return {"kl_response": {"n_samples": rows, **options}}

    def on_loss(
        label: str, allocator: str, stats: dict, steps: int = 3, n: int = 32, accept: int = 0
    ) -> Setting:
        """The allocator's plan refined on the loss of the rows' own next tokens (objective nll), each step
        kept or rejected on the next ``accept`` rows (on the same rows if 0)."""
        accepted = f", accepted on the next {accept}" if accept else ""
        return Setting(
            f"{label} + {steps} refine steps on {n} rows, nll{accepted}",
            allocator,
            rows,
            stats,
            refine_steps=steps,
            refine_rows=n,
            refine_objective="nll",
            refine_accept_rows=accept,
        )

    if table == "allocators":
        return [
            Setting("uniform", "uniform", rows, reference="uniform"),
            Setting("fisher (Palu's rule)", "fisher", rows, fisher(), reference="fisher"),
            Setting("lorc", "lorc", rows),
            *(
                Setting(
                    f"lorc{schedule}, skip log κ̃ > {t:g}",
                    {
                        "name": "lorc",
                        "skip_threshold": math.exp(t),
                        "schedule": schedule.strip() or "progressive",
                    },
                    rows,
                )
                for t in lorc_skips
                for schedule in ("", " uniform")
            ),  # fmt: skip
            Setting("eigen (one threshold)", {"name": "eigen", "rule": "global"}, rows),
            Setting(
                "eigen (Algorithm 1)",
                {"name": "eigen", "rule": "layerwise"},
                rows,
                {"layer_output_error": {"n_samples": rows}},
            ),
            Setting(  # the output errors on fewer rows: the statistic reruns every layer per ε step
                f"eigen (Algorithm 1, output error on {error_rows} rows)",
                {"name": "eigen", "rule": "layerwise"},
                rows,
                {"layer_output_error": {"n_samples": error_rows}},
            ),
            Setting("fisher-greedy", "fisher-greedy", rows, fisher()),
            Setting("kl", "kl", rows, kl()),
            Setting("kl + 3 refine steps on 16 rows", "kl", rows, kl(), refine_steps=3, refine_rows=16),
            Setting("kl + 3 refine steps on 32 rows", "kl", rows, kl(), refine_steps=3),  # the default
            Setting("kl + 3 refine steps on 64 rows", "kl", rows, kl(), refine_steps=3, refine_rows=64),
            Setting("kl + 6 refine steps on 32 rows", "kl", rows, kl(), refine_steps=6),
            Setting(  # a wider radius (docs/allocation.md: radius)
                "kl + 3 refine steps on 32 rows, radius 8", "kl", rows, kl(), refine_steps=3, refine_radius=8
            ),
            # the rows' own next-token loss (docs/allocation.md: objective); more rows and steps, other
            # starting plans (docs/allocation.md: starting plan)
            on_loss("kl", "kl", kl()),
            *(on_loss("kl", "kl", kl(), steps, n) for steps, n in ((3, 64), (3, 128), (3, 256), (6, 32))),
            on_loss("kl", "kl", kl(), 6, 128),
            *(on_loss("kl", "kl", kl(), 3, n, 128) for n in (32, 128)),  # accepted on rows not priced on
            # lrkv's default plan: the KL response on the first 64 rows, each step priced on 32, accepted on
            # the next 32
            on_loss("kl, KL response on 64 rows", "kl", {"kl_response": {"n_samples": 64}}, 3, 32, 32),
            on_loss("uniform", "uniform", {}),
            on_loss("fisher (Palu's rule)", "fisher", fisher()),
            on_loss("eigen (one threshold)", {"name": "eigen", "rule": "global"}, {}),
        ]
    water_fill = {"name": "fisher", "leftover": "water-fill"}
    return [
        Setting(f"fisher, {rows} rows", "fisher", rows, fisher(), reference="fisher"),
        Setting("fisher, Gram on all rows", "fisher", None, fisher()),
        Setting("fisher, Fisher on all rows", "fisher", rows, {"fisher": {}}),
        Setting("fisher, per micro-batch (Palu)", "fisher", rows, fisher(per_row=False)),
        Setting("fisher, score Σ F", {"name": "fisher", "score": "sum"}, rows, fisher()),
        Setting("fisher, leftover water-fill", water_fill, rows, fisher()),
        Setting("fisher, rank multiple 1", "fisher", rows, fisher(), rank_multiple=1),
        Setting("fisher-greedy", "fisher-greedy", rows, fisher()),
        Setting("fisher-greedy, exact solver", {"name": "fisher-greedy", "solver": "exact"}, rows, fisher()),
        Setting(f"kl, {rows} rows", "kl", rows, kl()),
        Setting("kl, greedy solver", {"name": "kl", "solver": "greedy"}, rows, kl()),
        Setting("kl, data targets", "kl", rows, kl(labels="data")),
        Setting("kl, 4 label draws per row", "kl", rows, kl(draws=4)),
        Setting("kl, KL response on all rows", "kl", rows, {"kl_response": {"n_samples": None}}),
        Setting("kl, Gram on all rows", "kl", None, kl()),
        Setting("kl, both on all rows", "kl", None, {"kl_response": {"n_samples": None}}),
        Setting("kl, rank multiple 1", "kl", rows, kl(), rank_multiple=1),
    ]


def window_nll(model, windows: torch.Tensor) -> torch.Tensor:
    """(N,) mean next-token NLL of each window, each in one forward pass through a fresh cache."""
    return torch.tensor(
        [metrics.prefill_perplexity(model, w[None])["nll"] for w in windows], dtype=torch.float64
    )


def window_kl(original, model, windows: torch.Tensor) -> torch.Tensor:
    """(N,) mean per-token KL(original ‖ model) of each window, each in one forward pass."""
    return torch.tensor(
        [metrics.kl_and_agreement(original, model, w[None])["kl"] for w in windows], dtype=torch.float64
    )


def rise(nll: torch.Tensor, base: torch.Tensor) -> float:
    return float(nll.mean().exp() - base.mean().exp())


def paired_interval(
    nll: torch.Tensor, ref: torch.Tensor, base: torch.Tensor, weight: float, draws: int = 2000
) -> list[float]:
    """95 % bootstrap interval of ``rise(nll) − weight · rise(ref)`` over resampled windows."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, len(base), (draws, len(base)), generator=gen)
    b = base[idx].mean(1).exp()
    diff = (nll[idx].mean(1).exp() - b) - weight * (ref[idx].mean(1).exp() - b)
    low, high = torch.quantile(diff, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [low, high]


def _method(text: str) -> str | dict:
    """A method's name (``whitened``) or its recipe form as JSON (``{"name": ..., ...}``)."""
    return json.loads(text) if text.lstrip().startswith("{") else text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--calibration", required=True, help="dataset spec the statistics are drawn from")
    p.add_argument(
        "--eval", required=True, action="append",
        help="dataset spec of held-out text; again for more texts, each plan measured on each",
    )  # fmt: skip
    p.add_argument("--table", choices=("allocators", "factors"), default="allocators")
    p.add_argument("--n-samples", type=int, default=256, help="calibration windows drawn ('all rows')")
    p.add_argument("--rows", type=int, default=256, help="calibration rows of every statistic unless changed")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration draw (documented rows: 0)")
    p.add_argument("--first", type=int, default=16, help="windows of the rise column (default 16)")
    p.add_argument("--max-windows", type=int, default=None, help="evaluation windows (default: all)")
    p.add_argument("--group-size", type=int, default=None, help="KV heads per group (default: auto)")
    p.add_argument(
        "--decomposition", type=_method, default="whitened",
        help='every row\'s decomposition, a name or recipe form as JSON (default: whitened, values measured '
        'after the attention, keys weighed by the loss; Palu\'s: '
        '\'{"name": "whitened", "values": "projection", "keys": "projection"}\')',
    )  # fmt: skip
    p.add_argument("--ratios", default="0.7,0.5,0.3")
    p.add_argument(
        "--settings", default=None, help="labels of the rows to run, separated by ; (default: all)"
    )
    p.add_argument(
        "--lorc-skip", default="",
        help="log κ̃ thresholds of LoRC's skip rule, comma-separated: rows 'lorc, skip log κ̃ > T' and "
        "'lorc uniform, skip log κ̃ > T' (the paper's baseline: the same layers kept, the others cut alike)",
    )  # fmt: skip
    p.add_argument(
        "--output-error-rows", type=int, default=32,
        help="rows of the layer output errors in 'eigen (Algorithm 1, output error on N rows)' (default 32)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, required=True, help="JSON lines; the markdown table goes beside (.md)")
    args = p.parse_args()
    hf_logging.set_verbosity_error()
    lorc_skips = tuple(float(t) for t in args.lorc_skip.split(",") if t.strip())
    labels = [s.label for s in settings(args.table, args.rows, lorc_skips, args.output_error_rows)]
    chosen = args.settings.split(";") if args.settings else labels
    unknown = [x for x in chosen if x not in labels]
    if unknown:
        raise SystemExit(f"unknown --settings {unknown}; the {args.table} table has: {'; '.join(labels)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = load_model(args.model)
    try:
        rows = calibration_windows(
            args.calibration, tok, n_samples=args.n_samples, seq_len=args.seq_len, seed=args.seed
        )
        held_out = {
            spec: eval_windows(spec, tok, seq_len=args.seq_len, max_windows=args.max_windows)
            for spec in dict.fromkeys(args.eval)
        }
    except (FileNotFoundError, ValueError) as e:  # a missing file, a bad spec: one line, no traceback
        raise SystemExit(f"allocation.py: {e}") from None
    texts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # eval spec -> (windows, the original's NLLs)
    for spec, windows in held_out.items():
        started = time.perf_counter()
        texts[spec] = (windows, window_nll(model, windows))
        print(f"original on {spec}: prefill PPL {float(texts[spec][1].mean().exp()):.4f} on {len(windows)} "
              f"windows ({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip

    collected: dict[str, tuple[list, float]] = {}

    def statistic(spec: dict, factors=None, key: str = "") -> tuple[list, float]:
        """Collect (once) and time one statistic; ``key`` tells apart the factors it read."""
        name = json.dumps(spec, sort_keys=True) + key
        if name not in collected:
            start = time.perf_counter()
            stat = STATISTICS.create(spec)
            values = collect_statistics(model, rows, [stat], batch_size=args.batch_size, factors=factors)
            collected[name] = (values[stat.name], time.perf_counter() - start)
            print(f"  collected {name}: {collected[name][1]:.1f} s", flush=True)
        return collected[name]

    table: list[dict[str, Any]] = []
    reference: dict[tuple[str, float, str], torch.Tensor] = {}  # (eval, ratio, "fisher"|"uniform") -> NLLs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for ratio in [float(r) for r in args.ratios.split(",")]:
        for s in settings(args.table, args.rows, lorc_skips, args.output_error_rows):
            if s.label not in chosen:
                continue
            gram_rows = s.gram_rows if s.gram_rows and s.gram_rows < len(rows) else None  # None: all
            gram_spec = {"name": "gram"} | ({"n_samples": gram_rows} if gram_rows else {})
            gram, seconds = statistic(gram_spec)
            given = {"gram": gram}
            config = CompressionConfig(
                ratio=ratio,
                group_size=args.group_size,
                decomposition=args.decomposition,
                rank_multiple=s.rank_multiple,
                allocator=s.allocator,
                refine={
                    "steps": s.refine_steps,
                    "rows": s.refine_rows,
                    "radius": s.refine_radius,
                    "objective": s.refine_objective,
                    "accept_rows": s.refine_accept_rows,
                },
            )
            for name in sorted(config.decomposition.needs - {"gram"}):  # e.g. attention_gram, on gram's rows
                given[name], spent = statistic(gram_spec | {"name": name})
                seconds += spent
            factors = None
            if any(STATISTICS.get(n).uses_factors for n in s.statistics):  # full spectra
                full = CompressionConfig(group_size=args.group_size, decomposition=args.decomposition)
                factors, _ = decompose_model(model, rows, full, statistics=given)
            for name, options in s.statistics.items():
                key = f" after gram {gram_rows}" if STATISTICS.get(name).uses_factors else ""
                if (options.get("n_samples") or 0) >= len(rows):
                    options = options | {"n_samples": None}  # all rows (kl_response alone reads 64)
                given[name], spent = statistic({"name": name, **options}, factors, key)
                seconds += spent
            start = time.perf_counter()
            try:
                conversion = plan_conversion(model, rows, config, statistics=given)
            except ValueError as e:  # e.g. LoRC's skipped layers alone exceed the budget: no plan, no row
                print(f"{ratio} {s.label}: no plan: {e}", flush=True)
                continue
            compressed = conversion.apply(copy.deepcopy(model))
            plan_seconds = time.perf_counter() - start
            for spec, (windows, base) in texts.items():
                nll = window_nll(compressed, windows)
                kl = window_kl(model, compressed, windows[: args.first])
                row = {
                    "model": args.model,
                    "calibration": args.calibration,
                    "eval": spec,
                    "table": args.table,
                    "setting": s.label,
                    "decomposition": config.decomposition.to_dict(),
                    "allocator": config.allocator.to_dict(),
                    "ratio": ratio,
                    "seed": args.seed,
                    "kept": conversion.plan.achieved_ratio,
                    "rise": rise(nll[: args.first], base[: args.first]),
                    "rise_all": rise(nll, base),
                    "kl": float(kl.mean()),
                    "statistics_s": seconds,
                    "plan_and_fuse_s": plan_seconds,
                    "windows": [min(args.first, len(windows)), len(windows)],
                    "ranks": conversion.plan.ranks,
                    "refine": conversion.plan.details.get("refine"),
                    "nll": nll.tolist(),  # per window: rows of other runs on the same text compare pairwise
                    "base_nll": base.tolist(),  # the original's, window by window
                }
                if s.reference:
                    reference[(spec, ratio, s.reference)] = nll
                for ref_name, column, weight in (
                    ("fisher", "vs_half_palu", 0.5),
                    ("uniform", "vs_uniform", 1.0),
                ):
                    if (spec, ratio, ref_name) in reference and s.reference != ref_name:
                        ref = reference[(spec, ratio, ref_name)]
                        row[column] = paired_interval(
                            nll[: args.first], ref[: args.first], base[: args.first], weight
                        )
                table.append(row)
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                on = f" on {spec}" if len(texts) > 1 else ""
                print(f"{ratio} {s.label}{on}: rise {row['rise']:+.4f} (all {row['rise_all']:+.4f}), "
                      f"KL {row['kl']:.5f}, "
                      f"{seconds:.1f} s of statistics", flush=True)  # fmt: skip
            del compressed
    sections = [
        (f"On `{spec}`:\n\n" if len(texts) > 1 else "")
        + markdown([r for r in table if r["eval"] == spec], base, args.first)
        for spec, (_, base) in texts.items()
    ]
    args.out.with_suffix(".md").write_text("\n\n".join(sections) + "\n")


def markdown(table: list[dict[str, Any]], base: torch.Tensor, first: int) -> str:
    """The rows of one text as a markdown table, under the original's perplexities."""
    first = min(first, len(base))
    lines = [
        f"Original prefill PPL {float(base[:first].mean().exp()):.4f} on the first {first} windows, "
        f"{float(base.mean().exp()):.4f} on all {len(base)}.",
        "",
        f"| ratio | setting | kept | rise ({first} windows) | rise (all) | KL ({first} windows) | "
        "− ½ Palu's rise (95 % CI) | − uniform's (95 % CI) | statistics s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        cells = [
            f"[{r[c][0]:+.3f}, {r[c][1]:+.3f}]" if c in r else "" for c in ("vs_half_palu", "vs_uniform")
        ]
        lines.append(
            f"| {r['ratio']} | {r['setting']} | {r['kept']:.4f} | {r['rise']:+.4f} | {r['rise_all']:+.4f} | "
            f"{r['kl']:.5f} | {cells[0]} | {cells[1]} | {r['statistics_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
