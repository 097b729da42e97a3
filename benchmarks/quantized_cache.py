"""The quantized-cache table: low-rank ratio × rotation × bits (× residual window) on one model, next to the
original model and transformers' own QuantizedCache on it (the anchor), with measured bytes per token;
with ``--gear``, GEAR's corrections of the same quantized latents (the ``gear`` storage) at the same bits.

    S=../shared
    python benchmarks/quantized_cache.py --model $S/models/shakespeare-llama \\
        --calibration text:$S/data/shakespeare/train.txt --eval text:$S/data/shakespeare/valid.txt \\
        --out docs/quantized-cache/shakespeare-llama.md

Protocol (every number below carries it): the model is calibrated once (``--n-samples`` seeded windows of
``--seq-len`` tokens of ``--calibration``; whitened SVD, uniform ranks rounded to ``--rank-multiple``, the
default group size), each ratio is planned once, each rotation fused once, and each cache storage is then
switched in through the model-format section (``config.lrkv["cache"]``), as a loaded model would read it.
Prefill PPL: the first ``--max-windows`` non-overlapping windows of ``--eval``, each in one forward pass
through the cache (so a quantized latent cache is read back quantized, Palu's protocol). Decode PPL: the
first ``--decode-windows`` of them, prefilled with ``--decode-prefix`` tokens, then teacher-forced one
token at a time through the cache. Bytes per token: every tensor the cache holds after prefilling one
window (packed codes, fp16 scales and zero-points, int32 positions, full-precision windows), against the
original model's DynamicCache for the same tokens in float32 (measured) and in 16 bits (the same cache in
bfloat16: what Palu's ratios are relative to).
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lrkv_core import evaluate
from lrkv_core.convert import CompressionConfig, collect_statistics, plan_conversion
from lrkv_core.data import eval_windows, extract_calibration, read_token_rows
from lrkv_core.hf_quantized_cache import HfQuantizedCacheSpec
from lrkv_core.models import load_model

COLUMNS = ["model", "ratio", "rotation", "bits", "residual", "prefill PPL", "decode PPL", "KV bytes/token",
           "× fp32 cache", "× 16-bit cache"]  # fmt: skip


Emit = Callable[[dict[str, Any]], dict[str, Any]]


def _csv(text: str, cast=str) -> list:
    return [cast(v) for v in text.split(",") if v.strip()]


def measure(model, windows: torch.Tensor, args, cache_factory=None) -> dict[str, Any]:
    """Prefill PPL, decode PPL and bytes per token under the protocol (see the module docstring)."""
    start = time.perf_counter()
    prefill = evaluate.prefill_perplexity(
        model, windows, batch_size=args.batch_size, cache_factory=cache_factory
    )
    decode = evaluate.decode_perplexity(
        model,
        windows[: args.decode_windows],
        prefix_len=args.decode_prefix,
        batch_size=args.batch_size,
        cache_factory=cache_factory,
    )
    kv = evaluate.kv_bytes_per_token(model, windows, cache_factory=cache_factory)
    half = evaluate.dense_kv_bytes(model.config, 1, windows.shape[1], torch.bfloat16) / windows.shape[1]
    return {
        "prefill_ppl": prefill["ppl"],
        "decode_ppl": decode["ppl"],
        "kv_bytes_per_token": kv["kv_bytes_per_token"],
        "x_fp32": kv["kv_compression_ratio"],
        "x_16bit": half / kv["kv_bytes_per_token"],
        "cache_class": kv["cache_class"],
        "seconds": time.perf_counter() - start,
    }


def load_inputs(args) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``(model, calibration rows (N, T), evaluation windows (N, T))`` under the protocol: ``--n-samples``
    seeded windows of ``--seq-len`` tokens of ``--calibration``, the first ``--max-windows`` of ``--eval``."""
    model, tokenizer = load_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/calibration.parquet"
        extract_calibration(
            args.calibration, tokenizer, n_samples=args.n_samples, seq_len=args.seq_len, seed=0, out_path=path
        )
        rows = read_token_rows(path)  # (N, T)
    return model, rows, eval_windows(args.eval, tokenizer, seq_len=args.seq_len, max_windows=args.max_windows)


def storage(bits: int, residual: int, group: int | None) -> dict[str, Any]:
    return {"name": "quantized", "bits": bits, "quant_group_size": group, "residual": residual}


