"""Inputs shared by the exactness tests: random ids, left-padded prompts, greedy generation."""

from __future__ import annotations

import torch

from lrkv_core.cache import cache_kwargs

PAD = 0


def ids_for(batch: int, length: int, seed: int = 7, vocab: int = 61) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded(lengths: tuple[int, ...], seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths, left-padded: ``(input_ids, attention_mask)``, both (B, max length)."""
    width = max(lengths)
    ids = ids_for(len(lengths), width, seed)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return ids.masked_fill(mask == 0, PAD), mask


def positions_for(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as generate() derives them from a left-padded mask (pads get 1; they are masked)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def greedy(model, ids: torch.Tensor, mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    if mask is None:
        mask = torch.ones_like(ids)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": PAD, "eos_token_id": None, **kwargs}
    return model.generate(ids, attention_mask=mask, **kwargs)


def decode_left_padded(model, ids: torch.Tensor, mask: torch.Tensor, prefix: int = 6):
    """One full forward and a prefill of ``prefix`` tokens then one token at a time through the cache.

    Returns ``(full logits, step-by-step logits, final cache)``, both logits (B, T, V).
    """
    pos = positions_for(mask)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=pos).logits
        out = model(
            ids[:, :prefix], attention_mask=mask[:, :prefix], position_ids=pos[:, :prefix], use_cache=True
        )
        steps = [out.logits]
        for t in range(prefix, ids.shape[1]):
            kw = dict(attention_mask=mask[:, : t + 1], position_ids=pos[:, t : t + 1], use_cache=True)
            out = model(ids[:, t : t + 1], **cache_kwargs(out.past_key_values), **kw)
            steps.append(out.logits)
    return full, torch.cat(steps, 1), out.past_key_values


def full_rank_kl_bound(base_logits: torch.Tensor, max_logit_diff: float) -> float:
    """What float32 rounding allows KL(base ‖ model) per token to be when the models agree up to rounding.

    With model logits ``l + δ`` (|δ| ≤ ``max_logit_diff``: the two models' rounding differences), the
    true KL is at most ``(max δ − min δ)² / 8 ≤ max|δ|² / 2`` (Hoeffding's lemma). Computing
    ``Σ p (log p − log q)`` from two float32 log-softmaxes adds at most ``2u (|logit| + |logsumexp|)``
    per term (u = 2⁻²⁴, the unit roundoff; p sums to 1), doubled here for the log-sum-exp's own rounding.
    Measured on the logits the evaluation saw, it holds under any thread count or load (which only change
    δ), while a real difference (KL ~1e-2 at ratio 0.5) exceeds it by orders of magnitude.
    """
    u = torch.finfo(torch.float32).eps / 2
    lse = torch.logsumexp(base_logits.double(), dim=-1).abs().max().item()
    return max_logit_diff**2 / 2 + 4 * u * (base_logits.abs().max().item() + lse)


def statistic_tensors(values) -> list[torch.Tensor]:
    """Every tensor of a statistic's per-layer values (a tensor or a dict of tensors per layer), in order."""
    return [v for value in values for v in ([value] if isinstance(value, torch.Tensor) else value.values())]


def max_relative_gap(got, want) -> float:
    """The largest difference of two statistics' values, relative to each tensor's largest entry."""
    a, b = statistic_tensors(got), statistic_tensors(want)
    assert len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-300)) for x, y in zip(a, b))
