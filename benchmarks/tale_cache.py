"""The tale-cache table: token-adaptive ranks against a uniform plan holding the same bytes, on one model.

    S=../shared
    python benchmarks/tale_cache.py --model $S/models/shakespeare-llama \\
        --calibration text:$S/data/shakespeare/train.txt --eval text:$S/data/shakespeare/valid.txt \\
        --out docs/tale-cache/shakespeare-llama.md

Protocol (as ``quantized_cache.py``'s, whose ``measure`` this uses): the model is calibrated once
(``--n-samples`` seeded windows of ``--seq-len`` tokens of ``--calibration``; whitened SVD, uniform ranks,
rank multiple 1, the default group size) and planned at ``--ratio``. Each ``LOW:KEEP`` of ``--variants``,
under each rule of ``--rules`` (``recency``: TALE's; ``energy``: lrkv's), switches that model's cache to
``{name: tale, rule: RULE, low: LOW, keep: KEEP, sink: --sink, buffer: --buffer}``; its
bytes per token are measured after one prefilled window, and a second model is planned with uniform ranks at
the ratio whose dense latents take the same bytes (the ratio scaled by the tale cache's latent bytes over the
dense cache's, positions excluded from both), so each tale row has a uniform row of equal memory below it.
Prefill PPL: the first ``--max-windows`` windows of ``--eval``, each in one pass through the cache (every
token of a window that is a whole number of buffers is cut, so prefill shows the cut alone). Decode PPL: the
first ``--decode-windows`` of them after a ``--decode-prefix``-token prefill, one token at a time (the lazy
buffer keeps up to ``--buffer`` − 1 of the newest tokens whole). ``--random`` adds each variant with its whole
tokens drawn at random (the control of the energy rule); ``--bits 4,3`` adds each variant with both levels
at those bits, next to the same plan's latents quantized whole after a fused rotation (``quantized``);
``--levels 2:4`` adds each variant with the low level at 2 bits and the full level at 4 (TALE's setting).
A uniform row is measured once per byte count (two rules holding the same bytes share it)."""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from quantized_cache import load_inputs, measure  # benchmarks/, the script's own directory

from lrkv_core.cache import CACHE_STORAGES, TaleStorage, TaleStore
from lrkv_core.conversion.convert import CompressionConfig, collect_statistics, plan_conversion
from lrkv_core.format import LrkvFormat