def gear_storage(variant: str, bits: int, group: int | None) -> dict[str, Any]:
    """``OUTLIERS:RANK:BUFFER`` as the gear storage at ``bits``, in lrkv's chunked variant (a count of
    outliers per token and group, an exact SVD per chunk of ``BUFFER`` tokens)."""
    outliers, rank, buffer = (int(v) for v in variant.split(":"))
    return {"name": "gear", "bits": bits, "quant_group_size": group, "outliers": outliers, "outlier_share": 0,
            "solver": "svd", "mode": "chunked", "rank": rank, "buffer": buffer}  # fmt: skip


def run_lrkv(model, rows: torch.Tensor, windows: torch.Tensor, args, emit: Emit) -> list[dict[str, Any]]:
    """Every ratio × rotation × bits × residual of the grid, in that nesting (one plan per ratio)."""
    base = CompressionConfig(
        group_size=args.group_size, rank_multiple=args.rank_multiple, allocator="uniform"
    ).for_model(model.config)
    stats = collect_statistics(model, rows, base.needed_statistics())  # the Gram, once
    out = []
    for ratio in args.ratios:
        conversion = plan_conversion(model, rows, replace(base, ratio=ratio), statistics=stats)
        for rotation in args.rotations:
            planned = replace(conversion, config=replace(conversion.config, rotation=rotation))
            compressed = planned.apply(copy.deepcopy(model))
            for bits in args.bits:
                for residual in args.residuals:
                    compressed.config.lrkv["cache"] = storage(bits, residual, args.quant_group_size)
                    row = {"model": "lrkv", "ratio": ratio, "achieved_ratio": conversion.plan.achieved_ratio,
                           "rotation": rotation, "bits": bits, "residual": residual}  # fmt: skip
                    row |= measure(compressed, windows, args)
                    out.append(emit(row))
                for variant in args.gear if bits != 16 else []:
                    compressed.config.lrkv["cache"] = gear_storage(variant, bits, args.quant_group_size)
                    row = {"model": f"lrkv + GEAR {variant}", "ratio": ratio, "rotation": rotation,
                           "bits": bits, "achieved_ratio": conversion.plan.achieved_ratio,
                           "residual": f"< {compressed.config.lrkv['cache']['buffer']}"}  # fmt: skip
                    row |= measure(compressed, windows, args)
                    out.append(emit(row))
    return out


