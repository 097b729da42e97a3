"""The precision a conversion's passes over the calibration rows compute the decoder stack in.

The statistics, the KL response and the refinement all run the model over the calibration rows, and those
passes are most of a conversion's time. Inside :func:`calibration_precision` ``("bfloat16")`` the decoder
stack of every such pass runs under ``torch.autocast``: its matrix products (the projections, the MLPs,
attention's products) in bfloat16, while the residual stream, the norms, the softmax, the output projection,
the loss and every statistic's sums stay in float32/float64. Where the hardware multiplies bfloat16 natively
(CPUs with AVX-512 BF16 or AMX, GPUs since Ampere) a pass takes less time (0.8 of its float32 time for
SmolLM2 on an AVX-512 BF16 CPU, ``benchmarks/calibration_precision.py``). The values are those of a
bfloat16 forward pass, not the float32 ones: a plan of comparable quality, not the same plan
(docs/long-context.md, calibration time).

Only what the passes compute changes: the model's weights, the decompositions (which read the weights and
the statistics), the fused model and its evaluation are untouched. A model whose own dtype is not float32
(a bfloat16 or float16 recipe) runs as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

import torch
from torch import nn

PRECISIONS = ("float32", "bfloat16")
_LOWER = {"bfloat16": torch.bfloat16}

# the dtype the passes' decoder stack computes in while a calibration_precision block is open (None: the
# model's own); a context variable: a block holds for the code it runs, not for other threads' tasks
_PASS_DTYPE: ContextVar[torch.dtype | None] = ContextVar("lrkv_pass_dtype", default=None)


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else a clear error."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown calibration precision {precision!r}; choose from {list(PRECISIONS)}")
    return precision


@contextmanager
def calibration_precision(precision: str | None) -> Iterator[None]:
    """While open, the calibration passes of this thread run the decoder stack in ``precision``
    (``"float32"`` or None: the model's own dtype)."""
    dtype = _LOWER.get(check_precision(precision)) if precision is not None else None
    token = _PASS_DTYPE.set(dtype)
    try:
        yield
    finally:
        _PASS_DTYPE.reset(token)


def stack_precision(model: nn.Module) -> AbstractContextManager:
    """The context a pass runs ``model``'s decoder stack in: autocast to the open precision for a float32
    model, else nothing."""
    dtype = _PASS_DTYPE.get()
    param = next(model.parameters())
    if dtype is None or param.dtype != torch.float32:
        return nullcontext()
    return torch.autocast(param.device.type, dtype=dtype)


def full_precision(tensor: torch.Tensor) -> AbstractContextManager:
    """Autocast off on ``tensor``'s device: a statistic's sums, taken by a hook inside a pass's forward,
    stay in the dtypes they are written in."""
    return torch.autocast(tensor.device.type, enabled=False)
