"""lrkv beside kvpress's presses on the same long-context windows and retrieval prompts, at matched KV bytes.

    S=/work/shared; D=text:$S/data/wikitext-2/valid.txt; M=~/.cache/lrkv-assets/smollm2-135m
    python benchmarks/long_peer.py tasks --model $M --dataset "$D[90%:]" --lengths 1024,2048 --out tasks.json
    python benchmarks/long_peer.py lrkv --tasks tasks.json --name original --model-dir $M --rows rows.jsonl
    python benchmarks/long_peer.py lrkv --tasks tasks.json --name "lrkv 0.5" --model-dir R05 --rows rows.jsonl
    python benchmarks/long_peer.py peer --tasks tasks.json --model $M --presses knorm,snapkv --rows rows.jsonl
    python benchmarks/long_peer.py table --rows rows.jsonl

``tasks`` writes the evaluation windows and retrieval prompts once, as token ids, with lrkv's own functions
(:func:`~lrkv_core.evaluation.longcontext.cut_windows` of the held-out stream,
:func:`~lrkv_core.evaluation.needles.make_samples` with the seed: the passkey, and with ``--retrieval`` the
RULER-style single needle, multi-key needle and variable tracking), so every method sees the same tokens.
``lrkv`` scores a model (original or lrkv-compressed) with the long suite's own functions:
:func:`~lrkv_core.evaluation.longcontext.continuation_nll` (context prefilled in one chunk, the continuation
teacher-forced at its true positions) and :func:`~lrkv_core.evaluation.needles.generate_answer` +
:func:`~lrkv_core.evaluation.needles.is_exact_match`; its KV bytes are measured after a prefill of the first
window's context (:func:`~lrkv_core.evaluation.metrics.kv_bytes_per_token`: every tensor the cache holds,
scales and positions included) over the original cache's. ``peer`` runs ``benchmarks/peers/kvpress/run.py`` in
the kvpress environment for each press at each ratio (default: one minus each lrkv row's measured bytes
fraction, so each press holds as many bytes as an lrkv model) and scores its answers with the same exact-match
rule. Rows (one per method × length × measure) are appended to a JSONL file; ``table`` prints method × KV
bytes × continuation PPL × each retrieval task's accuracy per length.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoConfig

from lrkv_core.conversion.pipeline import use_cache_storage
from lrkv_core.data.datasets import token_sequences, window_prefix
from lrkv_core.evaluation import metrics, needles
from lrkv_core.evaluation.longcontext import (
    ANSWER_RESERVE,
    cap_lengths,
    check_stride,
    continuation_nll,
    cut_windows,
)
from lrkv_core.evaluation.needles import (
    NeedleSample,
    answer_tokens,
    generate_answer,
    is_exact_match,
    make_samples,
)
from lrkv_core.model.loading import load_model, load_tokenizer

PRESSES = ("knorm", "snapkv", "streamingllm", "expected_attention", "tova", "think")
RUNNER = Path(__file__).resolve().parent / "peers" / "kvpress" / "run.py"
DEFAULT_PEER_PYTHON = "/work/peer/kvpress-venv/bin/python"


def build_tasks(
    tokenizer: Any,
    dataset: str,
    *,
    lengths: list[int],
    continuation: int = 256,
    windows: int = 8,
    stride: int | None = None,
    depths: list[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    samples: int = 2,
    seed: int = 0,
    max_positions: int | None = None,
    retrieval: list[str] = ("passkey",),
) -> dict[str, Any]:
    """Continuation windows ((windows, C + N) token ids per context C; none for ``windows`` 0; with
    ``stride``, overlapping windows starting that many tokens apart, at least N so that no scored token is
    scored twice) and the ``retrieval`` tasks' prompts (:data:`~lrkv_core.evaluation.needles.TASKS`:
    passkey and the RULER-style needles) of ``dataset``."""
    unknown = set(retrieval) - set(needles.TASKS)
    if unknown:
        raise ValueError(f"unknown retrieval tasks {sorted(unknown)}; known: {', '.join(needles.TASKS)}")
    check_stride(stride, continuation)
    seqs = token_sequences(dataset, tokenizer)
    prefix = window_prefix(dataset, tokenizer)  # e.g. BOS, as lrkv's suite puts before each window
    haystack = torch.cat([s.reshape(-1) for s in seqs])
    blocks = [  # none with windows=0: a retrieval-only file
        {
            "context": c,
            "windows": cut_windows(seqs, c + continuation, windows, prefix, stride=stride).tolist(),
        }
        for c in cap_lengths(lengths, max_positions, continuation)
        if windows
    ]
    prompts = []
    cells = itertools.product(retrieval, cap_lengths(lengths, max_positions, ANSWER_RESERVE), depths)
    for task, n, depth in cells:
        for s in make_samples(task, tokenizer, haystack, length=n, depth=depth, samples=samples, seed=seed):
            fields = dataclasses.asdict(s) | {"input_ids": s.input_ids.tolist()}
            key = f"{n}/{depth:g}/{s.index}"
            prompts.append(fields | {
                "key": key if task == "passkey" else f"{task}/{key}",
                "max_new_tokens": answer_tokens(tokenizer, s.answer),
            })  # fmt: skip
    protocol = {"dataset": dataset, "lengths": list(lengths), "continuation": continuation,
                "windows": windows, "stride": stride, "depths": list(depths), "samples": samples,
                "seed": seed, "tasks": list(retrieval)}  # fmt: skip
    return {"protocol": protocol, "continuation": blocks, "retrieval": prompts}


def save_tasks(tasks: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(tasks))


def load_tasks(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def retrieval_prompts(tasks: dict[str, Any]) -> list[dict[str, Any]]:
    """A tasks file's retrieval prompts (under ``retrieval``; a file of passkey prompts alone may hold them
    under ``passkey``)."""
    return tasks.get("retrieval", tasks.get("passkey", []))


def needle_sample(prompt: dict[str, Any]) -> NeedleSample:
    """The :class:`NeedleSample` a tasks-file prompt was written from."""
    names = {f.name for f in dataclasses.fields(NeedleSample)}
    fields = {k: v for k, v in prompt.items() if k in names}
    return NeedleSample(**fields | {"input_ids": torch.tensor(prompt["input_ids"], dtype=torch.long)})


def matched_press_ratio(kv_fraction: float) -> float:
    """kvpress ``compression_ratio`` (share of KV pairs removed) that keeps ``kv_fraction`` of the bytes."""
    if not 0.0 < kv_fraction <= 1.0:
        raise ValueError(f"a kept bytes fraction is in (0, 1], got {kv_fraction}")
    return 1.0 - kv_fraction


def retrieval_rows(
    method: dict[str, Any], tasks: dict[str, Any], outputs: dict[str, str]
) -> list[dict[str, Any]]:
    """One row per retrieval task and length (``kind``: the task): exact matches of ``outputs`` (prompt key
    -> generated text)."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for p in retrieval_prompts(tasks):
        if p["key"] not in outputs:
            continue
        task = p["task"]
        empty = {"kind": task, "length": p["length"], "samples": 0, "correct": 0, "by_depth": {},
                 "outputs": {}}  # fmt: skip
        row = rows.setdefault((task, p["length"]), method | empty)
        hit = is_exact_match(outputs[p["key"]], p["answer"])
        row["samples"] += 1
        row["correct"] += hit
        row["by_depth"][f"{p['depth']:g}"] = row["by_depth"].get(f"{p['depth']:g}", 0) + hit
        row["outputs"][p["key"]] = outputs[p["key"]]
    return [r | {"accuracy": r["correct"] / r["samples"]} for r in rows.values()]


