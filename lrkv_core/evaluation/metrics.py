"""Evaluation of the deployed cache: prefill and decode perplexity, KV bytes per token, KL to the base.

Every function takes (N, T) windows of token ids (see :func:`lrkv_core.data.datasets.eval_windows`), runs
under ``torch.no_grad()`` with the model in eval mode, and returns a plain dict whose ``protocol`` sub-dict
says what was measured (seq_len, prefix_len, windows, tokens scored, which targets), so numbers from different
protocols are never compared by accident.

Prefill scores each window in one forward pass through a fresh cache (``use_cache=True``), as a deployed
model prefills a prompt: an lrkv model's attention then reads every latent back from its cache storage, so
a quantized latent cache shows its cost here too (Palu's protocol, every token quantized); for the original
model and a dense latent cache the logits are those of a cache-free pass. Decode prefills a prefix, then
feeds the remaining tokens one by one through the returned cache (teacher forcing): lazy or token-adaptive
caches, and caches that keep a prompt in full precision (transformers' ``QuantizedCache``), only show their
cost there. ``cache_factory`` (a callable returning an empty ``Cache``) evaluates a model with a cache of
the caller's choosing, e.g. transformers' ``QuantizedCache`` for the original model
(:mod:`lrkv_core.evaluation.hf_quantized_cache`).

KV bytes are measured from the tensors the cache holds (:func:`lrkv_core.cache.cache_nbytes`: packed codes,
scales, zero-points, positions, full-precision windows) next to those of the original model's
``DynamicCache`` for the same tokens, and their ratio is the compression the cache really achieves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import Cache

from lrkv_core.cache import cache_kwargs, cache_nbytes, output_cache
from lrkv_core.model.adapters import get_adapter

Progress = Callable[[int, int], None] | None
CacheFactory = Callable[[], Cache] | None
# the most memory one forward pass's float32 logits (B, T, V) may take: the windows of a batch are scored a
# few rows at a time below it (one row of 256 tokens over SmolLM2's 49,152-token vocabulary is 48 MiB)
LOGITS_BYTES = 64 * 2**20


def _with_cache(cache_factory: CacheFactory) -> dict[str, Any]:
    """Forward kwargs that run through a fresh cache: the model's default one, or ``cache_factory()``."""
    return {"use_cache": True} | ({} if cache_factory is None else cache_kwargs(cache_factory()))