class RandomTaleStore(TaleStore):
    """The control: tokens kept whole drawn at random (seeded), not by significance."""

    generator = torch.Generator().manual_seed(0)

    def significance(self, tail: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return torch.rand(tail.shape[:2], generator=self.generator).to(tail.device)


@CACHE_STORAGES.register
@dataclass(frozen=True)
class RandomTaleStorage(TaleStorage):
    """tale with the tokens kept whole drawn at random: what the significance rule is measured against."""

    name: ClassVar[str] = "tale-random"
    store: ClassVar[type[TaleStore]] = RandomTaleStore


def variants(args) -> list[tuple[str, dict[str, Any]]]:
    """``--variants`` × ``--rules`` as (label, tale storage) pairs, with ``--sink`` and ``--buffer``."""
    out = []
    for variant in args.variants.split(","):
        low, keep = (float(v) for v in variant.split(":"))
        for rule in args.rules.split(","):
            storage = {"name": "tale", "rule": rule, "low": low, "keep": keep}
            storage |= {"sink": args.sink, "buffer": args.buffer}
            out.append((f"tale {rule} low {low} keep {keep}", storage))
    return out


COLUMNS = ["model", "cache", "kept width", "prefill PPL", "decode PPL", "KV bytes/token", "× fp32 cache"]


def _fmt(row: dict[str, Any]) -> list[str]:
    return [
        row["model"],
        row["cache"],
        f"{row['achieved_ratio']:.4f}",
        f"{row['prefill_ppl']:.4f}",
        f"{row['decode_ppl']:.4f}",
        f"{row['kv_bytes_per_token']:.1f}",
        f"{row['x_fp32']:.2f}",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--calibration", required=True, help="dataset spec, e.g. text:train.txt")
    p.add_argument("--eval", required=True, help="dataset spec of held-out text")
    p.add_argument("--n-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-windows", type=int, default=16)
    p.add_argument("--decode-windows", type=int, default=8)
    p.add_argument("--decode-prefix", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--group-size", type=int, default=None, help="KV heads per group (default: auto)")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--variants", default="0.5:0.1,0.5:0.25,0.5:0,0.25:0.25,0:0.5", help="LOW:KEEP,...")
    p.add_argument("--rules", default="recency,energy", help="tale rules to measure each variant with")
    p.add_argument(
        "--random", action="store_true", help="also each variant with its whole tokens drawn at random"
    )
    p.add_argument(
        "--bits",
        type=lambda text: [int(b) for b in text.split(",") if b],
        default=[],
        help="also each variant with both levels at these bits, and quantized latents of the plan",
    )
    p.add_argument(
        "--levels",
        type=lambda text: [tuple(int(b) for b in pair.split(":")) for pair in text.split(",") if pair],
        default=[],
        help="also each variant with per-level bits LOW:FULL,... (TALE's setting: 2:4)",
    )
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--buffer", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="write the markdown section here")
    p.add_argument("--jsonl", type=Path, help="append every row here as it is measured (JSON lines)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, rows, windows = load_inputs(args)
    base = CompressionConfig(group_size=args.group_size, rank_multiple=1, allocator="uniform")
    base = base.for_model(model.config)
    stats = collect_statistics(model, rows, base.needed_statistics())  # the Gram, once
    results = []

    def emit(row: dict[str, Any]) -> None:
        print(" | ".join(_fmt(row)), file=sys.stderr, flush=True)
        results.append(row)
        if args.jsonl:
            with args.jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def compressed(ratio: float):
        """A compressed copy of the model at ``ratio`` and its conversion."""
        conversion = plan_conversion(model, rows, replace(base, ratio=ratio), statistics=stats)
        return conversion.apply(copy.deepcopy(model)), conversion

    emit({"model": "original", "cache": "—", "achieved_ratio": 1.0} | measure(model, windows, args))
    lrkv, conversion = compressed(args.ratio)
    achieved = conversion.plan.achieved_ratio
    dense = measure(lrkv, windows, args)
    emit({"model": f"lrkv {args.ratio}", "cache": "dense", "achieved_ratio": achieved} | dense)
    positions = 4 * LrkvFormat.of(lrkv.config).n_layers  # int32 positions per token, in every latent cache
    uniform: set[float] = set()  # the byte shares a uniform row was measured at
    for label, storage in variants(args):
        lrkv.config.lrkv["cache"] = storage
        tale = measure(lrkv, windows, args)
        emit(
            {"model": f"lrkv {args.ratio}", "cache": label, "achieved_ratio": achieved, "storage": storage}
            | tale
        )
        if args.random and storage["keep"] > 0 and storage["rule"] == "energy":
            lrkv.config.lrkv["cache"] = storage | {"name": "tale-random"}
            row = {"model": f"lrkv {args.ratio}", "cache": f"{label}, whole tokens at random"}
            emit(row | {"achieved_ratio": achieved} | measure(lrkv, windows, args))
        share = (tale["kv_bytes_per_token"] - positions) / (dense["kv_bytes_per_token"] - positions)
        if round(share, 6) in uniform:  # another rule held the same bytes: its uniform row stands
            continue
        uniform.add(round(share, 6))
        same, same_conversion = compressed(args.ratio * share)
        row = {"model": f"lrkv {args.ratio * share:.4f}", "cache": f"dense, bytes of {label}"}
        emit(row | {"achieved_ratio": same_conversion.plan.achieved_ratio} | measure(same, windows, args))
    if args.bits:  # quantized levels, next to quantized whole latents (rotation auto) of the same plan
        rotated = replace(conversion, config=replace(conversion.config, rotation="auto"))
        rotated = rotated.apply(copy.deepcopy(model))
        for bits in args.bits:
            for residual in sorted({0, args.buffer // 2}):  # the window tale's buffer holds on average
                rotated.config.lrkv["cache"] = {"name": "quantized", "bits": bits, "residual": residual}
                row = {"model": f"lrkv {args.ratio}, rotation auto", "cache": f"quantized {bits} bits"}
                row["cache"] += f", residual {residual}" if residual else ""
                emit(row | {"achieved_ratio": achieved} | measure(rotated, windows, args))
            for label, storage in variants(args):
                lrkv.config.lrkv["cache"] = storage | {"bits": bits}
                row = {"model": f"lrkv {args.ratio}", "cache": f"{label}, {bits} bits"}
                emit(row | {"achieved_ratio": achieved} | measure(lrkv, windows, args))
    for low_bits, full_bits in args.levels:  # TALE's per-level bits
        for label, storage in variants(args):
            lrkv.config.lrkv["cache"] = storage | {"low_bits": low_bits, "full_bits": full_bits}
            row = {"model": f"lrkv {args.ratio}", "cache": f"{label}, {low_bits}/{full_bits} bits"}
            emit(row | {"achieved_ratio": achieved} | measure(lrkv, windows, args))
    lrkv.config.lrkv["cache"] = {"name": "dense"}
    minutes = (time.perf_counter() - start) / 60
    n_decode = min(args.decode_windows, windows.shape[0])
    table = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    table += "\n".join("| " + " | ".join(_fmt(r)) + " |" for r in results) + "\n"
    section = (
        f"## {Path(args.model).name}\n\n"
        f"Measured (CPU, float32, {args.threads} threads, {minutes:.1f} min):\n\n"
        f"```bash\npython benchmarks/tale_cache.py {shlex.join(sys.argv[1:])}\n```\n\n"
        f"Protocol: calibration {args.n_samples} × {args.seq_len} tokens of `{args.calibration}` (seed 0), "
        f"uniform ranks, rank multiple 1; prefill PPL on {windows.shape[0]} windows of {args.seq_len} tokens "
        f"of `{args.eval}` through the cache; decode PPL on {n_decode} of them after a "
        f"{args.decode_prefix}-token prefix; tale sink {args.sink}, buffer {args.buffer}. "
        "`kept width`: the plan's achieved ratio (the factors' width, before the cache cuts anything); "
        "KV bytes after one prefilled window, positions and the tale cache's indices and significances "
        "included. Each `dense, bytes of …` row is a uniform plan whose dense latents take the bytes of "
        "the tale row above it; `whole tokens at random`: the same cache with the tokens kept whole drawn at "
        "random (seeded) instead of by energy. `tale recency`: TALE's rule (the sinks and the newest share); "
        "`tale energy`: lrkv's (the sinks and the tokens whose tails hold the most energy); `l/f bits`: "
        "the low level at l bits, the full level at f. `quantized b bits`: the same plan with a rotation "
        "(auto) fused and its latents quantized whole (the `quantized` storage), with `residual` "
        "newest tokens in full precision (half tale's buffer: what it holds on average while decoding); "
        "`tale …, b bits`: the tale cache with both levels at b bits (each block rotated in the store).\n\n"
        + table
    )
    print(section)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(section)


if __name__ == "__main__":
    main()
