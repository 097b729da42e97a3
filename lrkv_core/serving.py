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
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .cache import cache_kwargs, cache_nbytes, output_cache

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
) -> ServingPoint:
    """Prefill ``batch`` × ``context`` random tokens in chunks, then time ``steps`` one-token decode steps."""
    if context < 1 or batch < 1 or steps < 1 or warmup < 0 or chunk_size < 1:
        raise ValueError(
            f"context, batch, steps and chunk_size must be ≥ 1 and warmup ≥ 0, got {context}, {batch}, "
            f"{steps}, {chunk_size}, {warmup}"
        )
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and context + warmup + steps > limit:
        raise ValueError(
            f"context {context} + {warmup + steps} decode steps passes the model's {limit} positions"
        )
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (batch, context + warmup + steps), generator=gen).to(device)
    was_training = model.training
    model.eval()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        _sync(device)
        start = time.perf_counter()
        cache = None
        for lo in range(0, context, chunk_size):
            kwargs = {} if cache is None else cache_kwargs(cache)
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
            out = model(token, use_cache=True, **cache_kwargs(cache))
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
    progress: Progress = None,
) -> list[ServingPoint]:
    """:func:`measure_point` at every context × batch, contexts outermost."""
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
            )
        )
        if progress is not None:
            progress(i + 1, len(points))
    return out


def batch_within_budget(budget_bytes: float, kv_bytes_per_token: float, context: int) -> int:
    """The largest batch whose cache of ``context`` tokens per row fits ``budget_bytes`` (at least 1)."""
    if kv_bytes_per_token <= 0 or context < 1:
        raise ValueError(f"bytes per token and context must be positive, got {kv_bytes_per_token}, {context}")
    return max(1, int(budget_bytes // (kv_bytes_per_token * context)))
