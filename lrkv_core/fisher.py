"""Empirical diagonal Fisher information of k_proj and v_proj, and what the rank allocators derive from it.

``F = (1/S) Σ_s (∂ℓ_s/∂W)²`` per element of ``W_k`` and ``W_v`` (same shape as the weight), over S samples
of the calibration rows, where ``ℓ_s`` is the mean next-token loss of the sample. A sample is one row
(``per_row=True``, the textbook empirical Fisher: one squared gradient per sequence) or one micro-batch
(``per_row=False``, what Palu accumulates: the squared gradient of each batch's mean loss, which folds
cross-row terms in and depends on the batch size). With ``batch_size=1`` both are the same.

Labels are the input ids themselves: the HF model shifts them internally, so the loss of row ``x`` scores
``x[t+1]`` given ``x[..t]``. Palu passes ``input_ids[:, :-1]`` with labels ``input_ids[:, 1:]`` and the model
shifts again, scoring ``x[t+2]`` given ``x[..t]``: a different (and wrong) Fisher.

Per-row gradients come from one backward pass per micro-batch: with the k/v_proj input ``x`` (B, T, d) and
the loss gradient at its output ``g`` (B, T, out), row b's weight gradient is ``g_bᵀ x_b`` (out, d). Only the
k/v weights require gradients while collecting, so activations are kept for those projections only; the
squares are accumulated in float32 or float64 whatever the model's dtype.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .adapters import get_adapter
from .allocators import ErrorCurves, Sensitivity
from .decompose import KINDS, LayerFactors
from .linalg import GroupFactors

# fisher[layer][kind] -> (Hkv·D, d), same shape as the projection weight
FisherInfo = list[dict[str, torch.Tensor]]


def collect_fisher(
    model: nn.Module,
    rows: torch.Tensor,
    *,
    batch_size: int = 8,
    per_row: bool = True,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[FisherInfo, int]:
    """Diagonal empirical Fisher of every layer's k_proj and v_proj weights.

    Parameters
    ----------
    rows : (N, T) calibration token ids (no padding: every row has T − 1 scored tokens).
    batch_size : rows per forward/backward pass.
    per_row : one squared gradient per row (default) or per micro-batch (Palu).
    dtype : accumulator dtype, float32 or float64.

    Returns
    -------
    fisher : ``fisher[layer]["k"|"v"]`` (Hkv·D, d) in ``dtype``, the mean squared gradient per sample.
    n_samples : S, the number of squared gradients averaged (N per row, ⌈N / batch_size⌉ per batch).
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"accumulate the Fisher in float32 or float64, not {dtype}")
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"rows must be (N, T) token ids with T ≥ 2, got {tuple(rows.shape)}")
    if int(rows.min()) < 0:
        raise ValueError("rows hold negative ids (padding/ignore labels?); the Fisher needs unpadded rows")
    adapter = get_adapter(model.config)
    shape = adapter.shape(model.config)
    projs = [
        (i, kind, getattr(adapter.attention(model, i), name))
        for i in range(shape.L)
        for kind, name in (("k", adapter.k_name), ("v", adapter.v_name))
    ]
    device = next(model.parameters()).device
    fisher = [
        {kind: torch.zeros(shape.kv_width, shape.d, dtype=dtype, device=device) for kind in KINDS}
        for _ in range(shape.L)
    ]
    seen: list[tuple[int, str, torch.Tensor, torch.Tensor]] = []  # (layer, kind, input x, output) per pass

    def make_hook(i: int, kind: str):
        def hook(_module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            seen.append((i, kind, args[0].detach(), output))

        return hook

    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    handles = []
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        for i, kind, proj in projs:
            proj.weight.requires_grad_(True)
            handles.append(proj.register_forward_hook(make_hook(i, kind)))
        model.eval()
        n, n_samples = rows.shape[0], 0
        with torch.enable_grad():
            for start in range(0, n, batch_size):
                batch = rows[start : start + batch_size].to(device)  # (B, T)
                seen.clear()
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss  # HF shifts the labels
                grads = torch.autograd.grad(loss, [out for *_, out in seen], allow_unused=True)
                for (i, kind, x, _), g in zip(seen, grads):
                    if g is not None:
                        _accumulate(fisher[i][kind], x, g, per_row)
                seen.clear()
                n_samples += batch.shape[0] if per_row else 1
                if progress:
                    progress(min(start + batch_size, n), n)
    finally:
        seen.clear()
        for h in handles:
            h.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)
    for layer in fisher:
        for kind in KINDS:
            layer[kind] = (layer[kind] / n_samples).cpu()
    return fisher, n_samples


