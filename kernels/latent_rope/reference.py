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
    key_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Keys of one group of KV heads, rebuilt from latents, with RoPE applied.

    Parameters
    ----------
    h : (B, S, r) key latents of the group (``H_k`` slice), pre-RoPE.
    up : (s·D, r) the group's up-projection ``B_k``.
    bias : (s·D,) or None, the k_proj bias rows of the group (it stays on the reconstruction side).
    cos, sin : (B, S, D) RoPE tables at the cached tokens' positions.
    head_dim : D.
    key_norm : (weight (D,), eps) of a per-head RMSNorm of the rebuilt keys before RoPE (QK-norm), or None.

    Returns
    -------
    (B, s, S, D) keys, as the original k_proj (+ k_norm) + RoPE would give at full rank.
    """
    b, s_len, _ = h.shape
    k = h @ up.T  # (B, S, s·D)
    if bias is not None:
        k = k + bias
    k = k.view(b, s_len, -1, head_dim).transpose(1, 2)  # (B, s, S, D)
    if key_norm is not None:
        k = rms_norm(k, *key_norm)
    return apply_rope(k, cos, sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, ``weight · x / √(mean(x²) + eps)``, computed in x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, h, S, D) with tables (B, S, D_rot) shared by the h heads. With partial rotary embeddings
    (D_rot < D, Phi-4-mini) only the first D_rot dims rotate, in the half-split convention among themselves,
    and the rest pass through, as in transformers' Phi-3."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, S, D_rot)
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
    return x * cos + rotate_half(x) * sin


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (B, S, D) at ``positions`` (B, S) in float32, as HF's rotary embeddings compute them
    from their ``inv_freq`` (D/2,) and ``attention_scaling`` (before the cast to the activations' dtype)."""
    freqs = positions[..., None].float() * inv_freq.float()  # (B, S, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, S, D)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def latent_rope_scores_ref(
    q: torch.Tensor,
    h: torch.Tensor,
    up: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    scaling: float,
    key_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Attention scores of one group's query heads against keys rebuilt from its latents (Palu's fused
    reconstruction + RoPE + q·K), in float32.

    Parameters
    ----------
    q : (B, n_q, T, D) RoPE'd queries of the group's query heads; head i reads the group's KV head
        ``i // (n_q / s)``, as transformers' ``repeat_kv`` pairs them.
    h : (B, S, r) the group's key latents (pre-RoPE).
    up, bias : the group's up-projection (s·D, r) and k bias rows (s·D,) or None.
    positions : (B, S) the cached tokens' positions.
    inv_freq, attention_scaling : the model's RoPE (``rotary_emb.inv_freq`` (D/2,), ``.attention_scaling``).
    scaling : the softmax scale (D⁻½ for Llama).
    key_norm : (weight (D,), eps) of the keys' per-head RMSNorm before RoPE (QK-norm), or None.

    Returns
    -------
    (B, n_q, T, S) ``scaling · q · K`` in float32.
    """
    D = q.shape[-1]
    cos, sin = rope_tables(positions, inv_freq, attention_scaling)
    bias = None if bias is None else bias.float()
    key_norm = None if key_norm is None else (key_norm[0].float(), key_norm[1])
    keys = reconstruct_rope_keys_ref(h.float(), up.float(), bias, cos, sin, D, key_norm)
    B, n_q, T, _ = q.shape
    s = keys.shape[1]
    q = q.float().view(B, s, n_q // s, T, D)  # query heads of each KV head
    scores = q @ keys.unsqueeze(2).transpose(-1, -2)  # (B, s, n_rep, T, S)
    return scores.reshape(B, n_q, T, -1) * scaling