@contextmanager
def _inference(model: nn.Module) -> Iterator[torch.device]:
    """Eval mode + no_grad for the duration; restores the model's training flag; yields its device."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield next(model.parameters()).device
    finally:
        model.train(was_training)


def _check_windows(windows: torch.Tensor, min_len: int = 2) -> tuple[int, int]:
    if windows.dim() != 2 or windows.shape[0] == 0 or windows.shape[1] < min_len:
        raise ValueError(f"windows must be (N >= 1, T >= {min_len}) token ids, got {tuple(windows.shape)}")
    return windows.shape[0], windows.shape[1]


def _rows_per_pass(model: nn.Module, seq_len: int, batch_size: int) -> int:
    """The rows of a batch scored in one forward pass: at most ``batch_size``, and as many as keep the
    pass's logits within :data:`LOGITS_BYTES` (at least one)."""
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size
    return max(1, min(batch_size, LOGITS_BYTES // (seq_len * vocab * 4)))


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL in float32: logits (B, S, V), targets (B, S) → scalar float64."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    return nll.double()


def _result(nll_sum: float, tokens: int, protocol: dict[str, Any]) -> dict[str, Any]:
    nll = nll_sum / tokens
    windows = protocol["windows"]
    return {"nll": nll, "ppl": math.exp(nll), "tokens": tokens, "windows": windows, "protocol": protocol}


def prefill_perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    batch_size: int = 8,
    score_from: int = 1,
    cache_factory: CacheFactory = None,
    progress: Progress = None,
) -> dict[str, Any]:
    """Next-token NLL with each window scored alone in one forward pass, through a fresh cache.

    Parameters
    ----------
    model
        A causal LM returning ``.logits`` (B, T, V).
    windows
        (N, T) token ids.
    score_from
        First target position scored. The default 1 scores all T-1 predictions; ``score_from=P`` scores
        targets P..T-1, the same ones as :func:`decode_perplexity` with ``prefix_len=P``.

    Returns
    -------
    dict
        ``nll`` (mean nats/token), ``ppl`` = exp(nll), ``tokens`` scored, ``windows``, ``protocol``.
    """
    n, t = _check_windows(windows)
    if not 1 <= score_from < t:
        raise ValueError(f"score_from must be in [1, {t - 1}], got {score_from}")
    batch_size = _rows_per_pass(model, t, batch_size)
    total, n_batches = 0.0, math.ceil(n / batch_size)
    with _inference(model) as device:
        for b, start in enumerate(range(0, n, batch_size)):
            ids = windows[start : start + batch_size].to(device)  # (B, T)
            logits = model(ids, **_with_cache(cache_factory)).logits  # (B, T, V)
            total += _token_nll(logits[:, score_from - 1 : -1], ids[:, score_from:]).item()
            if progress is not None:
                progress(b + 1, n_batches)
    tokens = n * (t - score_from)
    protocol = {
        "measure": "prefill_nll",
        "through_cache": True,
        "seq_len": t,
        "windows": n,
        "targets": [score_from, t],
        "tokens_scored": tokens,
    }
    return _result(total, tokens, protocol)


def decode_perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    prefix_len: int,
    batch_size: int = 8,
    cache_factory: CacheFactory = None,
    progress: Progress = None,
) -> dict[str, Any]:
    """Next-token NLL of targets ``prefix_len..T-1`` decoded one token at a time through the cache.

    The first ``prefix_len`` tokens are prefilled with ``use_cache=True``; its last position predicts
    target ``prefix_len``. Each later token is then fed alone with the returned cache
    (teacher forcing), and its logits predict the next target. Without compression this equals
    ``prefill_perplexity(..., score_from=prefix_len)`` up to float rounding.

    Parameters
    ----------
    windows
        (N, T) token ids.
    prefix_len
        Prefill length P, 1 <= P <= T-1; T-P predictions per window are scored.

    The bytes the cache holds once every token is fed (buffers flushed, tokens moved between levels, bases
    appended: the state a decode settles into, not the prefill's) are measured from its tensors as
    :func:`kv_bytes_per_token` measures a prefill's: ``kv_bytes_per_token`` is their sum over the batches per
    token held (``T − 1`` per window).

    Returns
    -------
    dict
        ``nll``, ``ppl``, ``tokens``, ``windows``, ``cache_class``, ``kv_bytes_total``,
        ``kv_bytes_per_token``, ``dense_kv_bytes_per_token`` and ``protocol``.
    """
    n, t = _check_windows(windows)
    if not 1 <= prefix_len < t:
        raise ValueError(f"prefix_len must be in [1, {t - 1}], got {prefix_len}")
    steps = t - prefix_len  # predictions per window
    total, done, cache_class, held = 0.0, 0, None, 0
    n_total = math.ceil(n / batch_size) * steps
    with _inference(model) as device:
        for start in range(0, n, batch_size):
            ids = windows[start : start + batch_size].to(device)  # (B, T)
            out = model(ids[:, :prefix_len], **_with_cache(cache_factory))
            cache = output_cache(out)
            cache_class = type(cache).__name__
            for pos in range(prefix_len, t):  # target position
                if pos > prefix_len:
                    out = model(ids[:, pos - 1 : pos], **cache_kwargs(cache), use_cache=True)
                    cache = output_cache(out)
                total += _token_nll(out.logits[:, -1:], ids[:, pos : pos + 1]).item()  # logits (B, 1, V)
                done += 1
                if progress is not None:
                    progress(done, n_total)
            held += cache_nbytes(cache)  # the T − 1 tokens fed, after the last step
    tokens = n * steps
    protocol = {
        "measure": "decode_nll",
        "seq_len": t,
        "prefix_len": prefix_len,
        "windows": n,
        "targets": [prefix_len, t],
        "tokens_scored": tokens,
        "tokens_held": n * (t - 1),
    }
    dense = dense_kv_bytes(model.config, n, t - 1, next(model.parameters()).dtype)
    kv = {
        "kv_bytes_total": held,
        "kv_bytes_per_token": held / (n * (t - 1)),
        "dense_kv_bytes_per_token": dense / (n * (t - 1)),
    }
    return {**_result(total, tokens, protocol), "cache_class": cache_class, **kv}


