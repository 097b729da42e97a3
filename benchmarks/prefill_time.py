"""Time one long prefill of a compressed model against its original, in one process.

What the long-context suite does before it scores a continuation or generates an answer: the whole context
in one forward pass, through the cache the model deploys (a compressed model's latent cache in its
configured storage, or in ``--cache``'s; the original's ``DynamicCache``), logits for the last position
only. Random token ids, seeded (speed does not depend on their values); best of ``--repeats`` per model and
context; the ratio is the compressed model's time over the original's in the same run, which is what to
compare between runs on a loaded machine.

    python benchmarks/prefill_time.py --model-dir smol-2048 --base ~/.cache/lrkv-assets/smollm2-135m \
        --cache '{name: tale, low: 1.0, keep: 0.0, low_bits: 3, full_bits: 3}' --contexts 1024,4096
"""

from __future__ import annotations

import argparse
import time

import torch
import yaml

from lrkv_core.conversion.pipeline import use_cache_storage
from lrkv_core.model.loading import load_model


def prefill_seconds(model: torch.nn.Module, context: int, repeats: int, seed: int = 0) -> float:
    """The best of ``repeats`` prefills of ``context`` random tokens (one row, one forward pass)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(model.config.vocab_size, (1, context), generator=gen)
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True, help="the compressed model")
    p.add_argument("--base", required=True, help="its original")
    p.add_argument("--cache", default=None, help="a cache storage's recipe form for the compressed model")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    compressed, _ = load_model(args.model_dir)
    if args.cache is not None:
        use_cache_storage(compressed, yaml.safe_load(args.cache))
    original, _ = load_model(args.base)
    storage = args.cache or "the model's own"
    print(f"threads {args.threads}, best of {args.repeats}; cache {storage}")
    print("| context | original, s | compressed, s | compressed ÷ original |")
    print("|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        base = prefill_seconds(original, context, args.repeats)
        ours = prefill_seconds(compressed, context, args.repeats)
        print(f"| {context} | {base:.2f} | {ours:.2f} | {ours / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
