"""Long-context evaluation through the deployed cache: continuation after a long context, and retrieval.

*Continuation*: the held-out token stream is cut into non-overlapping windows of ``C + N`` tokens per context
length ``C`` (or windows starting every ``stride`` tokens, ``stride ≥ N``: more windows from a stream too
short for many long ones, each scoring tokens no other window scores); the context is prefilled into a
fresh cache in chunks of ``chunk_size`` tokens (memory stays bounded), then the ``N`` continuation tokens
are scored teacher-forced at their true positions ``C..C+N-1``: the context's last logits predict the first,
one forward of the continuation against the cache the rest (equal to decoding them one by one up to float
rounding, tested). A compressed model reads every key and value back from its
:class:`~lrkv_core.cache.LatentCache`, in whatever storage its config names (dense, quantized, GEAR, TALE);
an original model runs through transformers' ``DynamicCache``.

*Retrieval*: the tasks of :mod:`lrkv_core.evaluation.needles` at every length × depth, answered by greedy
``generate()`` through the same cache and scored by exact match: a depth × length accuracy grid per task.

Lengths ``C`` (and ``C + N``, or a prompt plus its answer) beyond the model's ``max_position_embeddings``
are capped to it. :class:`LongContextResult` carries the :class:`LongContextProtocol` it was measured under;
with an original model given as ``base``, its numbers are measured on the same windows and prompts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lrkv_core.cache import cache_kwargs, cache_nbytes, output_cache
from lrkv_core.data.datasets import strided_windows
from lrkv_core.evaluation.needles import TASKS, PromptTooShort, generate_answer, is_exact_match, make_samples

Progress = Callable[[int, int], None] | None
CacheFactory = Callable[[], Any] | None
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_TASKS = ("passkey", "needle", "multikey")
ANSWER_RESERVE = 32  # positions kept free after a retrieval prompt for its answer


@dataclass(frozen=True)
class LongContextProtocol:
    """What a long-context result was measured under (recorded with every result)."""

    dataset: str
    lengths: tuple[int, ...]  # context / prompt lengths asked for
    continuation: int = 256  # N tokens scored after each context
    windows: int | None = 8  # continuation windows per length (None: all the stream holds)
    stride: int | None = None  # continuation windows start this many tokens apart (None: do not overlap)
    chunk_size: int = 1024  # context prefill chunk
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    samples: int = 4  # retrieval prompts per task × length × depth
    tasks: tuple[str, ...] = DEFAULT_TASKS
    seed: int = 0
    context_lengths: tuple[int, ...] = ()  # continuation contexts C measured (capped: C + N fits the model)
    prompt_lengths: tuple[int, ...] = ()  # retrieval prompt lengths measured (capped: prompt + answer fits)
    max_position_embeddings: int | None = None
    cache: Any = None  # the cache the model ran through: a storage's dict, or a class name

    def to_dict(self) -> dict[str, Any]:
        fields = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        return {"measure": "long_context"} | fields


@dataclass(frozen=True)
class ContinuationScore:
    """NLL of the ``N`` tokens after a ``context_len`` context, over ``windows`` windows."""

    context_len: int
    windows: int
    tokens: int
    nll: float
    base_nll: float | None = None
    kv_bytes_per_token: float | None = None  # what the cache holds after the continuation, per token held
    base_kv_bytes_per_token: float | None = None  # the original model's cache for the same tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def base_ppl(self) -> float | None:
        return None if self.base_nll is None else math.exp(self.base_nll)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ppl": self.ppl, "base_ppl": self.base_ppl}


@dataclass(frozen=True)
class RetrievalScore:
    """Exact-match count of one task × length × depth cell (and the original model's, with a base)."""

    task: str
    length: int
    depth: float
    samples: int
    correct: int
    base_correct: int | None = None
    mean_depth: float = 0.0  # where the needles really sat (sentence ends), averaged

    @property
    def accuracy(self) -> float:
        return self.correct / self.samples

    def to_dict(self) -> dict[str, Any]:
        base = None if self.base_correct is None else self.base_correct / self.samples
        return asdict(self) | {"accuracy": self.accuracy, "base_accuracy": base}


@dataclass
class LongContextResult:
    """Continuation NLL per context length and a retrieval grid, with their protocol."""

    protocol: LongContextProtocol
    continuation: list[ContinuationScore] = field(default_factory=list)
    retrieval: list[RetrievalScore] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # measurements left out, and why

    def to_dict(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol.to_dict(),
            "continuation": [c.to_dict() for c in self.continuation],
            "retrieval": [r.to_dict() for r in self.retrieval],
            "grid": {task: self.grid(task) for task in self.protocol.tasks},
            "skipped": list(self.skipped),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LongContextResult:
        """The result :meth:`to_dict` wrote (e.g. a stored task result)."""
        fields = {k: v for k, v in data["protocol"].items() if k != "measure"}
        protocol = LongContextProtocol(
            **{k: tuple(v) if isinstance(v, list) and k != "cache" else v for k, v in fields.items()}
        )
        derived = {"ppl", "base_ppl", "accuracy", "base_accuracy"}
        return cls(
            protocol,
            [
                ContinuationScore(**{k: v for k, v in c.items() if k not in derived})
                for c in data["continuation"]
            ],
            [RetrievalScore(**{k: v for k, v in r.items() if k not in derived}) for r in data["retrieval"]],
            list(data.get("skipped", [])),
        )

    def grid(self, task: str, *, base: bool = False) -> dict[str, dict[str, float | None]]:
        """``{depth: {length: accuracy}}`` of one task (keys as strings, for JSON and MLflow tables)."""
        out: dict[str, dict[str, float | None]] = {}
        for r in self.retrieval:
            if r.task == task:
                value = (
                    r.accuracy
                    if not base
                    else (None if r.base_correct is None else r.base_correct / r.samples)
                )
                out.setdefault(f"{r.depth:g}", {})[str(r.length)] = value
        return out

    def table(self) -> list[dict[str, Any]]:
        """One flat row per measurement (continuation per length, retrieval per cell), e.g. for an MLflow
        table; each row names its protocol's dataset and seed."""
        tag = {"dataset": self.protocol.dataset, "seed": self.protocol.seed}
        rows = [{"kind": "continuation", **c.to_dict(), **tag} for c in self.continuation]
        return rows + [{"kind": "retrieval", **r.to_dict(), **tag} for r in self.retrieval]

    def markdown(self) -> str:
        p = self.protocol
        has_base = any(c.base_nll is not None for c in self.continuation) or any(
            r.base_correct is not None for r in self.retrieval
        )
        lines = [f"Continuation: {p.continuation} tokens after the context, {p.dataset}", ""]
        has_bytes = any(c.kv_bytes_per_token is not None for c in self.continuation)
        head = ["context", "windows", "nll", "ppl"] + (["KV bytes/token"] if has_bytes else [])
        head += (
            (["base nll", "base ppl"] + (["base KV bytes/token"] if has_bytes else [])) if has_base else []
        )
        lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]

        def kv(value: float | None) -> list[str]:
            return [f"{value:.1f}" if value is not None else ""] if has_bytes else []

        for c in self.continuation:
            cells = [
                str(c.context_len),
                str(c.windows),
                f"{c.nll:.4f}",
                f"{c.ppl:.3f}",
                *kv(c.kv_bytes_per_token),
            ]
            if c.base_nll is not None:
                cells += [f"{c.base_nll:.4f}", f"{c.base_ppl:.3f}", *kv(c.base_kv_bytes_per_token)]
            lines.append("| " + " | ".join(cells) + " |")
        for task in p.tasks:
            lengths = sorted({r.length for r in self.retrieval if r.task == task})
            if not lengths:
                continue
            lines += [
                "",
                f"Retrieval `{task}`: exact match, {p.samples} prompts per cell (depth × length)",
                "",
            ]
            lines += ["| depth | " + " | ".join(map(str, lengths)) + " |", "|---" * (len(lengths) + 1) + "|"]
            for depth, row in self.grid(task).items():
                base_row = self.grid(task, base=True)[depth]
                cells = [
                    f"{row[str(n)]:.2f}"
                    + (f" ({base_row[str(n)]:.2f})" if base_row[str(n)] is not None else "")
                    for n in lengths
                ]
                lines.append(f"| {depth} | " + " | ".join(cells) + " |")
        if has_base:
            lines += ["", "(in parentheses / base columns: the original model)"]
        lines += [""] + [f"Skipped: {why}" for why in self.skipped] if self.skipped else []
        return "\n".join(lines)


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed NLL in float32/64: logits (B, S, V), targets (B, S)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum").double().item()


def continuation_nll(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    context_len: int,
    chunk_size: int = 1024,
    cache_factory: CacheFactory = None,
    progress: Progress = None,
) -> tuple[float, int]:
    """Summed NLL of targets ``context_len..T-1`` of (N, T) ``windows``, a window at a time, through a cache.

    The context is prefilled in chunks of ``chunk_size`` (``use_cache=True``; only the last position's logits
    are kept); its last logits predict target ``C``, one forward of tokens ``C..T-2`` against the cache the
    rest. Returns ``(nll_sum, tokens, kv_bytes)``: ``kv_bytes`` is what the cache holds once the window's
    ``T − 1`` tokens are in it (:func:`~lrkv_core.cache.cache_nbytes`), summed over the windows.
    """
    n, t = windows.shape
    if not 1 <= context_len < t or chunk_size < 1:
        raise ValueError(
            f"context_len must be in [1, {t - 1}] and chunk_size >= 1, got {context_len}, {chunk_size}"
        )
    total, held, was_training = 0.0, 0, model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for i in range(n):
                ids = windows[i : i + 1].to(device)  # (1, T)
                cache = None if cache_factory is None else cache_factory()
                for start in range(0, context_len, chunk_size):
                    chunk = ids[:, start : min(start + chunk_size, context_len)]
                    kwargs = {} if cache is None else cache_kwargs(cache)
                    out = model(chunk, use_cache=True, logits_to_keep=1, **kwargs)
                    cache = output_cache(out)
                total += _nll_sum(out.logits[:, -1:], ids[:, context_len : context_len + 1])
                if t - context_len > 1:
                    out = model(ids[:, context_len:-1], use_cache=True, **cache_kwargs(cache))
                    total += _nll_sum(out.logits, ids[:, context_len + 1 :])  # logits (1, N-1, V)
                    cache = output_cache(out)
                held += cache_nbytes(cache)
                if progress is not None:
                    progress(i + 1, n)
    finally:
        model.train(was_training)
    return total, n * (t - context_len), held


def cut_windows(
    seqs: Sequence[torch.Tensor],
    length: int,
    max_windows: int | None,
    prefix: Sequence[int] = (),
    *,
    stride: int | None = None,
) -> torch.Tensor:
    """(N, length) windows from the start of each sequence, the first ``max_windows``; with ``prefix`` (a
    text stream's leading tokens, :func:`lrkv_core.data.datasets.window_prefix`), each window is ``prefix``
    then ``length - len(prefix)`` consecutive tokens. Windows do not overlap, or with ``stride`` each starts
    ``stride`` tokens after the one before: a stream too short for many long windows gives more of them,
    whose last ``stride`` tokens (what a continuation of at most ``stride`` tokens scores) are distinct."""
    step = length - len(prefix) if stride is None else stride  # None: each window after the last
    parts = [strided_windows(s.reshape(-1), length, step, prefix) for s in seqs]
    out = torch.cat(parts) if parts else torch.empty(0, length, dtype=torch.long)
    return out if max_windows is None else out[:max_windows]


def check_stride(stride: int | None, continuation: int) -> None:
    """Refuse a stride of continuation windows (``None``: no overlap) under one token or under the
    ``continuation`` tokens each window scores (a token would be scored twice)."""
    if stride is not None and stride < max(1, continuation):
        raise ValueError(
            f"a stride of {stride} tokens would score some of the {continuation} continuation tokens twice: "
            "give a stride of at least the continuation"
        )


def cap_lengths(lengths: Sequence[int], limit: int | None, reserve: int) -> tuple[int, ...]:
    """Lengths with ``length + reserve <= limit``, longer ones replaced by ``limit - reserve``; sorted."""
    if limit is None:
        return tuple(sorted(set(lengths)))
    top = limit - reserve
    if top < 1:
        raise ValueError(f"max_position_embeddings {limit} leaves no room for {reserve} more tokens")
    return tuple(sorted({min(n, top) for n in lengths}))


def evaluate_long_context(
    model: nn.Module,
    tokenizer: Any,
    seqs: Sequence[torch.Tensor],
    protocol: LongContextProtocol,
    *,
    base: nn.Module | None = None,
    cache_factory: CacheFactory = None,
    progress: Progress = None,
    prefix: Sequence[int] = (),
) -> LongContextResult:
    """Run the suite of ``protocol`` on ``model`` (and ``base``): the token ``seqs`` (held-out text, one
    stream, or rows) give the continuation windows and the retrieval haystack; every continuation window
    starts with ``prefix`` (a text stream's leading tokens such as BOS, as retrieval prompts do).

    ``protocol.lengths`` is capped by the model's ``max_position_embeddings`` (continuation: ``C + N``
    tokens; retrieval: the prompt and its answer); the returned protocol records the lengths measured.
    Measurements that cannot be made (no ``C + N`` window in the data, a prompt shorter than its template) are
    listed in ``skipped``.
    """
    if protocol.continuation < 0 or protocol.samples < 0 or protocol.chunk_size < 1:
        raise ValueError("continuation and samples must be >= 0 (0 skips that part) and chunk_size >= 1")
    if protocol.windows is not None and protocol.windows < 1:
        raise ValueError(f"windows must be >= 1 (or None: all), got {protocol.windows}")
    check_stride(protocol.stride, protocol.continuation)
    if not protocol.lengths or min(protocol.lengths) < 1:
        raise ValueError(f"lengths must be positive, got {list(protocol.lengths)}")
    limit = getattr(model.config, "max_position_embeddings", None)
    cont_lengths = (
        cap_lengths(protocol.lengths, limit, protocol.continuation) if protocol.continuation else ()
    )
    ret_lengths = (
        cap_lengths(protocol.lengths, limit, ANSWER_RESERVE) if protocol.tasks and protocol.samples else ()
    )
    cache = getattr(model.config, "lrkv", None) or {}
    protocol = replace(
        protocol,
        context_lengths=cont_lengths,
        prompt_lengths=ret_lengths,
        max_position_embeddings=limit,
        cache=protocol.cache if protocol.cache is not None else cache.get("cache", "DynamicCache"),
    )
    for task in protocol.tasks:
        if task not in TASKS:
            raise ValueError(f"unknown retrieval task {task!r}; known: {', '.join(TASKS)}")
    haystack = torch.cat([s.reshape(-1) for s in seqs])
    result = LongContextResult(protocol)
    for part, measured in (("continuation", cont_lengths), ("retrieval", ret_lengths)):
        longer = [n for n in protocol.lengths if measured and n > max(measured)]
        if longer:
            result.skipped.append(
                f"{part} at {', '.join(map(str, longer))}: the model has {limit} positions; measured at "
                f"{max(measured)} instead"
            )
    plan = []  # (C, (N, C + N) windows)
    for c in cont_lengths:
        n = c + protocol.continuation
        windows = cut_windows(seqs, n, protocol.windows, prefix, stride=protocol.stride)
        if windows.shape[0] == 0:
            result.skipped.append(f"continuation at {c}: the data holds no {n}-token window")
        else:
            plan.append((c, windows))
    cells = []  # (task, length, depth, samples)
    for task in protocol.tasks:
        for n in ret_lengths:
            try:
                cells += [(task, n, d, make_samples(task, tokenizer, haystack, length=n, depth=d,
                                                    samples=protocol.samples, seed=protocol.seed))
                          for d in protocol.depths]  # fmt: skip
            except PromptTooShort as err:
                result.skipped.append(str(err))
    models = [model] + ([base] if base is not None else [])
    total = len(models) * (sum(w.shape[0] for _, w in plan) + len(cells) * protocol.samples)
    done = 0

    def tick(_: int = 0, __: int = 0) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    def factory(m: nn.Module) -> CacheFactory:
        return cache_factory if m is model else None

    for c, windows in plan:
        runs = [
            continuation_nll(m, windows, context_len=c, chunk_size=protocol.chunk_size,
                             cache_factory=factory(m), progress=tick)
            for m in models
        ]  # fmt: skip
        tokens, held = windows.shape[0] * protocol.continuation, windows.shape[0] * (windows.shape[1] - 1)
        nll, kv = [r[0] / tokens for r in runs], [r[2] / held for r in runs]
        base_nll, base_kv = (nll[1], kv[1]) if base is not None else (None, None)
        result.continuation.append(
            ContinuationScore(c, windows.shape[0], tokens, nll[0], base_nll, kv[0], base_kv)
        )
    for task, n, depth, samples in cells:
        correct = []
        for m in models:
            hits = 0
            for sample in samples:
                hits += is_exact_match(
                    generate_answer(m, tokenizer, sample, cache_factory=factory(m)), sample.answer
                )
                tick()
            correct.append(hits)
        mean_depth = sum(x.actual_depth for x in samples) / len(samples)
        base_correct = correct[1] if base is not None else None
        result.retrieval.append(
            RetrievalScore(task, n, depth, len(samples), correct[0], base_correct, mean_depth)
        )
    return result


__all__ = [
    "DEFAULT_DEPTHS",
    "DEFAULT_LENGTHS",
    "DEFAULT_TASKS",
    "ContinuationScore",
    "LongContextProtocol",
    "LongContextResult",
    "RetrievalScore",
    "cap_lengths",
    "continuation_nll",
    "check_stride",
    "cut_windows",
    "evaluate_long_context",
]
