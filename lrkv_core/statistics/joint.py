"""Several calibration statistics collected in one pass over their rows.

The Gram, the attention Gram and the output Fisher all run the model over every calibration row: the first
two read what a forward pass computes (each layer's k/v_proj input, the attention weights), the third one
backward pass more. Collected on their own that is three forward passes and one backward pass per row;
together (:func:`collect_joint`) one forward and one backward: the forward statistics observe the forward
pass of the gradient pass (through hooks that count only its recording forward, not a checkpointed layer's
recomputation), and every gradient statistic is one loss of a shared gradient pass
(:func:`lrkv_core.statistics.gradients.shared_gradient_passes`).

A statistic that can take part says how (``Statistic.joint``: ``"forward"`` or ``"gradient"``) and gives its
part of a pass (``Statistic.observer``); its own ``collect`` is a joint pass of itself alone, so one
implementation serves both and a statistic's values do not depend on whether it was collected alone, up to
the rounding of the attention: a pass with a statistic that reads the attention weights runs the model with
eager attention (the other implementations do not return them), whose float rounding differs from the fused
kernels' by about 1e-7, which can move a target drawn from the model's own predictions at a boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .base import Counts, LayerValue, Progress, Statistic, add_sums, forward_rows
from .gradients import Targets, Visit, shared_gradient_passes

JOINT = ("forward", "gradient")


@dataclass
class Observer:
    """One statistic's part of a pass: the forward hooks it installed (``hooks``, removed after the pass),
    for a gradient statistic the ``loss`` its backward pass scores (``(visit, targets)`` of
    :func:`~lrkv_core.statistics.gradients.shared_gradient_passes`), whether the pass must return attention
    weights (eager attention), and ``result()``: its sums and counts once the pass is over."""

    result: Callable[[], tuple[list[LayerValue], Counts]]
    hooks: list = field(default_factory=list)
    loss: tuple[Visit, Targets | None] | None = None
    attention_weights: bool = False


@contextmanager
def attention_implementation(model: nn.Module, name: str | None) -> Iterator[None]:
    """While open, ``model`` runs with attention implementation ``name`` (None: as it is); restored after."""
    if name is None:
        yield
        return
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def accumulate_joint(
    stats: Sequence[Statistic],
    model: nn.Module,
    rows: torch.Tensor,
    *,
    first_row: int,
    batch_size: int,
    progress: Progress,
) -> list[tuple[list[LayerValue], Counts]]:
    """Each statistic's sums and counts over ``rows`` (N, T), from one pass: a gradient pass when any of
    ``stats`` is a gradient statistic, else a forward pass of the decoder stack. ``first_row``: the index of
    ``rows[0]`` among the statistics' rows (it seeds sampled targets)."""
    if not stats:
        raise ValueError("a joint pass needs at least one statistic")
    for s in stats:
        if s.joint not in JOINT:
            raise ValueError(f"statistic {s.name} cannot share a pass: it collects in passes of its own")
    names = [s.name for s in stats]
    if len(set(names)) != len(names):
        raise ValueError(f"a joint pass collects each statistic once, got {names}")
    recording = [True]
    observers: list[Observer] = []
    try:
        for s in stats:
            observers.append(s.observer(model, first_row=first_row, recording=recording))
        losses = [o.loss for o in observers if o.loss is not None]
        eager = "eager" if any(o.attention_weights for o in observers) else None
        with attention_implementation(model, eager):
            if losses:
                shared_gradient_passes(
                    model, rows, losses, batch_size=batch_size, progress=progress, recording=recording
                )
            else:
                with torch.no_grad():
                    forward_rows(model, rows, [], batch_size=batch_size, progress=progress)
    finally:  # the hooks of every observer made, whatever the pass did
        for o in observers:
            for h in o.hooks:
                h.remove()
    return [o.result() for o in observers]


@dataclass(frozen=True)
class JointStatistic(Statistic):
    """A statistic that can share a pass (``joint`` set, ``observer`` given): alone, it is collected by a
    joint pass of itself (:func:`accumulate_joint`)."""

    def accumulate(
        self,
        model: nn.Module,
        rows: torch.Tensor,
        *,
        first_row: int,
        batch_size: int,
        progress: Progress,
    ) -> tuple[list[LayerValue], Counts]:
        [part] = accumulate_joint(
            [self], model, rows, first_row=first_row, batch_size=batch_size, progress=progress
        )
        return part


def collect_joint(
    stats: Sequence[Statistic],
    model: nn.Module,
    rows: torch.Tensor,
    *,
    batch_size: int = 8,
    progress: Progress = None,
) -> list[tuple[list[LayerValue], dict]]:
    """Each statistic's ``collect`` (values, metadata), in the order of ``stats``, from one pass over their
    rows (the module doc).

    Statistics that read different numbers of rows (``n_samples``) share the rows they have in common: the
    rows are cut where one statistic's rows end, and each stretch is one pass of the statistics that read it
    (a gradient pass where a gradient statistic reads it, else a forward pass), its sums added to theirs.
    So an output Fisher on the first 128 of 256 rows costs a gradient pass over 128 rows and a forward pass
    over the other 128, with the Gram reading both."""
    if not stats:
        raise ValueError("a joint pass needs at least one statistic")
    used = [s.rows(rows).shape[0] for s in stats]  # a clear error for a statistic asking too many rows
    total = max(used)
    sums: list[tuple[list[LayerValue], Counts] | None] = [None] * len(stats)
    bounds = sorted({0, *used})
    for start, stop in zip(bounds, bounds[1:]):
        reading = [i for i, n in enumerate(used) if n > start]
        part = accumulate_joint(
            [stats[i] for i in reading],
            model,
            rows[start:stop],
            first_row=start,
            batch_size=batch_size,
            progress=_offset(progress, start, total),
        )
        for i, (values, counts) in zip(reading, part, strict=True):
            sums[i] = (values, counts) if sums[i] is None else add_sums(sums[i], (values, counts))
    return [s.finish(*r) for s, r in zip(stats, sums, strict=True)]


def _offset(progress: Progress, start: int, total: int) -> Progress:
    """``progress`` for a stretch of rows starting at ``start``, reported as rows done of ``total``."""
    if progress is None:
        return None
    return lambda done, _n: progress(start + done, total)
