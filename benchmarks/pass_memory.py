"""The resident memory one pass over calibration rows holds, by rows × tokens: a forward pass (what the Gram
statistics run) and a gradient pass (what the Fisher statistics, the KL response and the refinement run),
with the rows' own next tokens and with targets drawn from the model's predictions.

Each setting runs in a fresh process, so one setting's freed memory does not count for the next; printed:
the RSS with the model loaded, each pass's peak (:mod:`lrkv_core.system.memory`) and the seconds of the
gradient pass with the rows' own tokens. Random token ids: the memory depends on the shapes, not the values.
``--heap`` keeps a long row's temporaries on the heap (``MAP_LONG_ROWS`` off), to see what mapping them
saves and costs.

    python benchmarks/pass_memory.py --model ~/.cache/lrkv-assets/smollm2-135m --settings 2x256,4x256,1x2048
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def measure(model_dir: str, rows: int, tokens: int, threads: int, heap: bool) -> dict:
    import torch

    from lrkv_core.model.loading import load_model
    from lrkv_core.statistics import gradients
    from lrkv_core.statistics.gradients import kv_gradient_passes, row_seeded_targets
    from lrkv_core.system.memory import current_rss, peak_rss

    gradients.MAP_LONG_ROWS = not heap
    torch.set_num_threads(threads)
    model, _ = load_model(model_dir)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(0))
    loaded = current_rss()
    with torch.no_grad(), peak_rss() as forward:
        model(ids, use_cache=False)
    start = time.perf_counter()
    with peak_rss() as data:
        kv_gradient_passes(model, ids, lambda *_: None, batch_size=rows)
    seconds = time.perf_counter() - start
    with peak_rss() as sampled:
        kv_gradient_passes(model, ids, lambda *_: None, batch_size=rows, targets=row_seeded_targets(0))
    peaks = {"loaded": loaded, "forward": forward.peak, "data": data.peak, "sampled": sampled.peak}
    return {"peaks": peaks, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model directory")
    p.add_argument("--settings", default="2x256,4x256,8x256,1x2048", help="comma list of ROWSxTOKENS")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--heap", action="store_true", help="keep a long row's temporaries on the heap")
    p.add_argument("--one", help=argparse.SUPPRESS)  # ROWSxTOKENS: measure in this process, print JSON
    args = p.parse_args()
    if args.one:
        rows, tokens = map(int, args.one.split("x"))
        print(json.dumps(measure(args.model, rows, tokens, args.threads, args.heap)))
        return
    where = "; long rows' temporaries on the heap" if args.heap else ""
    print(f"{args.model}, {args.threads} thread(s); peak RSS in GiB, each setting in a fresh process{where}")
    print("| rows × tokens | tokens | loaded | forward | gradient (data) | gradient (sampled) | seconds |")
    print("|---|---|---|---|---|---|---|")
    for setting in args.settings.split(","):
        rows, tokens = map(int, setting.split("x"))
        cmd = [sys.executable, __file__, "--model", args.model, "--threads", str(args.threads)]
        cmd += ["--one", setting] + (["--heap"] if args.heap else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        r = {k: v / 2**30 for k, v in result["peaks"].items()}
        print(
            f"| {rows} × {tokens} | {rows * tokens} | {r['loaded']:.2f} | {r['forward']:.2f} "
            f"| {r['data']:.2f} | {r['sampled']:.2f} | {result['seconds']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
