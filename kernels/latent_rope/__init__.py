"""Rebuild keys from cached latents and apply RoPE: ``K = rope(H_k B_kᵀ + b_k)``.

Palu fuses reconstruction, RoPE and q·K into one kernel. The dispatcher below is where a Triton
implementation will plug in; today every device uses the torch reference, which is the spec.
"""

from __future__ import annotations

import torch

from .reference import apply_rope, reconstruct_rope_keys_ref, rotate_half


def reconstruct_rope_keys(
    h: torch.Tensor,
    up: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> torch.Tensor:
    """Dispatcher for :func:`reconstruct_rope_keys_ref` (same arguments and result)."""
    return reconstruct_rope_keys_ref(h, up, bias, cos, sin, head_dim)


__all__ = ["apply_rope", "reconstruct_rope_keys", "reconstruct_rope_keys_ref", "rotate_half"]