def continuation_row(method: dict[str, Any], context: int, nll_sum: float, tokens: int, windows: int) -> dict:
    nll = nll_sum / tokens
    return method | {"kind": "continuation", "length": context, "windows": windows, "tokens": tokens,
                     "nll": nll, "ppl": math.exp(nll)}  # fmt: skip


def stores_codes(storage: Any) -> bool:
    """Whether a cache storage's recipe form (the model's ``lrkv.cache``) keeps integer codes with fp16
    scales (quantized, GEAR, TALE with bit widths), whose bytes do not follow the model's dtype; dense
    latents and a float TALE cache do."""
    if not isinstance(storage, dict) or storage.get("name") in (None, "dense"):
        return False
    return any(storage.get(k) is not None for k in ("bits", "low_bits", "full_bits"))


def run_lrkv(
    name: str, model_dir: str, tasks: dict[str, Any], cache: str | dict | None = None
) -> list[dict[str, Any]]:
    """Rows of one lrkv-loadable model (original or compressed) on the tasks, with its measured bytes; with
    ``cache`` (a storage's recipe form), a compressed model runs through that storage instead of its own."""
    model, tokenizer = load_model(model_dir)
    if cache is not None:
        use_cache_storage(model, cache)
    if tasks["continuation"]:
        first = tasks["continuation"][0]
        ids = torch.tensor(first["windows"][:1])[:, : first["context"]]  # (1, C)
    else:  # a retrieval-only tasks file: the bytes after its first prompt
        ids = torch.tensor(retrieval_prompts(tasks)[0]["input_ids"])[None]
    first = {"context": ids.shape[1]}
    kv = metrics.kv_bytes_per_token(model, ids)
    fraction = kv["kv_bytes_per_token"] / kv["dense_kv_bytes_per_token"]
    # A quantized cache's bytes (packed codes, fp16 scales, int32 positions) do not follow the model's
    # dtype: its match is against the original's cache in float16, the dtype such a cache is deployed with.
    storage = (getattr(model.config, "lrkv", None) or {}).get("cache", {})
    dense16 = metrics.dense_kv_bytes(model.config, 1, first["context"], torch.float16) / first["context"]
    quantized = stores_codes(storage)
    method = {"method": name, "family": "lrkv", "model": str(model_dir), "cache": storage,
              "kv_fraction": fraction,
              "kv_bytes_per_token": kv["kv_bytes_per_token"],
              "dense_kv_bytes_per_token": kv["dense_kv_bytes_per_token"],
              "kv_fraction_fp16": kv["kv_bytes_per_token"] / dense16,
              "match_fraction": kv["kv_bytes_per_token"] / dense16 if quantized else fraction}  # fmt: skip
    rows = []
    with torch.no_grad():
        for block in tasks["continuation"]:
            windows = torch.tensor(block["windows"])  # (N, C + n)
            c = block["context"]
            nll, tokens, held = continuation_nll(model, windows, context_len=c, chunk_size=c)
            row = continuation_row(method, c, nll, tokens, windows.shape[0])
            # what the cache holds once a window is in it, per token (the prefill's figure is in method)
            rows.append(row | {"kv_bytes_held_per_token": held / (windows.shape[0] * (windows.shape[1] - 1))})
            print(f"{name}: continuation {c} ppl {rows[-1]['ppl']:.3f}", flush=True)
        prompts = retrieval_prompts(tasks)
        outputs = {p["key"]: generate_answer(model, tokenizer, needle_sample(p)) for p in prompts}
    return rows + retrieval_rows(method, tasks, outputs)