def run_anchor(model, windows: torch.Tensor, args, emit: Emit) -> list[dict[str, Any]]:
    """transformers' QuantizedCache on the original model, each spec of ``--anchor``."""
    out = []
    for text in args.anchor:
        spec = HfQuantizedCacheSpec.parse(text)
        try:
            row = measure(model, windows, args, cache_factory=lambda spec=spec: spec.make(model.config))
        except (ImportError, RuntimeError, ValueError) as err:  # an optional install, or the backend's bug
            row = {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
        row |= {"model": f"QuantizedCache[{spec.backend}]", "ratio": 1.0, "rotation": "—", "bits": spec.bits,
                "residual": spec.residual_length, "group": spec.q_group_size}  # fmt: skip
        out.append(emit(row))
    return out


def _fmt(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if value is None:
        return row.get("error", "") if key == "prefill_ppl" else ""
    return (
        f"{value:.2f}" if key.startswith("x_") else f"{value:.4f}" if isinstance(value, float) else str(value)
    )


def _line(row: dict[str, Any]) -> str:
    keys = ("model", "ratio", "rotation", "bits", "residual", "prefill_ppl", "decode_ppl",
            "kv_bytes_per_token", "x_fp32", "x_16bit", "seconds")  # fmt: skip
    return " | ".join(_fmt(row, k) for k in keys)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    keys = ("model", "ratio", "rotation", "bits", "residual", "prefill_ppl", "decode_ppl",
            "kv_bytes_per_token", "x_fp32", "x_16bit")  # fmt: skip
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    return head + "\n".join("| " + " | ".join(_fmt(r, k) for k in keys) + " |" for r in rows) + "\n"


def rotation_effect(rows: list[dict[str, Any]]) -> str:
    """Decode PPL without → with rotation (auto), for every (ratio, bits, residual) that has both."""
    by = {(r["ratio"], r["bits"], r["residual"], r["rotation"]): r for r in rows if r["model"] == "lrkv"}
    lines = []
    for (ratio, bits, residual, rotation), row in sorted(by.items()):
        other = by.get((ratio, bits, residual, "auto"))
        if rotation == "none" and other is not None:
            lines.append(
                f"- ratio {ratio}, {bits} bits, residual {residual}: decode PPL {row['decode_ppl']:.3f} → "
                f"{other['decode_ppl']:.3f}, prefill {row['prefill_ppl']:.3f} → {other['prefill_ppl']:.3f}"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument(
        "--calibration", required=True, help="dataset spec, e.g. text:train.txt or text:x.txt[:90%%]"
    )
    p.add_argument("--eval", required=True, help="dataset spec of held-out text")
    p.add_argument("--n-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-windows", type=int, default=32)
    p.add_argument("--decode-windows", type=int, default=16)
    p.add_argument("--decode-prefix", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--group-size", type=int, default=None, help="KV heads per group (default: auto)")
    p.add_argument("--rank-multiple", type=int, default=8)
    p.add_argument("--ratios", type=lambda s: _csv(s, float), default=[1.0, 0.5, 0.3])
    p.add_argument("--rotations", type=_csv, default=["none", "auto"])
    p.add_argument("--bits", type=lambda s: _csv(s, int), default=[2, 3, 4, 16])
    p.add_argument("--residuals", type=lambda s: _csv(s, int), default=[0])
    p.add_argument("--quant-group-size", type=int, default=None, help="default: a whole latent group row")
    p.add_argument(
        "--gear", type=_csv, default=[], help="GEAR variants OUTLIERS:RANK:BUFFER, e.g. 1:2:32 (bits < 16)"
    )
    p.add_argument("--anchor", type=_csv, default=["hqq:2", "hqq:3", "hqq:4", "quanto:2", "quanto:4"],
                   help="QuantizedCache specs BACKEND:BITS[:GROUP[:RESIDUAL]]; '' for none")  # fmt: skip
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="write the markdown section here")
    p.add_argument("--jsonl", type=Path, help="append every row here as it is measured (JSON lines)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, rows, windows = load_inputs(args)

    def emit(row: dict[str, Any]) -> dict[str, Any]:
        print(_line(row), file=sys.stderr, flush=True)
        if args.jsonl:
            with args.jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    original = {"model": "original", "ratio": 1.0, "rotation": "—", "bits": 32, "residual": 0}
    original = emit(original | measure(model, windows, args))
    results = [original, *run_lrkv(model, rows, windows, args, emit), *run_anchor(model, windows, args, emit)]
    minutes = (time.perf_counter() - start) / 60
    n_decode = min(args.decode_windows, windows.shape[0])
    section = (
        f"## {Path(args.model).name}\n\n"
        f"Measured {time.strftime('%Y-%m-%d')} (CPU, float32, {args.threads} threads, {minutes:.1f} min):\n\n"
        f"```bash\npython benchmarks/quantized_cache.py {shlex.join(sys.argv[1:])}\n```\n\n"
        f"Protocol: calibration {args.n_samples} × {args.seq_len} tokens of `{args.calibration}` (seed 0); "
        f"prefill PPL on {windows.shape[0]} windows of {args.seq_len} tokens of `{args.eval}` through the "
        f"cache; decode PPL on {n_decode} of them after a {args.decode_prefix}-token prefix; "
        f"quantization group: {args.quant_group_size or 'a whole latent group row'}; rank multiple "
        f"{args.rank_multiple}. `ratio` is the kept KV width (1.0: full rank, the factors only); bits 16 are "
        "float16 latents; `× fp32 cache` and `× 16-bit cache` divide the original model's DynamicCache bytes "
        "(float32, and the same cache in 16 bits) by the measured bytes. `lrkv + GEAR o:r:b`: the same "
        "quantized latents with o exact outliers per token and quantization group and a rank-r residual "
        "per latent group and chunk, b tokens kept as given until they are compressed together "
        "(`residual` < b); KV bytes are measured after one prefilled window, which is one chunk: decoding "
        "adds a chunk's bases every b tokens.\n\n"
        + markdown_table(results)
        + (f"\nRotation (none → auto):\n\n{effect}\n" if (effect := rotation_effect(results)) else "")
    )
    print(section)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(section)


if __name__ == "__main__":
    main()
