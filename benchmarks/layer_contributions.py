"""How much each decoder layer adds to the residual stream, against the stream itself, on calibration rows.

Eigen Attention's Algorithm 1 (``{name: eigen, rule: layerwise}``) compares a layer's output with its K/V
projections cut against the original output, relative to the output's norm, ``‖X'_{l+1} − X_{l+1}‖² /
‖X_{l+1}‖²``, with one budget for every layer. The error is a change of what the layer adds to the stream,
so where the stream carries a large activation the layer only passes on, its own share of the output
(``‖X_{l+1} − X_l‖² / ‖X_{l+1}‖²``) is small, the error stays small under deep cuts, and the rule cuts the
layer deep. Printed per layer, over the rows' tokens: the output's mean squared norm per token, the layer's
share, and the largest |entry|.

    python benchmarks/layer_contributions.py --model ~/.cache/lrkv-assets/smollm2-135m \
        --dataset "text:../shared/data/wikitext-2/valid.txt[:80%]" --rows 8
"""

from __future__ import annotations

import argparse

import torch

from lrkv_core.data.datasets import calibration_windows
from lrkv_core.model.adapters import get_adapter
from lrkv_core.model.loading import load_model


@torch.no_grad()
def layer_contributions(model, rows: torch.Tensor) -> list[dict[str, float]]:
    """Per decoder layer: ``norm`` (mean ‖X_{l+1}‖² per token), ``share`` (‖X_{l+1} − X_l‖² / ‖X_{l+1}‖²
    over every token) and ``max_abs`` (the largest |X_{l+1}| entry)."""
    layers = get_adapter(model.config).layers(model)
    sums = [{"out": 0.0, "delta": 0.0, "max_abs": 0.0, "tokens": 0} for _ in layers]

    def hook(i: int):
        def record(_module, args, output) -> None:
            out = output[0] if isinstance(output, tuple) else output
            s = sums[i]
            s["out"] += float(out.double().square().sum())
            s["delta"] += float((out - args[0]).double().square().sum())
            s["max_abs"] = max(s["max_abs"], float(out.abs().max()))
            s["tokens"] += out.shape[0] * out.shape[1]

        return record

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        for row in rows:
            model(row[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [
        {"norm": s["out"] / s["tokens"], "share": s["delta"] / s["out"], "max_abs": s["max_abs"]}
        for s in sums
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True, help="dataset spec of the calibration text")
    p.add_argument("--rows", type=int, default=8, help="calibration windows drawn (seed 0)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    rows = calibration_windows(args.dataset, tok, n_samples=args.rows, seq_len=args.seq_len, seed=0)
    print("| layer | mean ‖X_out‖² per token | layer's share ‖X_out − X_in‖² / ‖X_out‖² | max abs entry |")
    print("|---|---|---|---|")
    for i, c in enumerate(layer_contributions(model, rows)):
        print(f"| {i} | {c['norm']:.3e} | {c['share']:.2e} | {c['max_abs']:.1f} |")


if __name__ == "__main__":
    main()
