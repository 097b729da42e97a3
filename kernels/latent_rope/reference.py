"""Torch reference (the spec) for rebuilding RoPE'd keys from low-rank latents."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE helper in the half-split convention of HF Llama: (x1, x2) -> (-x2, x1) on the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def reconstruct_rope_keys_ref(
    h: torch.Tensor,
    up: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> torch.Tensor:
    """Keys of one group of KV heads, rebuilt from latents, with RoPE applied.

    Parameters
    ----------
    h : (B, S, r) key latents of the group (``H_k`` slice), pre-RoPE.
    up : (s·D, r) the group's up-projection ``B_k``.
    bias : (s·D,) or None, the k_proj bias rows of the group (it stays on the reconstruction side).
    cos, sin : (B, S, D) RoPE tables at the cached tokens' positions.
    head_dim : D.

    Returns
    -------
    (B, s, S, D) keys, as the original k_proj + RoPE would give at full rank.
    """
    b, s_len, _ = h.shape
    k = h @ up.T  # (B, S, s·D)
    if bias is not None:
        k = k + bias
    k = k.view(b, s_len, -1, head_dim).transpose(1, 2)  # (B, s, S, D)
    return apply_rope(k, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, h, S, D) with tables (B, S, D) shared by the h heads."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, S, D)
    return x * cos + rotate_half(x) * sin
