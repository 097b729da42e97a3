"""Serving measurements of one model on one device: decode-step latency by context and batch, prefill
throughput, the KV bytes the cache holds, peak memory, and tokens/s at a fixed cache budget.

Every figure is measured: the model runs on random token ids (speed does not depend on their values) through
the cache it deploys (a compressed model's :class:`~lrkv_core.cache.LatentCache` in its configured storage,
an original model's ``DynamicCache``). A point prefills ``batch`` rows of ``context`` tokens in chunks, then
times ``steps`` decode steps of one token each after ``warmup`` untimed ones (the device synchronised around
every step: a step's latency, not a pipeline's throughput) and reports their median. The KV bytes are the
tensors the cache holds after the prefill (:func:`~lrkv_core.cache.cache_nbytes`). Peak memory is the
device's allocator peak on CUDA, the process's peak resident set elsewhere (a process-wide maximum: read it
as an upper bound there).

With ``static=True`` both run over preallocated caches (transformers' ``StaticCache``; a compressed model
swaps it for a :class:`~lrkv_core.cache.StaticLatentCache`) sized for the prefill and every decode step, so
their KV bytes are those buffers; ``compiled=True`` also compiles the decode step (``torch.compile``, mode
``reduce-overhead`` on CUDA: the step replayed as a CUDA graph, Python and launch overheads out of the
timing; the first warmup step runs eagerly, the others absorb the compilation and recording).

The decode attention alone (:func:`measure_kernels`): one layer's attention timed apart from the rest of the
step, what it runs on the device (SDPA over the original's dense K/V; a compressed model's latent path, the
flash kernel on CUDA, and beside it the torch path over the same cache), with the bytes and FLOPs the step
must move and compute (:func:`dense_attention_cost`, :func:`latent_attention_cost`) and the device's copy
bandwidth and matrix-multiply rate measured in the same call (:func:`copy_bandwidth`,
:func:`matmul_flops`), so the time reads against its roofline.
"""

from __future__ import annotations

import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import StaticCache

from ..cache import LatentView, cache_kwargs, cache_nbytes, output_cache
from ..model.attention import LatentAttention, LatentAttentionBase
from ..model.attention_rotated import RotatedKeyAttention

# latent attentions with a decode path of their own (attend_latents over a view): keys rebuilt, or rotated
DECODING_ATTENTIONS = (LatentAttention, RotatedKeyAttention)

Progress = Callable[[int, int], None] | None


