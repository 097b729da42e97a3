"""Per-layer activation statistics collected while streaming calibration data.

The Gram matrix ``Σ x xᵀ`` of the input to k/v_proj (both read the same normed hidden state) is
accumulated in float64 through forward pre-hooks; activations are never kept.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .adapters import get_adapter


@torch.no_grad()
def collect_gram(
    model: nn.Module,
    rows: torch.Tensor,
    *,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[torch.Tensor], int]:
    """Gram matrices of the k/v_proj inputs of every layer.

    Parameters
    ----------
    rows : (N, T) calibration token ids.

    Returns
    -------
    grams : L tensors (d, d) float64, ``Σ_tokens x xᵀ``.
    n_tokens : number of token vectors accumulated per layer.
    """
    adapter = get_adapter(model.config)
    shape = adapter.shape(model.config)
    device = next(model.parameters()).device
    grams = [torch.zeros(shape.d, shape.d, dtype=torch.float64, device=device) for _ in range(shape.L)]
    counts = [0] * shape.L

    def make_hook(i: int):
        def hook(_module: nn.Module, args: tuple) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).to(torch.float64)  # (B·T, d)
            grams[i].addmm_(x.T, x)
            counts[i] += x.shape[0]

        return hook

    handles = [
        getattr(adapter.attention(model, i), adapter.k_name).register_forward_pre_hook(make_hook(i))
        for i in range(shape.L)
    ]
    was_training = model.training
    model.eval()
    try:
        n = rows.shape[0]
        for start in range(0, n, batch_size):
            model(rows[start : start + batch_size].to(device), use_cache=False)
            if progress:
                progress(min(start + batch_size, n), n)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return [g.cpu() for g in grams], counts[0]


def save_grams(grams: list[torch.Tensor], n_tokens: int, path: str | Path) -> None:
    save_file(
        {f"gram.{i}": g.contiguous() for i, g in enumerate(grams)}, str(path), {"n_tokens": str(n_tokens)}
    )


def load_gram(path: str | Path, layer: int) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(f"gram.{layer}")


def load_grams(path: str | Path) -> list[torch.Tensor]:
    tensors = load_file(str(path))
    return [tensors[f"gram.{i}"] for i in range(len(tensors))]