def dense_kv_bytes(config: Any, n_rows: int, seq_len: int, dtype: torch.dtype) -> int:
    """Bytes the original model's ``DynamicCache`` holds for ``n_rows × seq_len`` tokens in ``dtype``: a cache
    built from the (original or compressed) model's config, filled with (B, Hkv, T, D) zeros and measured."""
    shape = get_adapter(config).shape(config)
    cache = DynamicCache(config=config)
    states = torch.zeros(n_rows, shape.Hkv, seq_len, shape.D, dtype=dtype)
    for layer in range(shape.L):
        cache.update(states, states, layer)
    return cache_nbytes(cache)


def kv_bytes_per_token(
    model: nn.Module, windows: torch.Tensor, *, n_rows: int = 1, cache_factory: CacheFactory = None
) -> dict[str, Any]:
    """KV-cache bytes per token, measured from the tensors the cache holds after a prefill.

    Runs ``model(windows[:n_rows], use_cache=True)`` and sums every tensor of the returned cache
    (keys, values, latents, positions, packed codes, scales, zero-points, full-precision windows, ...), never
    a formula. Per token means per prefilled token: a sliding-window layer holds at most ``window − 1`` of
    them, so for windowed models the figure falls as ``seq_len`` grows past the window (for the original
    model's cache too). The original model's ``DynamicCache`` for the same tokens in the model's dtype
    (:func:`dense_kv_bytes`) gives the compression ratio the cache achieves.

    Returns
    -------
    dict
        ``kv_bytes_total``, ``kv_bytes_per_token`` (total / (rows · T)), ``dense_kv_bytes_per_token``,
        ``kv_compression_ratio`` (dense / measured), ``cache_class`` and ``protocol``.
    """
    rows = windows[:n_rows]
    n, t = _check_windows(rows, min_len=1)
    with _inference(model) as device:
        cache = output_cache(model(rows.to(device), **_with_cache(cache_factory)))
    total = cache_nbytes(cache)
    dense = dense_kv_bytes(model.config, n, t, next(model.parameters()).dtype)
    return {
        "kv_bytes_total": total,
        "kv_bytes_per_token": total / (n * t),
        "dense_kv_bytes_per_token": dense / (n * t),
        "kv_compression_ratio": dense / total,
        "cache_class": type(cache).__name__,
        "protocol": {
            "measure": "kv_bytes_after_prefill",
            "seq_len": t,
            "windows": n,
            "tokens_prefilled": n * t,
        },
    }


