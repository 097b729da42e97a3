"""One backward pass per calibration micro-batch, exposing each k/v_proj's input and output gradient.

The gradient statistics (the weight Fisher, the output-gradient covariance) all need, per layer and per
K/V projection, the projection's input ``x`` (B, T, d) and the gradient of the batch's mean next-token loss
at its output ``g`` (B, T, Hkv·D). Only the k/v weights require gradients while collecting, so activations are
kept for those projections only; the model's ``requires_grad`` flags and training mode are restored after.

Labels are the input ids themselves, shifted once: position t scores token t + 1 (Palu's
``labels=input_ids[:, 1:]`` with ``input_ids[:, :-1]`` shifts twice and scores the token after next).

Memory: a pass runs the decoder stack, then the output projection and the loss over :data:`LOSS_CHUNK`
positions at a time (their gradient at the last hidden state accumulates), then the backward pass from there
to the first layer's k/v outputs, visiting each projection as the pass reaches its output's gradient and
dropping its input and gradient there (from the last layer down); a micro-batch of more than
:data:`CHECKPOINT_TOKENS` tokens recomputes each layer's activations during the backward pass instead of
keeping them, and its large temporaries are mapped memory returned to the system when freed
(:func:`lrkv_core.system.memory.mapped_allocations`). So one pass over a long row holds the model, each
layer's input and one layer's activations, not every layer's activations and the whole row's full-vocabulary
logits (``benchmarks/pass_memory.py`` measures it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..model.adapters import get_adapter
from ..system.memory import mapped_allocations
from .precision import stack_precision

Visit = Callable[[int, str, torch.Tensor, torch.Tensor], None]  # (layer, "k"|"v", x (B,T,d), g (B,T,out))
# Given one micro-batch's rows (B, T), a function called for consecutive chunks of its scored positions, in
# order: (logits (B, c, V) at positions start..start + c − 1 of 0..T − 2, start) -> what the loss scores
# there: tokens (B, c), or probabilities (B, c, V) (the cross-entropy against a distribution, e.g. another
# model's predictions)
Draw = Callable[[torch.Tensor, int], torch.Tensor]
Targets = Callable[[torch.Tensor], Draw]
# positions per chunk of the output projection and the loss: the full-vocabulary logits of at most this many
# positions per row exist at once (the same loss and gradients as all positions at once)
LOSS_CHUNK = 256
# a micro-batch of more tokens keeps only each decoder layer's input through the forward pass and recomputes
# the layer in the backward pass (activation checkpointing): one long row costs about one layer's activations
CHECKPOINT_TOKENS = 1024
# such a micro-batch's large temporaries are mappings of their own, returned to the system when freed
# (lrkv_core.system.memory.mapped_allocations): no holes between the blocks the pass keeps; its pages cost
# faults
MAP_LONG_ROWS = True


def row_seeded_targets(seed: int, first_row: int = 0) -> Targets:
    """Targets drawn from the model's own predictions, each row's from a generator of its own seeded by
    ``(seed, index)``: the index counts the rows in the order the passes see them, from ``first_row``. So
    the draws of a row depend neither on its batch nor on the shard it is collected in (give a shard's
    first index among all rows), nor on the chunks its positions are scored in. One pass only: the function
    counts the rows it has seen."""
    seen = [first_row]

    def for_batch(rows: torch.Tensor) -> Draw:
        gens = [torch.Generator().manual_seed(row_seed(seed, seen[0] + b)) for b in range(rows.shape[0])]
        seen[0] += rows.shape[0]

        def draw(logits: torch.Tensor, _start: int) -> torch.Tensor:
            return torch.stack([inverse_cdf_draw(row, gen) for row, gen in zip(logits, gens, strict=True)])

        return draw

    return for_batch


def inverse_cdf_draw(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per position (c,) drawn from ``softmax(logits)`` (c, V): one uniform number per position from
    ``generator`` (a CPU generator, consumed position by position, so chunks of a row draw what the whole row
    would), placed in the running sum of the probabilities on the logits' device. A token of probability 0 is
    never drawn. The same tokens on every device, but for a uniform number within rounding of a boundary.
    (Eighteen times faster than :func:`torch.multinomial` at SmolLM2's 49,152 tokens on the CPU, which draws
    an exponential number per token: ``benchmarks/gradient_pass_time.py``.)"""
    cdf = torch.softmax(logits.float(), dim=-1).cumsum(-1)  # (c, V)
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=cdf.dtype).to(cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max(cdf.shape[-1] - 1)


def given_probabilities(probs: torch.Tensor) -> Targets:
    """Targets that are given distributions ``probs`` (B, T − 1, V) over one micro-batch's next tokens."""
    return lambda _rows: lambda logits, start: probs[:, start : start + logits.shape[1]]


def last_hidden(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The decoder stack's output (B, T, d) for ``batch`` (B, T), before the output projection (in the
    calibration precision, :mod:`lrkv_core.statistics.precision`)."""
    with stack_precision(model):
        return get_adapter(model.config).base_model(model)(input_ids=batch, use_cache=False)[0]


def next_token_log_probs(model: nn.Module, hidden: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, log-probabilities (B, c, V))`` of the next token at positions start … start + c − 1,
    from the last hidden states ``hidden`` (B, T, d), over positions 0 … T − 2 in chunks of at most
    :data:`LOSS_CHUNK`: the model's own logits (final soft-capping included), never the whole row's."""
    head = _logits_of(model)
    T = hidden.shape[1]
    for start in range(0, T - 1, LOSS_CHUNK):
        stop = min(start + LOSS_CHUNK, T - 1)
        yield start, torch.log_softmax(head(hidden[:, start:stop]), dim=-1)


def _logits_of(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Hidden states (…, d) → the model's logits (…, V) in float32 (float64 for a float64 model): the output
    projection, then the final soft-capping where the model has one (Gemma)."""
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = head(hidden)
        out = out if out.dtype == torch.float64 else out.float()
        return torch.tanh(out / softcap) * softcap if softcap else out

    return logits


def row_seed(seed: int, index: int) -> int:
    """A 64-bit seed for row ``index`` under ``seed`` (numpy's SeedSequence hash of the pair)."""
    state = np.random.SeedSequence([seed % 2**64, index]).generate_state(2, np.uint32)
    return int(state[0]) << 32 | int(state[1])


def _checkpoint_call(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@contextmanager
def checkpointed(layers: nn.ModuleList, on: bool) -> Iterator[None]:
    """While open (and ``on``), each decoder layer's forward keeps only its inputs for the backward pass and
    recomputes the rest there (:func:`torch.utils.checkpoint.checkpoint`, non-reentrant)."""
    if not on:
        yield
        return
    previous = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = functools.partial(_checkpoint_call, layer.forward)
    try:
        yield
    finally:
        for layer, forward in zip(layers, previous, strict=True):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


def kv_gradient_passes(
    model: nn.Module,
    rows: torch.Tensor,
    visit: Visit,
    *,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
    targets: Targets | None = None,
) -> tuple[int, int]:
    """Call ``visit(layer, kind, x, g)`` for every k/v projection of every micro-batch of ``rows`` (N, T),
    in the backward pass's order (last layer first; no gradient is being recorded while it runs).

    ``targets`` picks what the loss scores: by default the rows' own next tokens (the empirical Fisher);
    e.g. tokens sampled from the model's own predictions give the true Fisher's gradients, and the original
    model's probabilities the gradient of the KL to it. The loss is the mean over the batch's B·(T − 1) scored
    positions either way.

    Returns ``(rows seen, micro-batches)``.
    """
    return shared_gradient_passes(model, rows, [(visit, targets)], batch_size=batch_size, progress=progress)


def shared_gradient_passes(
    model: nn.Module,
    rows: torch.Tensor,
    losses: Sequence[tuple[Visit, Targets | None]],
    *,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
    recording: list[bool] | None = None,
) -> tuple[int, int]:
    """:func:`kv_gradient_passes` for several losses of the same model on the same rows, one forward pass per
    micro-batch: each ``(visit, targets)`` of ``losses`` gets its own backward pass, in order, through the
    forward's graph (kept until the last). The same visits, bit for bit, as one :func:`kv_gradient_passes`
    per loss (the same forward, the same loss gradients), at one forward pass less per extra loss; each
    layer's input is kept until the last backward pass reaches it.

    ``recording``: a flag the pass sets (``recording[0]``) while its forward pass runs, not while a
    checkpointed layer is recomputed in the backward pass: forward hooks of other statistics that observe
    the same pass (:mod:`lrkv_core.statistics.joint`) count only what it marks."""
    if not losses:
        raise ValueError("shared_gradient_passes needs at least one (visit, targets) loss")
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
    base, logits_of = adapter.base_model(model), _logits_of(model)
    device = next(model.parameters()).device
    # a pass keeps each projection's input until the (last) backward pass reaches its output's gradient,
    # visits the pair there and drops them: no output, input or gradient of a later layer waits for the
    # earlier layers
    inputs: dict[tuple[int, str], torch.Tensor] = {}
    first: list[torch.Tensor] = []  # the first layer's outputs: what the backward pass is asked to reach
    first_layer = [-1]
    # the forward pass records; a checkpointed layer's recomputation does not
    recording = [False] if recording is None else recording
    recording[0] = False
    current = [0]  # the loss whose backward pass is running

    def reached(i: int, kind: str, g: torch.Tensor) -> None:
        last = current[0] == len(losses) - 1
        x = inputs.pop((i, kind)) if last else inputs[(i, kind)]
        losses[current[0]][0](i, kind, x, g[..., parts[kind]].detach())

    def make_hook(i: int, kind: str):
        def hook(_module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if recording[0]:
                inputs[(i, kind)] = args[0].detach()
                output.register_hook(functools.partial(reached, i, kind))
                if not first or i == first_layer[0]:
                    first_layer[0] = i
                    first.append(output)

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
                recording[0] = True
                long = batch.numel() > CHECKPOINT_TOKENS
                with checkpointed(adapter.layers(model), long), mapped_allocations(long and MAP_LONG_ROWS):
                    with stack_precision(model):  # the loss and the backward call outside autocast
                        hidden = base(input_ids=batch, use_cache=False)[0]  # (B, T, d)
                    recording[0] = False
                    grads = loss_gradients(hidden, batch, logits_of, [targets for _, targets in losses])
                    for j, grad in enumerate(grads):
                        current[0] = j
                        # every projection's output lies on the way from the loss to the first layer's, so
                        # its hook sees its gradient on the way (the gradients returned here are not needed)
                        torch.autograd.grad(
                            hidden,
                            first,
                            grad_outputs=grad,
                            allow_unused=True,
                            retain_graph=j < len(losses) - 1,
                        )
                        del grad
                del hidden
                first.clear()
                inputs.clear()  # an output the loss does not depend on: nothing to visit
                n_batches += 1
                if progress:
                    progress(min(start + batch_size, n), n)
    finally:
        inputs.clear()
        first.clear()
        for h in handles:
            h.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)
    return n, n_batches


def loss_gradients(
    hidden: torch.Tensor,
    batch: torch.Tensor,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    targets: Sequence[Targets | None],
) -> list[torch.Tensor]:
    """For each of ``targets``, ∂(the batch's mean next-token loss)/∂hidden (B, T, d): the cross-entropy of
    the logits against the rows' own next tokens (``None``), drawn tokens or given distributions. The output
    projection runs once per chunk of :data:`LOSS_CHUNK` positions for every loss, and the loss's gradient at
    the logits is written down, not differentiated: ``(softmax(logits) · Σ target − target) / (B·(T − 1))``
    for a target distribution (a token's is one-hot), which is what autograd through
    ``cross_entropy(…, reduction="sum") / (B·(T − 1))`` gives, up to rounding, without its log-softmax, its
    backward and its zero-filled buffers over the vocabulary. The last position scores nothing (its gradient
    is 0). Each loss's draws are made chunk by chunk in order, as a pass of its own makes them."""
    B, T = batch.shape
    draws = [t(batch) if t is not None else None for t in targets]
    grads = [torch.zeros_like(hidden) for _ in targets]
    scored = B * (T - 1)
    for start in range(0, T - 1, LOSS_CHUNK):
        stop = min(start + LOSS_CHUNK, T - 1)
        part = hidden[:, start:stop].detach().requires_grad_(True)
        logits = logits_of(part)  # (B, c, V) float32 (float64 for a float64 model)
        probs = torch.softmax(logits.detach(), dim=-1)
        for j, draw in enumerate(draws):
            last = j == len(draws) - 1
            if draw is None:  # the rows' own next tokens
                wanted = batch[:, start + 1 : stop + 1].to(logits.device)
            else:
                wanted = draw(logits.detach(), start).to(logits.device)
            at_logits = probs if last else probs.clone()
            if wanted.is_floating_point():  # distributions (B, c, V)
                at_logits.mul_(wanted.sum(-1, keepdim=True)).sub_(wanted.to(at_logits.dtype))
            else:  # tokens (B, c)
                at_logits.scatter_add_(-1, wanted[..., None], at_logits.new_full((*wanted.shape, 1), -1.0))
            at_logits.div_(scored)
            (grads[j][:, start:stop],) = torch.autograd.grad(logits, part, at_logits, retain_graph=not last)
            del at_logits
    return grads