def run_peer(
    press: str, ratio: float, *, tasks_path: str, model_dir: str, python: str, lengths: str = ""
) -> list[dict[str, Any]]:
    """Rows of one kvpress press at ``ratio``: the runner in the kvpress environment, scored here."""
    tasks = load_tasks(tasks_path)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [python, str(RUNNER), "--tasks", tasks_path, "--model", model_dir, "--press", press,
               "--ratio", f"{ratio:.6f}", "--out", str(out), "--lengths", lengths]  # fmt: skip
        subprocess.run(cmd, check=True)
        result = json.loads(out.read_text())
    rows = []
    for block in result["continuation"]:
        w = block["windows"]
        method = {"method": f"kvpress {press}", "family": "kvpress", "press": press, "press_ratio": ratio,
                  "kv_fraction": sum(x["kv_fraction"] for x in w) / len(w),
                  "kv_fraction_held": sum(x["kv_fraction_held"] for x in w) / len(w)}  # fmt: skip
        nll, tokens = sum(x["nll_sum"] for x in w), sum(x["tokens"] for x in w)
        rows.append(continuation_row(method, block["context"], nll, tokens, len(w)))
    method = {"method": f"kvpress {press}", "family": "kvpress", "press": press, "press_ratio": ratio}
    outputs = {x["key"]: x["output"] for x in result["retrieval"]}
    return rows + retrieval_rows(method, tasks, outputs)