def kl_and_agreement(
    base_model: nn.Module,
    model: nn.Module,
    windows: torch.Tensor,
    *,
    batch_size: int = 8,
    progress: Progress = None,
) -> dict[str, Any]:
    """Mean KL(base ‖ model) per token and top-1 agreement of the next-token distributions.

    Both models score each window in one forward pass through a fresh cache (see the module docstring);
    every one of the T positions of a window gives a next-token distribution. Log-probabilities are taken
    in float32.

    Returns
    -------
    dict
        ``kl`` (mean nats/token), ``top1_agreement`` (fraction of positions with equal argmax),
        ``tokens``, ``windows`` and ``protocol``.
    """
    n, t = _check_windows(windows, min_len=1)
    batch_size = _rows_per_pass(model, t, batch_size)
    kl_sum, agree, n_batches = 0.0, 0, math.ceil(n / batch_size)
    with _inference(base_model) as base_device, _inference(model) as device:
        for b, start in enumerate(range(0, n, batch_size)):
            ids = windows[start : start + batch_size]  # (B, T)
            logp = F.log_softmax(base_model(ids.to(base_device), use_cache=True).logits.float(), dim=-1)
            logq = F.log_softmax(model(ids.to(device), use_cache=True).logits.float(), dim=-1)
            logq = logq.to(logp.device)  # (B, T, V)
            kl = F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)  # (B, T)
            kl_sum += kl.double().sum().item()
            agree += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
            if progress is not None:
                progress(b + 1, n_batches)
    tokens = n * t
    return {
        "kl": kl_sum / tokens,
        "top1_agreement": agree / tokens,
        "tokens": tokens,
        "windows": n,
        "protocol": {
            "measure": "kl_base_vs_model",
            "through_cache": True,
            "seq_len": t,
            "windows": n,
            "tokens_scored": tokens,
        },
    }


@dataclass(frozen=True)
class EvalResult:
    """One model's evaluation (:func:`lrkv_core.conversion.pipeline.evaluate_dir`), its measures read by name.

    Each part is the dict its function above returns, with its ``protocol``: ``prefill`` and ``decode``
    (:func:`prefill_perplexity`, :func:`decode_perplexity`), ``kv`` (:func:`kv_bytes_per_token`), ``kl``
    against the base model when one was given (:func:`kl_and_agreement`), ``zeroshot`` (lm-eval's results)
    and ``long`` (:meth:`lrkv_core.evaluation.longcontext.LongContextResult.to_dict`) when asked for.
    :meth:`to_dict` is the JSON form a run logs (``eval.json``) and a cached task returns; :meth:`from_dict`
    reads it back.
    """

    model: str
    prefill: dict[str, Any]
    decode: dict[str, Any]
    kv: dict[str, Any]
    kl: dict[str, Any] | None = None
    zeroshot: dict[str, Any] | None = None
    long: dict[str, Any] | None = None

    @property
    def prefill_ppl(self) -> float:
        return self.prefill["ppl"]

    @property
    def decode_ppl(self) -> float:
        return self.decode["ppl"]

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv["kv_bytes_per_token"]

    @property
    def decode_kv_bytes_per_token(self) -> float | None:
        """Bytes per token the cache holds at the end of the decode (None in results stored without it)."""
        return self.decode.get("kv_bytes_per_token")

    @property
    def kl_to_base(self) -> float | None:
        """Mean KL(base ‖ model) in nats per token, None without a base."""
        return None if self.kl is None else self.kl["kl"]

    @property
    def top1_agreement(self) -> float | None:
        return None if self.kl is None else self.kl["top1_agreement"]

    def zeroshot_scores(self) -> dict[str, dict[str, float]]:
        """task -> metric -> value of the zero-shot tasks ({} when none ran)."""
        return dict((self.zeroshot or {}).get("results", {}))

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """Perplexities, KV bytes per token and zero-shot scores as flat metric names, each after ``prefix``
        (the KL, named for what it compares, is the caller's)."""
        out = {"prefill_ppl": self.prefill_ppl, "decode_ppl": self.decode_ppl}
        out["kv_bytes_per_token"] = self.kv_bytes_per_token
        if self.decode_kv_bytes_per_token is not None:
            out["decode_kv_bytes_per_token"] = self.decode_kv_bytes_per_token
        for task, scores in self.zeroshot_scores().items():
            out |= {f"zeroshot.{task}.{metric}": value for metric, value in scores.items()}
        return {f"{prefix}{name}": value for name, value in out.items()}

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: every part, the optional ones only when present."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalResult:
        """The result :meth:`to_dict` wrote (a stored task result, an ``eval.json``)."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"not an evaluation result: unknown part(s) {', '.join(sorted(unknown))}")
        return cls(**data)
