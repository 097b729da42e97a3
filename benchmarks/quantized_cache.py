"""The quantized-cache table: low-rank ratio × rotation × bits (× residual window) on one model, next to the
original model and transformers' own QuantizedCache on it (the anchor), with measured bytes per token;
with ``--gear`` (lrkv's variant ``o:r:b``) or ``--gear-specs`` (a preset or a full storage mapping), GEAR's
corrections of the same quantized latents (the ``gear`` storage) at the same bits.

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
bfloat16: what Palu's ratios are relative to); and every tensor the cache holds at the end of the decode
evaluation (each batch's, after T − 1 tokens: the steady state of a decode, with the buffer, a chunked
cache's bases and the outliers as decoding left them), per held token.
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
import yaml

from lrkv_core.cache.gear import GearStorage
from lrkv_core.conversion.convert import CompressionConfig, collect_statistics, plan_conversion
from lrkv_core.data.datasets import eval_windows, extract_calibration, read_token_rows
from lrkv_core.evaluation import metrics
from lrkv_core.evaluation.hf_quantized_cache import HfQuantizedCacheSpec
from lrkv_core.model.fuse import compress_model
from lrkv_core.model.loading import load_model

COLUMNS = ["model", "ratio", "rotation", "bits", "residual", "prefill PPL", "decode PPL", "KV bytes/token",
           "× fp32 cache", "× 16-bit cache", "KV bytes/token, end of decode"]  # fmt: skip
KEYS = ("model", "ratio", "rotation", "bits", "residual", "prefill_ppl", "decode_ppl", "kv_bytes_per_token",
        "x_fp32", "x_16bit", "decode_kv_bytes_per_token")  # fmt: skip
GEAR_PRESETS = {
    "paper": {"name": "gear"},  # the storage's defaults: GEAR's rule (share 0.02, power, whole, buffer 20)
    "paper-chunked": {"name": "gear", "mode": "chunked"},
    # the paper's rank rule, r = max(1, ⌊ρ · min(n, r_g)⌋), at both of its values of ρ
    "paper-rho-0.02": {"name": "gear", "rank": None, "rank_share": 0.02},
    "paper-rho-0.05": {"name": "gear", "rank": None, "rank_share": 0.05},
}


Emit = Callable[[dict[str, Any]], dict[str, Any]]


def _csv(text: str, cast=str) -> list:
    return [cast(v) for v in text.split(",") if v.strip()]


def measure(model, windows: torch.Tensor, args, cache_factory=None) -> dict[str, Any]:
    """Prefill PPL, decode PPL and bytes per token under the protocol (see the module docstring)."""
    start = time.perf_counter()
    prefill = metrics.prefill_perplexity(
        model, windows, batch_size=args.batch_size, cache_factory=cache_factory
    )
    decode = metrics.decode_perplexity(
        model,
        windows[: args.decode_windows],
        prefix_len=args.decode_prefix,
        batch_size=args.batch_size,
        cache_factory=cache_factory,
    )
    kv = metrics.kv_bytes_per_token(model, windows, cache_factory=cache_factory)
    half = metrics.dense_kv_bytes(model.config, 1, windows.shape[1], torch.bfloat16) / windows.shape[1]
    return {
        "prefill_ppl": prefill["ppl"],
        "decode_ppl": decode["ppl"],
        "kv_bytes_per_token": kv["kv_bytes_per_token"],
        "x_fp32": kv["kv_compression_ratio"],
        "x_16bit": half / kv["kv_bytes_per_token"],
        "decode_kv_bytes_per_token": decode["kv_bytes_per_token"],
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


def _variant(variant: str) -> dict[str, Any]:
    """:func:`gear_storage` without its bits and quantization group (filled in per row)."""
    spec = gear_storage(variant, 0, None)
    del spec["bits"], spec["quant_group_size"]
    return spec


def gear_spec(text: str) -> tuple[str, dict[str, Any]]:
    """``(label, storage)`` of a ``--gear-specs`` item: a preset of :data:`GEAR_PRESETS`, ``variant-o:r:b``
    (:func:`gear_storage`) or a YAML mapping of the gear storage; its bits are filled in per row."""
    if text in GEAR_PRESETS:
        return text, dict(GEAR_PRESETS[text])
    if text.startswith("variant-"):
        return text, _variant(text.removeprefix("variant-"))
    spec = yaml.safe_load(text)
    if not isinstance(spec, dict) or spec.get("name") != "gear":
        raise argparse.ArgumentTypeError(f"not a gear preset, variant-o:r:b or gear mapping: {text!r}")
    return text, spec


def gear_at(spec: dict[str, Any], bits: int, group: int | None) -> dict[str, Any]:
    """``spec`` at ``bits``, with ``--quant-group-size`` unless the spec gives its own."""
    return {"quant_group_size": group} | spec | {"bits": bits}


def run_lrkv(model, rows: torch.Tensor, windows: torch.Tensor, args, emit: Emit) -> list[dict[str, Any]]:
    """Every ratio × rotation × bits × residual of the grid, in that nesting (one plan per ratio)."""
    base = CompressionConfig(
        group_size=args.group_size,
        rank_multiple=args.rank_multiple,
        allocator="uniform",
        decomposition=args.decomposition,
    ).for_model(model.config)
    stats = collect_statistics(model, rows, base.needed_statistics())  # the Gram, once
    gears = [(v, _variant(v)) for v in args.gear] + list(args.gear_specs)
    out = []
    for ratio in args.ratios:
        conversion = plan_conversion(model, rows, replace(base, ratio=ratio), statistics=stats)
        for rotation in args.rotations:
            build = conversion.graph["build"].params | {"rotation": rotation}  # the fused rotation
            compressed = compress_model(copy.deepcopy(model), conversion.factors, conversion.plan, **build)
            for bits in args.bits:
                for residual in args.residuals:
                    compressed.config.lrkv["cache"] = storage(bits, residual, args.quant_group_size)
                    row = {"model": "lrkv", "ratio": ratio, "achieved_ratio": conversion.plan.achieved_ratio,
                           "rotation": rotation, "bits": bits, "residual": residual}  # fmt: skip
                    row |= measure(compressed, windows, args)
                    out.append(emit(row))
                for label, spec in gears if bits != 16 else []:
                    compressed.config.lrkv["cache"] = cache = gear_at(spec, bits, args.quant_group_size)
                    row = {"model": f"lrkv + GEAR {label}", "ratio": ratio, "rotation": rotation,
                           "bits": bits, "achieved_ratio": conversion.plan.achieved_ratio,
                           "residual": f"< {cache.get('buffer', GearStorage.buffer)}",
                           "storage": cache}  # fmt: skip
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
    return " | ".join(_fmt(row, k) for k in (*KEYS, "seconds"))


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    return head + "\n".join("| " + " | ".join(_fmt(r, k) for k in KEYS) + " |" for r in rows) + "\n"


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
    p.add_argument("--decomposition", type=yaml.safe_load, default="whitened",
                   help="name or YAML mapping, e.g. '{name: whitened, values: projection, keys: projection}' "
                        "(Palu's)")  # fmt: skip
    p.add_argument("--ratios", type=lambda s: _csv(s, float), default=[1.0, 0.5, 0.3])
    p.add_argument("--rotations", type=_csv, default=["none", "auto"])
    p.add_argument("--bits", type=lambda s: _csv(s, int), default=[2, 3, 4, 16])
    p.add_argument("--residuals", type=lambda s: _csv(s, int), default=[0])
    p.add_argument("--quant-group-size", type=int, default=None, help="default: a whole latent group row")
    p.add_argument(
        "--gear", type=_csv, default=[], help="GEAR variants OUTLIERS:RANK:BUFFER, e.g. 1:2:32 (bits < 16)"
    )
    p.add_argument(
        "--gear-specs",
        type=gear_spec,
        nargs="+",
        default=[],
        help="gear storages, bits filled per row: 'paper', 'paper-chunked', 'paper-rho-0.02', "
        "'paper-rho-0.05', 'variant-1:2:32' or a YAML mapping such as '{name: gear, mode: chunked, rank: 4}' "
        "(bits < 16)",
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
        f"Measured (CPU, float32, {args.threads} threads, {minutes:.1f} min):\n\n"
        f"```bash\npython benchmarks/quantized_cache.py {shlex.join(sys.argv[1:])}\n```\n\n"
        f"Protocol: calibration {args.n_samples} × {args.seq_len} tokens of `{args.calibration}` (seed 0); "
        f"prefill PPL on {windows.shape[0]} windows of {args.seq_len} tokens of `{args.eval}` through the "
        f"cache; decode PPL on {n_decode} of them after a {args.decode_prefix}-token prefix; "
        f"quantization group: {args.quant_group_size or 'a whole latent group row'}; rank multiple "
        f"{args.rank_multiple}; decomposition `{json.dumps(args.decomposition)}`. `ratio` is the kept KV "
        "width (1.0: full rank, the factors only); bits 16 are float16 latents; `× fp32 cache` and "
        "`× 16-bit cache` divide the original model's DynamicCache bytes (float32, and the same cache in "
        "16 bits) by the measured bytes. `lrkv + GEAR o:r:b`: the same "
        "quantized latents with o exact outliers per token and quantization group and a rank-r residual "
        "per latent group and chunk, b tokens kept as given until they are compressed together "
        "(`residual` < b); `variant-o:r:b` is the same, `paper` the gear storage's defaults (GEAR's rule: "
        "2 % of the entries as outliers, power iteration, the whole cache compressed again every 20 "
        "tokens), `paper-chunked` the same with `mode: chunked`, `paper-rho-ρ` the same with the paper's "
        "rank rule (max(1, ⌊ρ · min(n, r_g)⌋) per latent group of width r_g and segment of n tokens) "
        "instead of rank 2. KV bytes/token is measured after one "
        "prefilled window; `end of decode` is every tensor the cache holds after the decode evaluation "
        f"({args.seq_len - 1} tokens per row of each batch: the buffer, a chunked cache's bases and the "
        "outliers included), per token.\n\n"
        + markdown_table(results)
        + (f"\nRotation (none → auto):\n\n{effect}\n" if (effect := rotation_effect(results)) else "")
    )
    print(section)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(section)


if __name__ == "__main__":
    main()