@dataclass(frozen=True)
class ServingPoint:
    """One (context, batch) measurement of one model."""

    context: int
    batch: int
    decode_ms: float  # median latency of one decode step of the whole batch
    decode_ms_spread: tuple[float, float]  # the fastest and slowest timed step
    prefill_s: float  # the context's prefill, all rows
    prefill_tokens_per_s: float
    kv_bytes: int  # what the cache holds after the prefill (all rows)
    kv_bytes_per_token: float  # per row and prefilled token
    peak_memory_bytes: int
    peak_memory_source: str  # "cuda allocator" or "process RSS (upper bound)"

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: one token per row per step."""
        return self.batch / self.decode_ms * 1e3

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tokens_per_s": self.tokens_per_s}

    def line(self) -> str:
        """The point in one line, as a log shows it while a run goes on."""
        return (
            f"context {self.context} × batch {self.batch}: decode {self.decode_ms:.3f} ms/step "
            f"({self.tokens_per_s:.1f} tokens/s), prefill {self.prefill_tokens_per_s:.0f} tokens/s, "
            f"KV {self.kv_bytes_per_token:.0f} B/token, peak {self.peak_memory_bytes / 2**20:.0f} MiB"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda allocator"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "process RSS (upper bound)"


@torch.no_grad()
def measure_point(
    model: nn.Module,
    *,
    context: int,
    batch: int,
    steps: int = 16,
    warmup: int = 2,
    chunk_size: int = 1024,
    seed: int = 0,
    static: bool = False,
    compiled: bool = False,
) -> ServingPoint:
    """Prefill ``batch`` × ``context`` random tokens in chunks, then time ``steps`` one-token decode steps
    (over a preallocated cache with ``static``, the step compiled with ``compiled``: see the module)."""
    if context < 1 or batch < 1 or steps < 1 or warmup < 0 or chunk_size < 1:
        raise ValueError(
            f"context, batch, steps and chunk_size must be ≥ 1 and warmup ≥ 0, got {context}, {batch}, "
            f"{steps}, {chunk_size}, {warmup}"
        )
    if compiled and not static:
        raise ValueError("a compiled decode step needs a static cache (static=True)")
    if compiled and warmup < 1:
        raise ValueError("a compiled decode step needs warmup ≥ 1 (the first step runs eagerly)")
    length = context + warmup + steps
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and length > limit:
        raise ValueError(
            f"context {context} + {warmup + steps} decode steps passes the model's {limit} positions"
        )
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (batch, length), generator=gen).to(device)
    was_training = model.training
    model.eval()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        step = model
        if compiled:
            step = torch.compile(model, mode="reduce-overhead" if device.type == "cuda" else "default")
        _sync(device)
        start = time.perf_counter()
        cache = StaticCache(config=model.config, max_cache_len=length) if static else None
        for lo in range(0, context, chunk_size):
            kwargs = {} if cache is None else cache_kwargs(cache)  # (an empty static one at first)
            out = model(
                ids[:, lo : min(lo + chunk_size, context)], use_cache=True, logits_to_keep=1, **kwargs
            )
            cache = output_cache(out)
        _sync(device)
        prefill_s = time.perf_counter() - start
        kv_bytes = cache_nbytes(cache)
        times = []
        for i in range(warmup + steps):
            token = ids[:, context + i : context + i + 1]
            _sync(device)
            start = time.perf_counter()
            # the first step eager: what a model builds once (the kernel's weight layout) is built outside
            forward = model if i == 0 else step  # the compiled graph
            out = forward(token, use_cache=True, **cache_kwargs(cache))
            _sync(device)
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
            cache = output_cache(out)
        peak, source = _peak_memory(device)
    finally:
        model.train(was_training)
    return ServingPoint(
        context=context,
        batch=batch,
        decode_ms=statistics.median(times),
        decode_ms_spread=(min(times), max(times)),
        prefill_s=prefill_s,
        prefill_tokens_per_s=batch * context / prefill_s,
        kv_bytes=kv_bytes,
        kv_bytes_per_token=kv_bytes / (batch * context),
        peak_memory_bytes=peak,
        peak_memory_source=source,
    )


def measure_grid(
    model: nn.Module,
    contexts: Sequence[int],
    batches: Sequence[int],
    *,
    steps: int = 16,
    warmup: int = 2,
    chunk_size: int = 1024,
    seed: int = 0,
    static: bool = False,
    compiled: bool = False,
    progress: Progress = None,
    on_point: Callable[[ServingPoint], Any] | None = None,
) -> list[ServingPoint]:
    """:func:`measure_point` at every context × batch, contexts outermost; ``on_point`` gets each point as it
    is measured."""
    points = [(c, b) for c in contexts for b in batches]
    out = []
    for i, (context, batch) in enumerate(points):
        out.append(
            measure_point(
                model,
                context=context,
                batch=batch,
                steps=steps,
                warmup=warmup,
                chunk_size=chunk_size,
                seed=seed,
                static=static,
                compiled=compiled,
            )
        )
        if on_point is not None:
            on_point(out[-1])
        if progress is not None:
            progress(i + 1, len(points))
    return out


def batch_within_budget(budget_bytes: float, kv_bytes_per_token: float, context: int) -> int:
    """The largest batch whose cache of ``context`` tokens per row fits ``budget_bytes`` (at least 1).

    The bytes per token are a measured cache's bytes over its rows and tokens, which spreads the few bytes a
    cache holds once (a static layer's counters) over the rows, so a batch whose cache fits the budget
    exactly may come out a few bytes above it: batches within 0.01 % of the budget count as fitting."""
    if kv_bytes_per_token <= 0 or context < 1:
        raise ValueError(f"bytes per token and context must be positive, got {kv_bytes_per_token}, {context}")
    return max(1, math.floor(budget_bytes / (kv_bytes_per_token * context) * (1 + 1e-4)))


# --- the decode attention alone, against its roofline ------------------------------------------------------


@dataclass(frozen=True)
class StepCost:
    """What one decode step of one layer's attention must move and compute."""

    bytes: int  # read (cache, weights, queries) + written (output)
    flops: int  # multiply-adds count two


def dense_attention_cost(
    batch: int, context: int, heads: int, kv_heads: int, head_dim: int, itemsize: int
) -> StepCost:
    """One decode step of attention over a dense K/V cache: read K and V (B, Hkv, S, D) and the queries
    (B, H, D), write the output (B, H, D); scores q·K and p·V, 2·S·D FLOPs each per query head."""
    cache = 2 * batch * kv_heads * context * head_dim * itemsize
    io = 2 * batch * heads * head_dim * itemsize
    return StepCost(bytes=cache + io, flops=4 * batch * heads * context * head_dim)


def latent_attention_cost(
    batch: int,
    context: int,
    heads: int,
    head_dim: int,
    group_size: int,
    ranks_k: Sequence[int],
    ranks_v: Sequence[int],
    cache_bytes: int,
    weight_bytes: int,
    itemsize: int,
    rotated_keys: bool = False,
) -> StepCost:
    """One decode step of latent attention (groups g of ``group_size`` KV heads, ranks r_g): read the cached
    latents as stored (``cache_bytes``), the key up-projections (``weight_bytes``) and the queries (B, H, D);
    write the output (B, Σ_g nq·r_v,g) with nq = H / G query heads per group. FLOPs: the keys rebuilt,
    2·S·(s·D)·r_k,g per group; the scores, 2·S·D per query head; p·H_v, 2·S·r_v,g per query head. With
    ``rotated_keys`` (latents of rotated keys, queries absorbed) no key is rebuilt: each query head absorbs
    its ``B_k`` rows, 2·D·r_k,g, and scores the latents, 2·S·r_k,g."""
    groups = len(ranks_k)
    nq = heads // groups
    if rotated_keys:
        rebuild = sum(2 * nq * head_dim * r for r in ranks_k)  # the queries absorbed
        scores = sum(2 * nq * context * r for r in ranks_k)
    else:
        rebuild = sum(2 * context * group_size * head_dim * r for r in ranks_k)
        scores = 2 * heads * context * head_dim
    values = sum(2 * nq * context * r for r in ranks_v)
    io = batch * (heads * head_dim + nq * sum(ranks_v)) * itemsize
    return StepCost(bytes=cache_bytes + weight_bytes + io, flops=batch * (rebuild + scores + values))


def view_nbytes(view: LatentView) -> int:
    """The bytes a decode step reads from a layer's cache: the latents as stored (a quantized store's packed
    codes, scales and zero-points and its unquantized window; else the per-group latents) and positions."""
    if view.packed is not None:
        parts = [t for p in view.packed for t in (p.codes, p.scale, p.zero, p.recent) if t is not None]
    else:
        parts = [*view.keys, *view.values]
    if view.positions is not None:
        parts.append(view.positions)
    return sum(t.numel() * t.element_size() for t in parts)


def time_call(fn: Callable[[], Any], device: torch.device, *, steps: int, warmup: int) -> list[float]:
    """Milliseconds of ``steps`` calls of ``fn`` after ``warmup`` untimed ones, the device synchronised around
    each."""
    times = []
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


@torch.no_grad()
def copy_bandwidth(device: torch.device, nbytes: int, *, steps: int = 8, warmup: int = 2) -> float:
    """The device's achievable memory bandwidth in bytes/s: a copy of ``nbytes`` (make it larger than the
    caches, 256 MiB on a GPU) timed as :func:`time_call` does, bytes read + written over the median time."""
    if nbytes < 8:
        raise ValueError(f"the copy needs at least 8 bytes, got {nbytes}")
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = statistics.median(time_call(lambda: dst.copy_(src), device, steps=steps, warmup=warmup))
    return 2 * src.numel() * 4 / (ms * 1e-3)


@torch.no_grad()
def matmul_flops(
    device: torch.device, dtype: torch.dtype, n: int, *, steps: int = 8, warmup: int = 2
) -> float:
    """The device's achievable matrix-multiply rate in FLOP/s for ``dtype``: an ``n``×``n`` by ``n``×``n``
    product (4096 on a GPU: tensor cores at full occupancy) timed as :func:`time_call` does, ``2·n³`` over
    the median time. The compute roof a decode step's FLOPs are set against."""
    if n < 1:
        raise ValueError(f"the product needs n ≥ 1, got {n}")
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device, dtype) for _ in range(2))
    ms = statistics.median(time_call(lambda: a @ b, device, steps=steps, warmup=warmup))
    return 2 * n**3 / (ms * 1e-3)


