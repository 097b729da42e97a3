"""``attention_gram``: the Gram of the inputs the attention mixes values from, ``Σ_h Σ_m x̄_{h,m} x̄_{h,m}ᵀ``.

Head h's output at position m reads the values through its attention weights,
``Σ_n p_{h,mn} v_n = W_v x̄_{h,m}`` with ``x̄_{h,m} = Σ_n p_{h,mn} x_n`` the attention-weighted mix of the
v_proj inputs. An error ``δW`` of v_proj reaches that output as ``δW x̄_{h,m}``, not ``δW x_n``: the value
error that matters is weighted by the Gram of the mixed inputs, summed over the layer's query heads (what
``whitened`` with ``values="attention"`` whitens the values with). Per batch row it is ``Xᵀ C X`` with
``C = Σ_h P_hᵀ P_h`` (T × T, in float32), accumulated in float64; C costs H·T³ multiply-adds, so a long
row (more tokens than about the hidden size) takes each head's mixed inputs ``P_h X`` (in float32, H·T²·d)
and adds their Gram in float64 instead, whichever order costs fewer operations (:func:`mixed_input_gram`).
The attention weights come from running the model with eager attention for this pass (other
implementations do not return them); the implementation is restored afterwards. It can observe another
statistic's pass over the same rows (:mod:`lrkv_core.statistics.joint`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..model.adapters import get_adapter
from .base import STATISTICS, Counts, LayerValue
from .joint import JointStatistic, Observer, accumulate_joint
from .precision import full_precision

# the order of mixed_input_gram's sum in the statistic's passes: None takes the cheaper one for the rows'
# length; True or False forces one (benchmarks/attention_gram_order.py compares them)
PER_HEAD: bool | None = None
# queries per block of the per-head order's products (the mixed inputs of a block stop at its last position)
QUERY_BLOCK = 256


def collect_attention_gram(
    model: nn.Module,
    rows: torch.Tensor,
    *,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[torch.Tensor], int]:
    """Gram matrices of the attention-mixed v_proj inputs of every layer (see the module docstring).

    Parameters
    ----------
    rows : (N, T) calibration token ids.

    Returns
    -------
    grams : L tensors (d, d) float64, ``Σ_h Σ_m x̄_{h,m} x̄_{h,m}ᵀ``.
    n_tokens : number of positions m accumulated per layer (each counted once, all heads summed).
    """
    [(grams, counts)] = accumulate_joint(
        [AttentionGram()], model, rows, first_row=0, batch_size=batch_size, progress=progress
    )
    return grams, counts["n_tokens"]


def attention_gram_observer(model: nn.Module, recording: list[bool]) -> Observer:
    """Hooks on every layer's v_proj (its input) and attention (its weights) adding ``Xᵀ C X`` while
    ``recording[0]``; the pass must run eager attention (``attention_weights``)."""
    adapter = get_adapter(model.config)
    shape = adapter.shape(model.config)
    device = next(model.parameters()).device
    grams = [torch.zeros(shape.d, shape.d, dtype=torch.float64, device=device) for _ in range(shape.L)]
    counts = [0] * shape.L
    inputs: dict[int, torch.Tensor] = {}

    def keep_input(i: int):
        def hook(_module: nn.Module, args: tuple) -> None:
            if recording[0]:
                inputs[i] = args[0].detach()

        return hook

    def accumulate(i: int):
        def hook(_module: nn.Module, _args: tuple, out: Any) -> None:
            if not recording[0]:
                return
            weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if weights is None:
                raise RuntimeError(
                    f"layer {i}'s attention returned no attention weights under eager attention"
                )
            with torch.no_grad(), full_precision(weights):
                x = inputs.pop(i)  # (B, T, d)
                grams[i] += mixed_input_gram(weights.detach(), x.detach(), per_head=PER_HEAD)
            counts[i] += x.shape[0] * x.shape[1]

        return hook

    hooks = []
    for i in range(shape.L):
        attn = adapter.attention(model, i)
        hooks.append(getattr(attn, adapter.v_name).register_forward_pre_hook(keep_input(i)))
        hooks.append(attn.register_forward_hook(accumulate(i)))
    result = lambda: ([g.cpu() for g in grams], {"n_tokens": counts[0]})  # noqa: E731
    return Observer(result, hooks, attention_weights=True)


def per_head_is_cheaper(heads: int, tokens: int, hidden: int) -> bool:
    """Whether :func:`mixed_input_gram` per head costs fewer operations than through ``C`` for one row of
    ``tokens`` (a float64 multiply-add counted as two float32 ones)."""
    H, T, d = heads, tokens, hidden
    return H * T * d * (T + 2 * d) < H * T**3 + 2 * (d * T * T + d * d * T)


def mixed_input_gram(weights: torch.Tensor, x: torch.Tensor, *, per_head: bool | None = None) -> torch.Tensor:
    """``Σ_b Σ_h (P_h X)ᵀ (P_h X)`` (d, d) float64 of one batch's attention weights ``P`` (B, H, T, T) and
    inputs ``X`` (B, T, d), the products of the weights in float32 (no float64 copy of them).

    Two orders of the same sum: ``Xᵀ (Σ_h P_hᵀ P_h) X`` builds the T × T matrix ``C`` (H·T³ multiply-adds,
    then d·T² + d²·T in float64), cheap for short rows; per head, ``Y_h = P_h X`` (H·T²·d) and ``Y_hᵀ Y_h``
    (H·d²·T in float64), cheap once T passes the hidden size, and holding one head's ``Y_h`` at a time instead
    of ``C``. ``per_head=None`` takes the one of fewer operations (:func:`per_head_is_cheaper`)."""
    B, H, T, _ = weights.shape
    d = x.shape[-1]
    if per_head is None:
        per_head = per_head_is_cheaper(H, T, d)
    p = weights.float()
    if not per_head:
        mix = torch.einsum("bhmt,bhms->bts", p, p).double()  # C = Σ_h P_hᵀ P_h, (B, T, T)
        x64 = x.to(torch.float64)
        return torch.einsum("btd,bts,bse->de", x64, mix, x64)
    x32 = x.float()
    # a block of queries mixes only the inputs up to its last position where the weights after it are 0 (a
    # causal mask): about half of P_h X's products skipped, every nonzero weight still read
    blocks = [(a, min(a + QUERY_BLOCK, T)) for a in range(0, T, QUERY_BLOCK)]
    seen = [b if not p[:, :, a:b, b:].any() else T for a, b in blocks]
    gram = torch.zeros(d, d, dtype=torch.float64, device=x.device)
    mixed = torch.empty(B, T, d, dtype=torch.float32, device=x.device)
    for h in range(H):
        for (a, b), upto in zip(blocks, seen, strict=True):
            torch.matmul(p[:, h, a:b, :upto], x32[:, :upto], out=mixed[:, a:b])
        rows = mixed.reshape(B * T, d).double()  # x̄_{h,m} of every row
        gram += rows.T @ rows
    return gram


@STATISTICS.register
@dataclass(frozen=True)
class AttentionGram(JointStatistic):
    """Σ x̄ x̄ᵀ of the attention-mixed v_proj inputs (float64): what values='attention' whitens with"""

    name: ClassVar[str] = "attention_gram"
    joint: ClassVar[str | None] = "forward"

    def observer(self, model: nn.Module, *, first_row: int, recording: list[bool]) -> Observer:
        return attention_gram_observer(model, recording)

    def finish(self, sums: list[LayerValue], counts: Counts) -> tuple[list[LayerValue], dict[str, Any]]:
        return sums, {"n_tokens": counts["n_tokens"]}  # sums: they add up across shards as they are
