"""A long synthetic decode: the bytes the KV cache holds as tokens grow, original vs low-rank + quantized.

A random Llama (built from a config: no download) and its lrkv conversion (data-free ``plain`` SVD at the
given ratio, the default group size, ``--rotation``, latents quantized to ``--bits``, or any cache storage
with ``--cache``) each decode
``--tokens`` tokens greedily for a batch of ``--batch`` rows, one token at a time through their caches. Every
``--every`` tokens the script prints, for both caches, the bytes of the tensors they hold (what
``lrkv_core.cache_nbytes`` and every evaluation report) and the bytes of the storages those tensors keep
allocated, their ratio and each model's decode seconds so far; then the ratio ``kv_bytes_per_token``
reports from a short prefill, which the long decode should reproduce.

    python benchmarks/long_decode.py [--tokens 4096] [--batch 4] [--bits 3] [--ratio 0.5]
    python benchmarks/long_decode.py --cache '{name: gear, bits: 3, rank: 2}'
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from lrkv_core.cache import LatentLayer, cache_kwargs, cache_nbytes, output_cache
from lrkv_core.conversion.convert import CompressionConfig, convert
from lrkv_core.evaluation.metrics import kv_bytes_per_token


def allocated_bytes(cache) -> int:
    """Bytes of the distinct storages behind the cache's tensors (a view keeps its whole storage alive)."""
    storages = {}
    for layer in cache.layers:
        tensors = layer.tensors() if isinstance(layer, LatentLayer) else [layer.keys, layer.values]
        for t in tensors:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@torch.no_grad()
def decode(model, prompt: torch.Tensor, tokens: int, every: int):
    """Greedy decode of ``tokens`` tokens after ``prompt`` (B, P); yields (tokens in cache, cache, seconds
    this model has spent so far) every ``every`` tokens."""
    start = time.perf_counter()
    out = model(prompt, use_cache=True)
    cache, length = output_cache(out), prompt.shape[1]
    for step in range(tokens):
        nxt = out.logits[:, -1:].argmax(-1)  # (B, 1)
        out = model(nxt, **cache_kwargs(cache), use_cache=True)
        cache, length = output_cache(out), length + 1
        if (step + 1) % every == 0:
            paused = time.perf_counter()
            yield length, cache, paused - start
            start += time.perf_counter() - paused  # time spent outside this generator is not this model's


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--every", type=int, default=512)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--rotation", default="auto")
    p.add_argument(
        "--cache", type=yaml.safe_load, default=None,
        help="the compressed model's cache storage, a name or YAML mapping (default: quantized at --bits)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=args.tokens + 64,
    )  # fmt: skip
    original = LlamaForCausalLM(config).eval()
    cache = args.cache or {"name": "quantized", "bits": args.bits}
    settings = CompressionConfig(
        ratio=args.ratio, decomposition="plain", allocator="uniform", cache=cache, rotation=args.rotation
    )
    compressed = convert(copy.deepcopy(original), None, settings)
    prompt = torch.randint(0, config.vocab_size, (args.batch, 16), generator=torch.Generator().manual_seed(1))
    short = torch.randint(0, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(2))
    reported = kv_bytes_per_token(compressed, short)
    print(
        f"random Llama: 4 layers, 2 KV heads of 64, fp32; lrkv: plain SVD ratio {args.ratio} (ranks "
        f"{compressed.config.lrkv['ranks_k'][0]} K, {compressed.config.lrkv['ranks_v'][0]} V per layer), "
        f"rotation {args.rotation}, cache {compressed.config.lrkv['cache']}; batch {args.batch}, "
        f"{args.tokens} tokens decoded"
    )
    print(
        f"kv_bytes_per_token after a 256-token prefill: {reported['kv_bytes_per_token']:.1f} B/token "
        f"(original {reported['dense_kv_bytes_per_token']:.0f}): "
        f"ratio {reported['kv_compression_ratio']:.3f}×"
    )
    print("| tokens | original bytes | original allocated | lrkv bytes | lrkv allocated | ratio (bytes) "
          "| ratio (allocated) | s | original s | lrkv s |\n" + "|---" * 10 + "|")  # fmt: skip
    start = time.perf_counter()
    runs = zip(
        decode(original, prompt, args.tokens, args.every), decode(compressed, prompt, args.tokens, args.every)
    )
    for (length, dense, dense_s), (_, latent, latent_s) in runs:
        held = (cache_nbytes(dense), cache_nbytes(latent))
        alloc = (allocated_bytes(dense), allocated_bytes(latent))
        print(
            f"| {length} | {held[0]:,} | {alloc[0]:,} | {held[1]:,} | {alloc[1]:,} "
            f"| {held[0] / held[1]:.3f}× | {alloc[0] / alloc[1]:.3f}× | {time.perf_counter() - start:.0f} "
            f"| {dense_s:.1f} | {latent_s:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