def path_note(taken: bool, difference: float | None) -> str:
    """`` (not taken, output within 3.1e-03 of the taken path's)`` for a path timed beside the one a decode
    step takes, else ``""``."""
    if taken:
        return ""
    within = "" if difference is None else f", output within {difference:.1e} of the taken path's"
    return f" (not taken{within})"


@dataclass(frozen=True)
class KernelPoint:
    """One layer's decode attention alone at one (context, batch), set against the copy bandwidth and the
    matrix-multiply rate measured in the same task (its roofs)."""

    context: int
    batch: int
    path: str  # what ran: "torch sdpa", "triton flash", "triton absorbed" or "torch unfused"
    time_ms: float  # median
    bytes: int
    flops: int
    copy_bytes_per_s: float
    matmul_flop_per_s: float
    taken: bool = True  # the path the model's decode step takes here (False: the other path, timed beside)
    difference: float | None = None  # the other path's: max |its output − the taken path's| / max |taken|

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / (self.time_ms * 1e-3)

    def line(self) -> str:
        """The point in one line, as a log shows it while a run goes on."""
        d, note = self.to_dict(), path_note(self.taken, self.difference)
        return (
            f"context {self.context} × batch {self.batch}, {self.path}{note}: "
            f"{self.time_ms * 1e3:.1f} µs, {d['fraction_of_copy']:.3f} of copy, "
            f"{d['fraction_of_matmul']:.3f} of matmul"
        )

    def to_dict(self) -> dict[str, Any]:
        gbs = self.bytes_per_s / 1e9
        return asdict(self) | {
            "achieved_gb_per_s": gbs,
            "copy_gb_per_s": self.copy_bytes_per_s / 1e9,
            "fraction_of_copy": self.bytes_per_s / self.copy_bytes_per_s,
            "gflop_per_s": self.flops / (self.time_ms * 1e-3) / 1e9,
            "matmul_gflop_per_s": self.matmul_flop_per_s / 1e9,
            "fraction_of_matmul": self.flops / (self.time_ms * 1e-3) / self.matmul_flop_per_s,
        }