def append_rows(path: str | Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: method × KV bytes (of the original's; lrkv rows: the fraction presses are matched to; a
    press measured on retrieval prompts alone: 1 − its ratio) × continuation PPL and each retrieval task's
    accuracy per length."""
    lengths = sorted({r["length"] for r in rows})
    kinds = sorted({r["kind"] for r in rows} - {"continuation"}, key=needles.TASKS.index)
    by_method: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = (r["method"], round(r.get("press_ratio") or 0.0, 4))
        entry = by_method.setdefault(key, {"method": r["method"], "ratio": r.get("press_ratio")})
        if r["kind"] == "continuation":
            entry["kv"] = r.get("match_fraction", r["kv_fraction"])
            entry[("ppl", r["length"])] = r["ppl"]
        else:
            entry[(r["kind"], r["length"])] = f"{r['correct']}/{r['samples']}"
        if "kv_fraction" in r and r["family"] == "lrkv":
            entry["kv"] = r.get("match_fraction", r["kv_fraction"])
    for e in by_method.values():  # a press without continuation rows: the bytes its ratio keeps
        if "kv" not in e and e["ratio"] is not None:
            e["kv"] = 1.0 - e["ratio"]
    columns = [("ppl", n) for n in lengths] + [(k, n) for k in kinds for n in lengths]
    columns = [c for c in columns if any(c in e for e in by_method.values())]
    head = ["method", "press ratio", "KV bytes"] + [f"{kind} {n}" for kind, n in columns]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for e in sorted(by_method.values(), key=lambda e: (-e.get("kv", 1.0), e["method"])):
        cells = [e["method"], "" if e["ratio"] is None else f"{e['ratio']:.4f}",
                 f"{e['kv']:.4f}" if "kv" in e else ""]  # fmt: skip
        cells += [
            (f"{e[c]:.3f}" if c[0] == "ppl" else e[c]) if c in e else "" for c in columns
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tasks")
    t.add_argument("--model", required=True)
    t.add_argument("--dataset", required=True)
    t.add_argument("--lengths", default="1024,2048")
    t.add_argument("--continuation", type=int, default=256)
    t.add_argument("--windows", type=int, default=8)
    t.add_argument(
        "--stride", type=int, default=None,
        help="overlapping windows, each this many tokens after the last (≥ --continuation); default: none",
    )  # fmt: skip
    t.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    t.add_argument("--samples", type=int, default=2)
    t.add_argument(
        "--retrieval", default="passkey",
        help=f"comma list of retrieval tasks ({', '.join(needles.TASKS)}); default passkey",
    )  # fmt: skip
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", required=True)
    lr = sub.add_parser("lrkv")
    lr.add_argument("--tasks", required=True)
    lr.add_argument("--name", required=True)
    lr.add_argument("--model-dir", required=True)
    lr.add_argument("--rows", required=True)
    lr.add_argument(
        "--cache", type=yaml.safe_load, default=None,
        help="another cache storage for a compressed model, as in a recipe: e.g. '{name: tale, low: 0.4}'",
    )  # fmt: skip
    p = sub.add_parser("peer")
    p.add_argument("--tasks", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--presses", default=",".join(PRESSES))
    p.add_argument("--ratios", default="", help="comma list; default: matched to the lrkv rows in --rows")
    p.add_argument("--lengths", default="", help="comma list: only these lengths")
    p.add_argument("--python", default=DEFAULT_PEER_PYTHON)
    p.add_argument("--rows", required=True)
    tb = sub.add_parser("table")
    tb.add_argument("--rows", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.time()
    if args.command == "tasks":
        tokenizer = load_tokenizer(args.model)
        limit = getattr(AutoConfig.from_pretrained(args.model), "max_position_embeddings", None)
        try:
            tasks = build_tasks(tokenizer, args.dataset, lengths=[int(x) for x in args.lengths.split(",")],
                                continuation=args.continuation, windows=args.windows, stride=args.stride,
                                depths=[float(x) for x in args.depths.split(",")], samples=args.samples,
                                seed=args.seed, max_positions=limit,
                                retrieval=args.retrieval.split(","))  # fmt: skip
        except ValueError as err:  # an unknown task, a prompt too short for its template, a bad depth
            t.error(str(err))
        tasks["protocol"]["model"] = args.model
        save_tasks(tasks, args.out)
    elif args.command == "lrkv":
        append_rows(args.rows, run_lrkv(args.name, args.model_dir, load_tasks(args.tasks), args.cache))
    elif args.command == "peer":
        if args.ratios:
            ratios = [float(x) for x in args.ratios.split(",")]
        else:
            lrkv = [r for r in read_rows(args.rows) if r["family"] == "lrkv" and r["kv_fraction"] < 0.999]
            ratios = sorted({round(matched_press_ratio(r["match_fraction"]), 4) for r in lrkv})
        for ratio in ratios:
            for press in args.presses.split(","):
                rows = run_peer(press, ratio, tasks_path=args.tasks, model_dir=args.model, python=args.python,
                                lengths=args.lengths)  # fmt: skip
                append_rows(args.rows, rows)
    else:
        print(table(read_rows(args.rows)))
    print(f"{args.command}: {time.time() - start:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
