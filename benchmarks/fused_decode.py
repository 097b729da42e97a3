"""Decode speed on a GPU: the original model, lrkv rebuilding keys in torch, lrkv through the fused kernel.

A random Llama of a real model's shape (built from a config: no download; ``--shape smollm2`` is
SmolLM2-135M's, ``llama-1b`` Llama-3.2-1B's) and its lrkv conversion (data-free ``plain`` SVD at
``--ratio``, uniform ranks, the default group size, dense latents) each prefill ``--batch`` rows of every
``--context`` length, then decode ``--steps`` tokens greedily one at a time through their caches. Printed per
context: milliseconds per decode step (after a warm-up step, the device synchronised around the timed
steps; the median of ``--repeats`` interleaved runs, after one untimed pass at the first context), each lrkv
path's time over the original's, and the KV bytes each cache holds per token. Then the
kernel alone on one layer's group: the fused scores against the torch reference (keys rebuilt, then q·Kᵀ)
and against q·Kᵀ on keys already materialised (what the original reads), medians of
``triton.testing.do_bench``, and the kernel at every tiling of :data:`TILES`.

    python benchmarks/fused_decode.py --device cuda [--shape llama-1b] [--dtype bfloat16] \\
        [--batch 8] [--context 1024,4096,16384] [--steps 32]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lrkv_core.cache import cache_kwargs, cache_nbytes, output_cache
from lrkv_core.conversion.convert import CompressionConfig, convert
from lrkv_core.model.attention import LatentAttention, set_fused_decode
from lrkv_core.system.dtypes import parse_dtype
from lrkv_kernels.latent_rope import latent_rope_scores, latent_rope_scores_ref

SHAPES = {
    "smollm2": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
    ),
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def ms_per_step(model, prompt: torch.Tensor, steps: int) -> tuple[float, int]:
    """Prefill ``prompt`` (B, S), one warm-up decode step, then ``steps`` timed greedy steps; returns
    (milliseconds per timed step, bytes the cache holds at the end)."""
    out = model(prompt, use_cache=True, logits_to_keep=1)  # the last position's logits only
    cache = output_cache(out)
    nxt = out.logits[:, -1:].argmax(-1)
    out = model(nxt, **cache_kwargs(cache), use_cache=True)  # warm-up (Triton compiles on first use)
    sync(prompt.device)
    start = time.perf_counter()
    for _ in range(steps):
        nxt = out.logits[:, -1:].argmax(-1)
        out = model(nxt, **cache_kwargs(output_cache(out)), use_cache=True)
    sync(prompt.device)
    return (time.perf_counter() - start) * 1e3 / steps, cache_nbytes(output_cache(out))


TILES = [(bs, br, w) for bs in (32, 64, 128) for br in (32, 64) for w in (4, 8)]  # block_s, block_r, warps


def kernel_table(
    model, batch: int, contexts: list[int], device: torch.device, dtype: torch.dtype, tiles: bool
) -> None:
    """The fused scores kernel alone on layer 0's first group, against the torch reference and against q·Kᵀ
    on materialised keys; with ``tiles``, then at every tiling of :data:`TILES`."""
    from triton.testing import do_bench

    from lrkv_kernels.latent_rope.fused import latent_rope_scores_triton

    attn = next(m for m in model.modules() if isinstance(m, LatentAttention))
    up = attn.k_up[0]
    r, D = up.weight.shape[1], attn.head_dim
    s, nq = up.weight.shape[0] // D, attn.q_heads_per_group
    rope = attn.rotary_emb
    print(
        f"\nkernel alone, layer 0 group 0: {nq} query heads on {s} KV heads of {D}, rank {r}, batch {batch}"
    )
    print("| context | fused ms | reference ms | reference / fused | q·Kᵀ on keys ms | fused / q·Kᵀ |")
    print("|---|---|---|---|---|---|")
    timed = {tile: [] for tile in TILES} if tiles else {}
    for S in contexts:
        q = torch.randn(batch, nq, 1, D, device=device, dtype=dtype)
        h = torch.randn(batch, S, r, device=device, dtype=dtype)
        pos = torch.arange(S, device=device, dtype=torch.int32).expand(batch, S)
        keys = torch.randn(batch, s, S, D, device=device, dtype=dtype)
        args = (q, h, up.weight, up.bias, pos, rope.inv_freq, rope.attention_scaling, attn.scaling)
        fused = do_bench(lambda args=args: latent_rope_scores(*args), return_mode="median")
        ref = do_bench(lambda args=args: latent_rope_scores_ref(*args), return_mode="median")
        qk = do_bench(
            lambda q=q, keys=keys: q.view(batch, s, nq // s, D) @ keys.transpose(-1, -2), return_mode="median"
        )
        print(f"| {S} | {fused:.3f} | {ref:.3f} | {ref / fused:.2f}× | {qk:.3f} | {fused / qk:.2f}× |")
        for (bs, br, w), times in timed.items():
            run = lambda args=args, bs=bs, br=br, w=w: latent_rope_scores_triton(  # noqa: E731
                *args, block_s=bs, block_r=br, num_warps=w
            )
            times.append(do_bench(run, return_mode="median"))
    if not timed:
        return
    print("\n| block_s | block_r | warps | " + " | ".join(f"ms at {S}" for S in contexts) + " |")
    print("|---" * (3 + len(contexts)) + "|")
    for (bs, br, w), times in timed.items():
        print(f"| {bs} | {br} | {w} | " + " | ".join(f"{ms:.3f}" for ms in times) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", default="1024,4096,16384", help="comma-separated prompt lengths")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per model and context (median)")
    p.add_argument("--no-kernel-table", action="store_true")
    p.add_argument("--tiles", action="store_true", help="also time the kernel at every tiling of TILES")
    args = p.parse_args()
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    contexts = [int(c) for c in args.context.split(",")]
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=max(contexts) + args.steps + 8)
    original = LlamaForCausalLM(config).to(device, dtype).eval()
    settings = CompressionConfig(ratio=args.ratio, decomposition="plain", allocator="uniform")
    compressed = convert(copy.deepcopy(original), None, settings)
    fmt = compressed.config.lrkv
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device
    print(
        f"random {args.shape} ({config.num_hidden_layers} layers, {config.num_key_value_heads} KV heads of "
        f"{config.head_dim}), {args.dtype} on {where}; "
        f"lrkv: plain SVD ratio {args.ratio}, group {fmt['group_size']}, ranks K {fmt['ranks_k'][0]} "
        f"V {fmt['ranks_v'][0]} per layer, dense latents; batch {args.batch}, {args.steps} decode steps"
    )  # fmt: skip
    print("| context | original ms/step | lrkv torch ms/step | lrkv fused ms/step | torch / original "
          "| fused / original | original B/token | lrkv B/token |\n" + "|---" * 8 + "|")  # fmt: skip
    warm = torch.randint(0, config.vocab_size, (args.batch, contexts[0]), device=device)
    for fused in (False, None):  # untimed: first launches, allocator growth, Triton's compilation
        ms_per_step(original, warm, 2)
        set_fused_decode(compressed, fused)
        ms_per_step(compressed, warm, 2)
    for S in contexts:
        prompt = torch.randint(0, config.vocab_size, (args.batch, S), device=device)
        runs: dict[str, list[float]] = {"original": [], "torch": [], "fused": []}
        for _ in range(args.repeats):  # interleaved, so drift on the machine hits the three alike
            ms, base_bytes = ms_per_step(original, prompt, args.steps)
            runs["original"].append(ms)
            set_fused_decode(compressed, False)
            ms, lat_bytes = ms_per_step(compressed, prompt, args.steps)
            runs["torch"].append(ms)
            set_fused_decode(compressed, None)
            runs["fused"].append(ms_per_step(compressed, prompt, args.steps)[0])
        base, unfused, fused = (statistics.median(runs[k]) for k in ("original", "torch", "fused"))
        tokens = args.batch * (S + args.steps + 1)
        print(
            f"| {S} | {base:.2f} | {unfused:.2f} | {fused:.2f} | {unfused / base:.2f}× | {fused / base:.2f}× "
            f"| {base_bytes / tokens:.0f} | {lat_bytes / tokens:.0f} |",
            flush=True,
        )
        del prompt
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if device.type == "cuda" and not args.no_kernel_table:
        kernel_table(compressed, args.batch, contexts, device, dtype, args.tiles)


if __name__ == "__main__":
    main()
