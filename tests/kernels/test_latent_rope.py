"""The torch reference for rebuilding RoPE'd keys from latents matches HF's k_proj + RoPE."""

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from lrkv_kernels.latent_rope import reconstruct_rope_keys, reconstruct_rope_keys_ref


def test_reference_equals_projection_then_rope():
    torch.manual_seed(0)
    B, S, d, s, D = 2, 11, 24, 2, 8  # odd S, two KV heads in the group
    x = torch.randn(B, S, d, dtype=torch.float64)
    w = torch.randn(s * D, d, dtype=torch.float64)
    bias = torch.randn(s * D, dtype=torch.float64)
    q_, _ = torch.linalg.qr(torch.randn(s * D, s * D, dtype=torch.float64))  # orthonormal up, full rank
    down, up = q_.T @ w, q_  # W = up @ down
    positions = torch.stack([torch.arange(S), torch.arange(S) + 5])  # rows at different offsets
    config = LlamaConfig(hidden_size=d, num_attention_heads=3, head_dim=D, rope_theta=500.0)
    rope = LlamaRotaryEmbedding(config)
    cos, sin = rope(x, positions)

    keys = reconstruct_rope_keys_ref(x @ down.T, up, bias, cos, sin, D)  # (B, s, S, D)
    k = (x @ w.T + bias).view(B, S, s, D).transpose(1, 2)
    _, expected = apply_rotary_pos_emb(k, k, cos, sin)
    assert keys.shape == (B, s, S, D)
    torch.testing.assert_close(keys, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reconstruct_rope_keys(x @ down.T, up, bias, cos, sin, D), keys)


def test_truncated_latents_rebuild_the_projection_onto_the_subspace():
    torch.manual_seed(1)
    B, S, d, D, r = 1, 7, 16, 8, 3
    x = torch.randn(B, S, d, dtype=torch.float64)
    w = torch.randn(D, d, dtype=torch.float64)
    u, _, _ = torch.linalg.svd(w, full_matrices=False)
    up, down = u[:, :r], u[:, :r].T @ w
    ones, zeros = torch.ones(B, S, D, dtype=torch.float64), torch.zeros(B, S, D, dtype=torch.float64)
    keys = reconstruct_rope_keys_ref(x @ down.T, up, None, ones, zeros, D)  # identity RoPE (cos 1, sin 0)
    expected = (x @ w.T @ up @ up.T).view(B, S, 1, D).transpose(1, 2)
    torch.testing.assert_close(keys, expected, rtol=1e-12, atol=1e-12)