def _accumulate(acc: torch.Tensor, x: torch.Tensor, g: torch.Tensor, per_row: bool) -> None:
    """Add squared weight gradients: x (B, T, d) the projection input, g (B, T, out) ∂(batch loss)/∂output."""
    x, g = x.to(acc.dtype), g.to(acc.dtype)
    if not per_row:
        grad = g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (out, d)
        acc.add_(grad.square())
        return
    B = x.shape[0]
    for b in range(B):  # the batch loss is the mean over B equally long rows: ∂ℓ_b = B · (row b's share)
        grad = (g[b].T @ x[b]) * B  # (out, d)
        acc.add_(grad.square())


def group_sensitivity(fisher: FisherInfo, group_width: int) -> Sensitivity:
    """``sensitivity[layer][kind][g]``: the Fisher summed over group g's rows (s·D consecutive rows)."""
    out: Sensitivity = []
    for layer in fisher:
        entry = {}
        for kind in KINDS:
            f = layer[kind].to(torch.float64)
            if f.shape[0] % group_width:
                raise ValueError(
                    f"Fisher has {f.shape[0]} rows, not a multiple of the group width {group_width}"
                )
            entry[kind] = [float(v) for v in f.reshape(-1, group_width * f.shape[1]).sum(dim=1)]
        out.append(entry)
    return out


@torch.no_grad()
def weighted_error_curve(
    factors: GroupFactors, fisher: torch.Tensor, *, rank_multiple: int = 1
) -> torch.Tensor:
    """Fisher-weighted truncation error ``E(r) = Σ F ⊙ (W − B_r A_r)²`` of one group, for r on a grid.

    ``W = B A`` is the full-rank product of the factors (the original weight up to float64 rounding), so
    ``W − B_r A_r = B_{r:} A_{r:}`` and E(max rank) = 0. E need not decrease with r: F weights elements, not
    directions.

    Parameters
    ----------
    factors : the group's full-spectrum factors, ``up`` (s·D, m), ``down`` (m, d).
    fisher : (s·D, d) the group's rows of the per-element Fisher.
    rank_multiple : E is computed at 0, the multiples of this, and m; other entries are NaN.

    Returns
    -------
    (m + 1,) float64, ``E[r]``.
    """
    up, down = factors.up.to(torch.float64), factors.down.to(torch.float64)
    weight = fisher.to(device=up.device, dtype=torch.float64)
    m = factors.max_rank
    if weight.shape != (up.shape[0], down.shape[1]):
        raise ValueError(
            f"Fisher block {tuple(weight.shape)} does not match the group {(up.shape[0], down.shape[1])}"
        )
    curve = torch.full((m + 1,), float("nan"), dtype=torch.float64)
    curve[m] = 0.0
    residual = torch.zeros_like(weight)  # B_{r:} A_{r:}, grown from the tail
    upper = m
    for r in sorted({*range(0, m, rank_multiple)}, reverse=True):
        residual += up[:, r:upper] @ down[r:upper]  # (s·D, d)
        curve[r] = float((weight * residual.square()).sum())
        upper = r
    return curve


def fisher_error_curves(
    factors: list[LayerFactors], fisher: FisherInfo, *, rank_multiple: int = 1
) -> ErrorCurves:
    """``error_curves[layer][kind][g]`` for ``fisher-greedy``: :func:`weighted_error_curve` of every group.

    ``rank_multiple`` must divide the rank multiple the plan uses (1 serves every plan).
    """
    curves: ErrorCurves = []
    for lf in factors:
        entry = {}
        for kind in KINDS:
            rows = 0
            entry[kind] = []
            for gf in lf.groups[kind]:
                width = gf.up.shape[0]
                block = fisher[lf.layer][kind][rows : rows + width]
                entry[kind].append(weighted_error_curve(gf, block, rank_multiple=rank_multiple))
                rows += width
        curves.append(entry)
    return curves


def save_fisher(fisher: FisherInfo, n_samples: int, path: str | Path, *, per_row: bool) -> None:
    """Write the per-element Fisher as safetensors (``fisher.{layer}.{k|v}``) with its sample count."""
    tensors = {
        f"fisher.{i}.{kind}": layer[kind].contiguous() for i, layer in enumerate(fisher) for kind in KINDS
    }
    meta = {"n_samples": n_samples, "per_row": per_row, "layers": len(fisher)}
    save_file(tensors, str(path), metadata={"lrkv_fisher": json.dumps(meta)})


def load_fisher(path: str | Path) -> tuple[FisherInfo, dict]:
    """The Fisher written by :func:`save_fisher`, and its metadata (n_samples, per_row, layers)."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["lrkv_fisher"])
        fisher = [{kind: f.get_tensor(f"fisher.{i}.{kind}") for kind in KINDS} for i in range(meta["layers"])]
    return fisher, meta