@torch.no_grad()
def measure_attention(
    model: nn.Module,
    *,
    context: int,
    batch: int,
    copy_bytes_per_s: float,
    matmul_flop_per_s: float,
    steps: int = 16,
    warmup: int = 2,
    seed: int = 0,
) -> list[KernelPoint]:
    """The first layer's decode attention alone, after a prefill of ``batch`` × ``context`` random tokens:
    torch SDPA over the original's dense K/V cache, or a compressed model's latent path as its decode step
    takes it on this device (``attend_latents`` of :class:`~lrkv_core.model.attention.LatentAttention`, or
    of ``RotatedKeyAttention`` for latents of rotated keys: the flash or the absorbed kernel on CUDA, except
    where SDPA is faster, else the unfused torch path), with random queries; the median of ``steps`` calls.
    Where a kernel can run, the path the step does not take over the same cache is timed too (a second
    point, ``taken=False``): the torch path beside a kernel, or the kernel beside torch's SDPA where that
    reads the latents faster (``RotatedKeyAttention.sdpa_is_faster``); its ``difference`` says how far its
    output is from the taken path's (the kernel's check on this device, at this context)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(model.config.vocab_size, (batch, context), generator=gen).to(device)
    was_training = model.training
    model.eval()
    try:
        cache = output_cache(model(ids, use_cache=True, logits_to_keep=1))
    finally:
        model.train(was_training)
    latent = next((m for m in model.modules() if isinstance(m, DECODING_ATTENTIONS)), None)
    dtype = next(model.parameters()).dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    if latent is None:
        k, v = cache.layers[0].keys, cache.layers[0].values  # (B, Hkv, S, D)
        heads = model.config.num_attention_heads
        q = torch.randn(batch, heads, 1, k.shape[-1], generator=gen).to(device, k.dtype)
        cost = dense_attention_cost(batch, k.shape[2], heads, k.shape[1], k.shape[-1], k.element_size())
        path = "torch sdpa"

        def step() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    else:
        store = cache.layers[latent.layer_idx].store
        H, D = latent.shape.H, latent.shape.D
        q = torch.randn(batch, H, 1, D, generator=gen).to(device, dtype)
        view = store.view()
        ups = [p for up in latent.k_up for p in up.parameters()]  # B_k and the k bias rows
        layout = latent.layout
        rotated = isinstance(latent, RotatedKeyAttention)
        cost = latent_attention_cost(
            batch, view.keys[0].shape[1], H, D, layout.group_size, layout.ranks_k, layout.ranks_v,
            view_nbytes(view), sum(p.numel() * p.element_size() for p in ups), itemsize, rotated,
        )  # fmt: skip
        kernel_path = "triton absorbed" if rotated else "triton flash"
        fused = latent.takes_kernel(q, view, None)
        path = kernel_path if fused else "torch unfused"

        def step() -> torch.Tensor:  # a fresh view per step, as the model's decode step reads the store
            return latent.attend_latents(q, store.view(), None)

    def point(path: str, taken: bool, difference: float | None = None) -> KernelPoint:
        times = time_call(step, device, steps=steps, warmup=warmup)
        return KernelPoint(
            context=context, batch=batch, path=path, time_ms=statistics.median(times), bytes=cost.bytes,
            flops=cost.flops, copy_bytes_per_s=copy_bytes_per_s, matmul_flop_per_s=matmul_flop_per_s,
            taken=taken, difference=difference,
        )  # fmt: skip

    points = [point(path, True)]
    if latent is not None and latent.decodes_fused(q):  # the kernel could run: the other path beside
        taken_out = step().float()
        chosen, latent.fused_decode = latent.fused_decode, not fused
        try:
            other = (step().float() - taken_out).abs().max() / taken_out.abs().max()
            points.append(point("torch unfused" if fused else kernel_path, False, float(other)))
        finally:
            latent.fused_decode = chosen
    return points


def measure_kernels(
    model: nn.Module,
    contexts: Sequence[int],
    batch: int,
    *,
    steps: int = 16,
    warmup: int = 2,
    copy_nbytes: int | None = None,
    matmul_n: int | None = None,
    progress: Progress = None,
    on_point: Callable[[KernelPoint], Any] | None = None,
) -> list[KernelPoint]:
    """The device's :func:`copy_bandwidth` (of ``copy_nbytes``, default 256 MiB on CUDA, 32 MiB elsewhere)
    and :func:`matmul_flops` in the model's dtype (``matmul_n``, default 4096 on CUDA, 512 elsewhere), then
    :func:`measure_attention` at every context against them. A compressed model without RoPE gives no
    rows: its latent attention has no decode path of its own (``B_k`` is folded into ``q_proj``).
    ``on_point`` gets each point as it is measured."""
    latents = [m for m in model.modules() if isinstance(m, LatentAttentionBase)]
    if latents and not any(isinstance(m, DECODING_ATTENTIONS) for m in latents):
        return []
    device = next(model.parameters()).device
    nbytes = copy_nbytes or (256 << 20 if device.type == "cuda" else 32 << 20)
    copy = copy_bandwidth(device, nbytes, steps=steps, warmup=warmup)
    dtype = next(model.parameters()).dtype
    n = matmul_n or (4096 if device.type == "cuda" else 512)
    peak = matmul_flops(device, dtype, n, steps=steps, warmup=warmup)
    out = []
    for i, context in enumerate(contexts):
        roofs = {"copy_bytes_per_s": copy, "matmul_flop_per_s": peak}
        points = measure_attention(model, context=context, batch=batch, steps=steps, warmup=warmup, **roofs)
        if on_point is not None:
            for point in points:
                on_point(point)
        out += points
        if progress is not None:
            progress(i + 1, len(contexts))
    return out
