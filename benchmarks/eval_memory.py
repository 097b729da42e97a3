"""The resident memory the evaluation's prefill perplexity and KL to the original hold, by logits budget and
with or without the tensors the two models have in common held once.

Each setting runs in a fresh process (one setting's freed memory does not count for the next), in the order
:func:`lrkv_core.conversion.pipeline.evaluate_dir` takes: the compressed model loaded and
:func:`lrkv_core.evaluation.metrics.prefill_perplexity` of it on ``--windows`` held-out windows (batches of
8), then the original loaded (with ``share``, :func:`lrkv_core.model.loading.share_equal_weights`, as the
evaluation does) and :func:`~lrkv_core.evaluation.metrics.kl_and_agreement` against it, with
``LOGITS_BYTES`` set to each budget (a budget above a batch's logits scores the whole batch in one pass).
Printed: the RSS with the compressed model loaded, each call's peak RSS, and its result (the same for every
setting).

    python benchmarks/eval_memory.py --compressed smol-256 --budgets 64GiB,64MiB
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def measure(base_dir: str, compressed_dir: str, text: str, windows: int, budget: int, share: bool) -> dict:
    import torch

    from lrkv_core.data.datasets import eval_windows
    from lrkv_core.evaluation import metrics
    from lrkv_core.model.loading import load_model, share_equal_weights
    from lrkv_core.system.memory import current_rss, peak_rss

    torch.set_num_threads(1)
    metrics.LOGITS_BYTES = budget
    comp, tok = load_model(compressed_dir)
    ids = eval_windows(text, tok, seq_len=256, max_windows=windows)
    loaded = current_rss()
    with peak_rss() as prefill:
        ppl = metrics.prefill_perplexity(comp, ids)["ppl"]
    with peak_rss() as kl:
        base, _ = load_model(base_dir)
        if share:
            share_equal_weights(comp, base)
        res = metrics.kl_and_agreement(base, comp, ids)
    return {
        "loaded": loaded / 2**30,
        "prefill": prefill.peak / 2**30,
        "kl": kl.peak / 2**30,
        "result": [round(ppl, 4), round(res["kl"], 5), round(res["top1_agreement"], 4)],
    }


def parse_bytes(text: str) -> int:
    for unit, size in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * size)
    return int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.expanduser("~/.cache/lrkv-assets/smollm2-135m"))
    p.add_argument("--compressed", required=True, help="a compressed model directory of --model")
    default_text = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2/valid.txt"
    p.add_argument("--text", default=f"text:{default_text}[80%:90%]", help="evaluation data (a dataset spec)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--budgets", default="64GiB,64MiB", help="comma list of LOGITS_BYTES (e.g. 64MiB)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # BUDGET,SHARE: measure in this process, print JSON
    args = p.parse_args()
    if args.one:
        budget, share = args.one.split(",")
        print(
            json.dumps(
                measure(args.model, args.compressed, args.text, args.windows, int(budget), share == "1")
            )
        )
        return
    print(
        "| logits budget | tensors in common | compressed loaded | prefill peak | KL peak | PPL, KL, top-1 |"
    )
    print("|---|---|---|---|---|---|")
    for budget in args.budgets.split(","):
        for share in (0, 1):
            out = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--one", f"{parse_bytes(budget)},{share}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            held = "held once" if share else "held twice"
            peaks = f"{r['loaded']:.2f} | {r['prefill']:.2f} | {r['kl']:.2f}"
            print(f"| {budget} | {held} | {peaks} | {r['result']} |", flush=True)


if __name__ == "__main__":
    main()
