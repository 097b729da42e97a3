"""One backward pass per calibration micro-batch, exposing each k/v_proj's input and output gradient.

The gradient statistics (the weight Fisher, the output-gradient covariance) all need, per layer and per
K/V projection, the projection's input ``x`` (B, T, d) and the gradient of the batch's mean next-token loss
at its output ``g`` (B, T, Hkv·D). Only the k/v weights require gradients while collecting, so activations are
kept for those projections only; the model's ``requires_grad`` flags and training mode are restored after.

Labels are the input ids themselves: the HF model shifts them once (Palu's ``labels=input_ids[:, 1:]`` with
``input_ids[:, :-1]`` shifts twice and scores the token after next).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ..adapters import get_adapter

Visit = Callable[[int, str, torch.Tensor, torch.Tensor], None]  # (layer, "k"|"v", x (B,T,d), g (B,T,out))
# (rows (B, T), logits (B, T − 1, V) at positions 0..T−2) -> what the loss scores there: tokens (B, T − 1),
# or probabilities (B, T − 1, V) (the cross-entropy against a distribution, e.g. another model's predictions)
Targets = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sampled_targets(generator: torch.Generator) -> Targets:
    """Targets drawn from the model's own predictions (the true Fisher's gradients), seeded."""

    def sample(_rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.float(), dim=-1).flatten(0, 1).cpu()
        return torch.multinomial(probs, 1, generator=generator).view(logits.shape[:2])

    return sample


def row_seeded_targets(seed: int, first_row: int = 0) -> Targets:
    """Targets drawn from the model's own predictions, each row's from a generator of its own seeded by
    ``(seed, index)``: the index counts the rows in the order the passes see them, from ``first_row``. So
    the draws of a row depend neither on its batch nor on the shard it is collected in (give a shard's
    first index among all rows). One pass only: the function counts the rows it has seen."""
    seen = [first_row]

    def sample(rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.float(), dim=-1).cpu()  # (B, T − 1, V)
        gens = [torch.Generator().manual_seed(row_seed(seed, seen[0] + b)) for b in range(probs.shape[0])]
        drawn = [torch.multinomial(p, 1, generator=gen)[:, 0] for p, gen in zip(probs, gens, strict=True)]
        seen[0] += probs.shape[0]
        return torch.stack(drawn)  # (B, T − 1)

    return sample


def row_seed(seed: int, index: int) -> int:
    """A 64-bit seed for row ``index`` under ``seed`` (numpy's SeedSequence hash of the pair)."""
    state = np.random.SeedSequence([seed % 2**64, index]).generate_state(2, np.uint32)
    return int(state[0]) << 32 | int(state[1])


def kv_gradient_passes(
    model: nn.Module,
    rows: torch.Tensor,
    visit: Visit,
    *,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
    targets: Targets | None = None,
) -> tuple[int, int]:
    """Call ``visit(layer, kind, x, g)`` for every k/v projection of every micro-batch of ``rows`` (N, T).

    ``targets`` picks what the loss scores: by default the rows' own next tokens (the empirical Fisher);
    e.g. tokens sampled from the model's own predictions give the true Fisher's gradients, and the original
    model's probabilities the gradient of the KL to it. The loss is the mean over the batch's B·(T − 1) scored
    positions either way.

    Returns ``(rows seen, micro-batches)``.
    """
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"rows must be (N, T) token ids with T ≥ 2, got {tuple(rows.shape)}")
    if int(rows.min()) < 0:
        raise ValueError(
            "rows hold negative ids (padding/ignore labels?); gradient statistics need unpadded rows"
        )
    adapter = get_adapter(model.config)
    shape = adapter.shape(model.config)
    projs = [
        (i, kind, getattr(adapter.attention(model, i), name))
        for i in range(shape.L)
        for kind, name in (("k", adapter.k_name), ("v", adapter.v_name))
    ]
    parts = {kind: adapter.rows(model.config, kind) for kind in ("k", "v")}  # Phi-3: qkv_proj's k/v rows
    device = next(model.parameters()).device
    seen: list[tuple[int, str, torch.Tensor, torch.Tensor]] = []  # (layer, kind, input x, output) per pass

    def make_hook(i: int, kind: str):
        def hook(_module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            seen.append((i, kind, args[0].detach(), output))

        return hook

    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    handles = []
    n, n_batches = rows.shape[0], 0
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        for i, kind, proj in projs:
            proj.weight.requires_grad_(True)
            handles.append(proj.register_forward_hook(make_hook(i, kind)))
        model.eval()
        with torch.enable_grad():
            for start in range(0, n, batch_size):
                batch = rows[start : start + batch_size].to(device)  # (B, T)
                seen.clear()
                if targets is None:
                    loss = model(input_ids=batch, labels=batch, use_cache=False).loss  # HF shifts the labels
                else:
                    logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
                    wanted = targets(batch, logits.detach()).to(device)
                    wanted = wanted.flatten(0, 1) if wanted.is_floating_point() else wanted.flatten()
                    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), wanted)
                grads = torch.autograd.grad(loss, [out for *_, out in seen], allow_unused=True)
                for (i, kind, x, _), g in zip(seen, grads):
                    if g is not None:
                        visit(i, kind, x, g[..., parts[kind]].detach())
                seen.clear()
                n_batches += 1
                if progress:
                    progress(min(start + batch_size, n), n)
    finally:
        seen.clear()
        for h in handles:
            h.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)
    return n, n_batches
