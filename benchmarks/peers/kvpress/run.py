"""kvpress peer runner: one press on the windows and retrieval prompts that ``benchmarks/long_peer.py`` wrote.

Runs in the kvpress environment (``setup.sh``; kvpress 0.5.5 needs transformers < 5.3, so not in lrkv's), on
the same model directory, float32, CPU. It reads the tasks JSON and writes one JSON result; the driver
scores it (exact match by lrkv's rules) and puts it in the table.

- Continuation: the ``C``-token context is prefilled under ``with press(model)`` exactly as kvpress's
  pipeline prefills (``model.model(input_ids, past_key_values=cache)``: the press's forward hooks compress
  each layer's cache at the end of the prefill); the last context position's logits (``lm_head`` of its
  hidden state) predict the first continuation token, and one forward of the ``N - 1`` others against the
  compressed cache, at their true positions ``C..C+N-2`` (``position_ids``, as the pipeline positions a
  question), the rest. The summed NLL and the count go back to the driver.
- Retrieval (passkey, RULER-style needles): the prompt is split into its context (instruction, haystack,
  needles) and its question; the pipeline's own ``_forward`` prefills the context under the press, runs the
  question uncompressed and decodes greedily (``generate_answer``) for the token budget the driver set.
- Bytes: what the cache holds after the context prefill, over what the uncompressed cache would hold
  (``kv_fraction_held``); ``kv_fraction`` also drops the key channels ThinK zeroes (kvpress keeps them in
  memory as zeros).

    python run.py --tasks tasks.json --model DIR --press snapkv --ratio 0.5 --out result.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.nn.functional as F
from kvpress import (
    ComposedPress,
    ExpectedAttentionPress,
    KnormPress,
    SnapKVPress,
    StreamingLLMPress,
    ThinKPress,
    TOVAPress,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline

THINK_CHANNELS = 0.5  # ThinK's share of key channels cut; SnapKV takes the rest of the ratio


def make_press(name: str, ratio: float):
    """The press ``name`` removing ``ratio`` of the KV bytes (``none``: no press)."""
    if name == "none":
        return None
    scorers = {
        "knorm": KnormPress,
        "snapkv": SnapKVPress,
        "streamingllm": StreamingLLMPress,
        "expected_attention": ExpectedAttentionPress,
        "tova": TOVAPress,
    }
    if name in scorers:
        return scorers[name](compression_ratio=ratio)
    if name == "think":  # channels alone remove at most half the bytes (keys only): SnapKV + ThinK
        kept_tokens = (1 - ratio) / (1 - THINK_CHANNELS / 2)
        snap = SnapKVPress(compression_ratio=1 - kept_tokens)
        return ComposedPress([snap, ThinKPress(key_channel_compression_ratio=THINK_CHANNELS)])
    raise ValueError(f"unknown press {name!r}")


def held_fraction(cache: DynamicCache, context: int, zeroed_key_share: float) -> tuple[float, float]:
    """(bytes the cache holds / uncompressed bytes, the same without zeroed key channels) after a prefill."""
    held = dense = nominal = 0.0
    for layer in cache.layers:
        k, v = layer.keys, layer.values  # (1, Hkv, T', D)
        full = k.shape[0] * k.shape[1] * context * k.shape[3] * k.element_size()
        held += k.nbytes + v.nbytes
        nominal += k.nbytes * (1 - zeroed_key_share) + v.nbytes
        dense += 2 * full
    return held / dense, nominal / dense


def continuation(model, press, ids: torch.Tensor, context: int) -> dict:
    """Summed NLL of ``ids[context:]`` after prefilling ``ids[:context]`` under ``press``; ids (T,)."""
    ids = ids[None]  # (1, T)
    cache = DynamicCache()
    with press(model) if press is not None else contextlib.nullcontext():
        out = model.model(input_ids=ids[:, :context], past_key_values=cache)
    first = model.lm_head(out.last_hidden_state[:, -1:])  # (1, 1, V)
    nll = F.cross_entropy(first[0].float(), ids[0, context : context + 1], reduction="sum").item()
    zeroed = THINK_CHANNELS if isinstance(press, ComposedPress) else 0.0
    held, nominal = held_fraction(cache, context, zeroed)
    n = ids.shape[1] - context
    if n > 1:
        positions = torch.arange(context, ids.shape[1] - 1)[None]  # (1, N-1)
        logits = model(input_ids=ids[:, context:-1], past_key_values=cache, position_ids=positions).logits
        nll += F.cross_entropy(logits[0].float(), ids[0, context + 1 :], reduction="sum").item()
    return {"nll_sum": nll, "tokens": n, "kv_fraction_held": held, "kv_fraction": nominal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--press", required=True)
    parser.add_argument("--ratio", type=float, default=0.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", default="", help="comma list: only these context lengths")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with open(args.tasks) as f:
        tasks = json.load(f)
    only = {int(x) for x in args.lengths.split(",") if x}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    press = make_press(args.press, args.ratio)
    result = {"press": args.press, "ratio": args.ratio, "continuation": [], "retrieval": []}
    start = time.time()
    with torch.no_grad():
        for block in tasks["continuation"]:
            if only and block["context"] not in only:
                continue
            rows = [continuation(model, press, torch.tensor(w), block["context"]) for w in block["windows"]]
            result["continuation"].append({"context": block["context"], "windows": rows})
            took = time.time() - start
            print(f"{args.press} {args.ratio:.4f} continuation {block['context']}: {took:.0f}s", flush=True)
        for sample in tasks.get("retrieval", tasks.get("passkey", [])):
            if only and sample["length"] not in only:
                continue
            ids = torch.tensor(sample["input_ids"])
            cut = len(sample["input_ids"]) - sample["question_len"]
            inputs = {"context_ids": ids[None, :cut], "questions_ids": [ids[None, cut:]]}
            answer = pipe._forward(inputs, max_new_tokens=sample["max_new_tokens"], press=press)[0]
            result["retrieval"].append({"key": sample["key"], "output": answer})
        print(f"{args.press} {args.ratio:.4f} done: {time.time() - start:.0f}s", flush=True)
    result["seconds"] = time.time() - start
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
