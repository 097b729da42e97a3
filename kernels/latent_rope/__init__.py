"""Rebuild keys from cached latents and apply RoPE: ``K = rope(H_k B_kᵀ + b_k)``.

Palu fuses reconstruction, RoPE and q·K into one kernel. :func:`latent_decode_attention` goes further for a
decode step: a whole layer's attention (every group, scores, softmax and the value latents) in one
flash-decoding launch (:mod:`lrkv_kernels.latent_rope.flash`), over latents as they are or over a quantized
cache's packed codes (:class:`PackedLatents`, unpacked in registers). :func:`latent_rope_scores` is Palu's
kernel for one group's scores (:mod:`lrkv_kernels.latent_rope.fused`, Triton): the scores of a group's query
heads against keys rebuilt in registers, never written out. Both run on CUDA tensors where Triton is
installed, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests); elsewhere their torch references,
which are the spec.
:func:`absorbed_decode_attention` is a decode step over latents of keys projected *after* RoPE: the queries
absorb the key basis, so no key is rebuilt (:mod:`lrkv_kernels.latent_rope.absorbed`).
:func:`reconstruct_rope_keys` (keys materialised, any number of queries) stays the torch reference.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from .absorbed import absorbed_decode_attention_ref
from .decode import LatentDecodeWeights, additive_mask, latent_decode_attention_ref
from .packed import PackedLatents, dequantize_ref, latent_decode_attention_packed_ref
from .reference import (
    apply_rope,
    latent_rope_scores_ref,
    reconstruct_rope_keys_ref,
    rope_tables,
    rotate_half,
)


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


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels run on tensors of ``device``: CUDA with Triton installed, or the CPU under
    ``TRITON_INTERPRET=1`` (set before the kernels are first used)."""
    if not _triton_installed():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def latent_rope_scores(
    q: torch.Tensor,
    h: torch.Tensor,
    up: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    scaling: float,
) -> torch.Tensor:
    """Dispatcher for :func:`latent_rope_scores_ref` (same arguments and result): the Triton kernel where
    :func:`triton_runs_on` the tensors' device, else the reference."""
    if triton_runs_on(q.device):
        from .fused import latent_rope_scores_triton  # Triton reads TRITON_INTERPRET when this is imported

        return latent_rope_scores_triton(q, h, up, bias, positions, inv_freq, attention_scaling, scaling)
    return latent_rope_scores_ref(q, h, up, bias, positions, inv_freq, attention_scaling, scaling)


def latent_decode_attention(
    q: torch.Tensor,
    h_k: torch.Tensor | PackedLatents,
    h_v: torch.Tensor | PackedLatents,
    weights: LatentDecodeWeights,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    scaling: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatcher for :func:`latent_decode_attention_ref` (same arguments and result), and for
    :func:`latent_decode_attention_packed_ref` where ``h_k`` and ``h_v`` are a quantized cache's
    :class:`PackedLatents`: the flash-decoding Triton kernel (which unpacks codes in registers) where
    :func:`triton_runs_on` the tensors' device, else the reference."""
    if triton_runs_on(q.device):
        from .flash import latent_decode_attention_triton  # Triton reads TRITON_INTERPRET when imported

        return latent_decode_attention_triton(
            q, h_k, h_v, weights, positions, inv_freq, attention_scaling, scaling, mask
        )
    packed = isinstance(h_k, PackedLatents)
    reference = latent_decode_attention_packed_ref if packed else latent_decode_attention_ref
    return reference(q, h_k, h_v, weights, positions, inv_freq, attention_scaling, scaling, mask)


def absorbed_decode_attention(
    q: torch.Tensor,
    h_k: torch.Tensor | PackedLatents,
    h_v: torch.Tensor | PackedLatents,
    weights: LatentDecodeWeights,
    scaling: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatcher for :func:`absorbed_decode_attention_ref` (same arguments and result; latents of keys
    projected after RoPE, queries absorbed): the Triton kernel where :func:`triton_runs_on` the tensors'
    device, else the reference."""
    if triton_runs_on(q.device):
        from .flash_absorbed import absorbed_decode_attention_triton

        return absorbed_decode_attention_triton(q, h_k, h_v, weights, scaling, mask)
    return absorbed_decode_attention_ref(q, h_k, h_v, weights, scaling, mask)


__all__ = [
    "LatentDecodeWeights",
    "PackedLatents",
    "absorbed_decode_attention",
    "absorbed_decode_attention_ref",
    "additive_mask",
    "apply_rope",
    "dequantize_ref",
    "latent_decode_attention",
    "latent_decode_attention_packed_ref",
    "latent_decode_attention_ref",
    "latent_rope_scores",
    "latent_rope_scores_ref",
    "reconstruct_rope_keys",
    "reconstruct_rope_keys_ref",
    "rope_tables",
    "rotate_half",
    "triton_runs_on",
]
