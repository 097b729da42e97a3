"""LoRA recovery table: the original model, each compressed model before and after LoRA, measured alike.

For each ratio the model is calibrated and compressed in memory (``lrkv_core.convert``), evaluated,
recovered with LoRA (``lrkv_core.lora.recover``: train on ``--train``, held-out loss on ``--monitor``),
evaluated again; the original is evaluated once. With ``--control`` the original is also fine-tuned with
the same LoRA recipe on its matching projections (k_down, k_up → k_proj; v_down → v_proj; q_proj; o_proj),
which separates recovering what compression lost from adapting the model to the training text.

Evaluation is lrkv's: prefill perplexity on non-overlapping ``--seq-len`` windows of ``--eval``, decode
perplexity teacher-forced token by token through the latent cache after a ``--decode-prefix`` prefix, and
the KV bytes per token measured from the cache. Rows are appended to ``--out`` as JSON lines as they are
measured; the markdown table is printed and written next to it (``.md``).

    OMP_NUM_THREADS=1 python benchmarks/lora_recovery.py --model ../shared/models/shakespeare-llama \\
        --calibration text:../shared/data/shakespeare/train.txt \\
        --train "text:../shared/data/shakespeare/train.txt[:95%]" \\
        --monitor "text:../shared/data/shakespeare/train.txt[95%:]" \\
        --eval text:../shared/data/shakespeare/valid.txt --ratios 0.5,0.3 --steps 300 --out shakespeare.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from lrkv_core.conversion.convert import CompressionConfig, convert
from lrkv_core.data.datasets import eval_windows, extract_calibration, read_token_rows
from lrkv_core.evaluation import metrics
from lrkv_core.lora import RecoveryConfig, fit_lora, recover, training_data
from lrkv_core.model.adapters import get_adapter
from lrkv_core.model.loading import load_model

ORIGINAL_PROJECTION = {"k_down": "k", "k_up": "k", "v_down": "v", "q_proj": "q", "o_proj": "o"}
COLUMNS = ("model", "ratio", "prefill PPL", "decode PPL", "KV bytes/token", "LoRA steps", "train s")


def measure(model, windows: torch.Tensor, args) -> dict:
    prefill = metrics.prefill_perplexity(model, windows, batch_size=args.eval_batch)
    decode = metrics.decode_perplexity(
        model, windows[: args.decode_windows], prefix_len=args.decode_prefix, batch_size=args.eval_batch
    )
    kv = metrics.kv_bytes_per_token(model, windows)
    return {
        "prefill_ppl": prefill["ppl"],
        "decode_ppl": decode["ppl"],
        "kv_bytes_per_token": kv["kv_bytes_per_token"],
        "protocol": {"prefill": prefill["protocol"], "decode": decode["protocol"], "dataset": args.eval},
    }


def lora_on_original(model, lora: RecoveryConfig):
    """The uncompressed model with the same LoRA on its matching projections (names: the adapter table)."""
    from peft import LoraConfig, get_peft_model

    adapter = get_adapter(model.config)
    projections = sorted({ORIGINAL_PROJECTION[t] for t in lora.targets})
    names = [adapter.weight_name(i, p) for i in range(adapter.shape(model.config).L) for p in projections]
    torch.manual_seed(lora.seed)
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=names)
    return get_peft_model(model, config)


def row_cells(row: dict) -> list[str]:
    steps = str(row["steps"]) if row.get("steps") is not None else "—"
    seconds = f"{row['train_seconds']:.0f}" if row.get("train_seconds") is not None else "—"
    ratio = "—" if row["ratio"] is None else f"{row['ratio']}"
    return [row["label"], ratio, f"{row['prefill_ppl']:.4f}", f"{row['decode_ppl']:.4f}",
            f"{row['kv_bytes_per_token']:.0f}", steps, seconds]  # fmt: skip


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--calibration", required=True, help="calibration dataset spec")
    p.add_argument("--train", required=True, help="LoRA training dataset spec")
    p.add_argument("--monitor", default=None, help="held-out rows for the loss during training")
    p.add_argument("--eval", required=True, help="evaluation dataset spec")
    p.add_argument("--ratios", default="0.5,0.3")
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--allocator", default="uniform")
    p.add_argument("--n-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256, help="calibration, training and evaluation windows")
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--decode-windows", type=int, default=16)
    p.add_argument("--decode-prefix", type=int, default=128)
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--r", type=int, default=32)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", default="k_down,v_down")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--control", action="store_true", help="also LoRA-tune the original (same recipe)")
    p.add_argument("--out", type=Path, default=Path("lora_recovery.jsonl"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    lora = RecoveryConfig(
        steps=args.steps, r=args.r, alpha=args.alpha, lr=args.lr, targets=tuple(args.targets.split(",")),
        batch_size=args.batch_size, grad_accum=args.grad_accum, seq_len=args.seq_len,
        warmup_steps=args.warmup_steps, eval_every=args.eval_every, checkpoint_every=0,
    )  # fmt: skip
    original, tokenizer = load_model(args.model)
    windows = eval_windows(args.eval, tokenizer, seq_len=args.seq_len, max_windows=args.max_windows)
    calib_path = args.out.with_suffix(".calibration.parquet")
    extract_calibration(args.calibration, tokenizer, n_samples=args.n_samples, seq_len=args.seq_len, seed=0,
                        out_path=calib_path)  # fmt: skip
    calibration = read_token_rows(calib_path)
    data = training_data(args.train, tokenizer, seq_len=args.seq_len)
    monitor = training_data(args.monitor, tokenizer, seq_len=args.seq_len) if args.monitor else None
    args.out.write_text("")
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print("| " + " | ".join(row_cells(row)) + " |", flush=True)

    record({"label": "original", "ratio": None, **measure(original, windows, args)})
    if args.control:
        started = time.perf_counter()
        trained = fit_lora(lora_on_original(original, lora), data, lora, eval_data=monitor,
                           on_step=lambda r: print(json.dumps(r), flush=True))  # fmt: skip
        tuned = trained.model.merge_and_unload().eval()
        record({"label": "original + LoRA (control)", "ratio": None, **measure(tuned, windows, args),
                "steps": trained.state.step, "train_seconds": trained.state.seconds,
                "wall_seconds": time.perf_counter() - started, "evals": trained.state.evals})  # fmt: skip
    for ratio in (float(r) for r in args.ratios.split(",") if r):  # "" : the original rows only
        model, _ = load_model(args.model)
        config = CompressionConfig(ratio=ratio, group_size=args.group_size, allocator=args.allocator)
        model = convert(model, calibration, config)
        record({"label": "compressed", "ratio": ratio, **measure(model, windows, args)})
        started = time.perf_counter()
        merged, trained = recover(model, data, lora, eval_data=monitor,
                                  on_step=lambda r: print(json.dumps(r), flush=True))  # fmt: skip
        wall = time.perf_counter() - started
        record({"label": "compressed + LoRA", "ratio": ratio, **measure(merged, windows, args),
                "steps": trained.state.step, "train_seconds": trained.state.seconds, "wall_seconds": wall,
                "evals": trained.state.evals, "lora": lora.to_dict(), "train_rows": len(data)})  # fmt: skip
    table = markdown(rows)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
