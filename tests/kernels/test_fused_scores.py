"""Palu's fused scores kernel: scores against keys rebuilt in registers equal the reference; and a latent
model decoding through the fused decode path (the flash-decoding kernel) gives the logits of the unfused
path.

Without a GPU the Triton kernel runs in Triton's interpreter on CPU tensors (tests/conftest.py sets
``TRITON_INTERPRET=1`` when no CUDA device is present); with one, the tests run on the GPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from lrkv_core.model.attention import LatentAttention, set_fused_decode
from lrkv_kernels.latent_rope import latent_rope_scores, latent_rope_scores_ref, triton_runs_on
from tests.support.inputs import PAD, greedy, ids_for, left_padded
from tests.support.latents import stepwise
from tests.support.models import SLIDING_WINDOW, tiny_model

pytest.importorskip("triton", reason="the fused kernel needs Triton (installed by scripts/setup.sh)")

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # the GPU, or the interpreter on the CPU


def inputs(device, dtype, B, S, r, s, D, n_rep, T, bias, offset=1000, seed=0):
    """Random kernel inputs: queries (B, s·n_rep, T, D), latents (B, S, r), up (s·D, r), bias, positions
    (B, S) int32 with row b starting at b·offset, Llama's inv_freq."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q, h, up = rand(B, s * n_rep, T, D), rand(B, S, r), rand(s * D, r) / r**0.5
    positions = (torch.arange(S) + offset * torch.arange(B)[:, None]).to(device, torch.int32)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)).to(device)
    return q, h, up, rand(s * D) if bias else None, positions, inv_freq


def doubled(args):
    """The floating-point tensors of ``args`` in float64 (the reference's inputs)."""
    return [a.double() if a is not None and a.is_floating_point() else a for a in args]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "B, S, r, s, D, n_rep, T, bias",
    [
        (2, 37, 5, 2, 8, 3, 1, True),  # stories260k's head_dim 8: the pairs padded to 16
        (1, 70, 33, 1, 64, 2, 2, False),  # two token tiles, two query tokens
        (2, 40, 100, 2, 64, 2, 1, True),  # a rank over one reconstruction step (64 latents)
        (2, 16, 48, 2, 32, 1, 1, True),  # shakespeare-llama's head_dim, group of 2
        (3, 9, 16, 3, 80, 1, 1, False),  # head_dim 80: 40 pairs padded to 64
        (1, 1, 1, 1, 64, 3, 1, True),  # one cached token of rank 1 (SmolLM2's head_dim, GQA 3)
    ],
)
def test_kernel_equals_reference_float32(device, B, S, r, s, D, n_rep, T, bias):
    assert triton_runs_on(torch.device(device))
    args = inputs(device, torch.float32, B, S, r, s, D, n_rep, T, bias)
    got = latent_rope_scores(*args, attention_scaling=1.3, scaling=D**-0.5)
    ref = latent_rope_scores_ref(*doubled(args), attention_scaling=1.3, scaling=D**-0.5)
    assert got.dtype == torch.float32 and got.shape == (B, s * n_rep, T, S)
    assert (got.double() - ref).norm() / ref.norm() < 1e-6  # IEEE float32 (TF32 would give ~3e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="half-precision tl.dot needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_half_precision_on_cuda(dtype):
    args = inputs("cuda", dtype, 4, 3000, 96, 1, 64, 3, 1, True)
    got = latent_rope_scores(*args, attention_scaling=1.0, scaling=0.125)
    ref = latent_rope_scores_ref(*doubled(args), attention_scaling=1.0, scaling=0.125)
    assert (got.double() - ref).norm() / ref.norm() < (2e-3 if dtype == torch.float16 else 1e-2)


def test_positions_far_out_keep_float32_accuracy():
    """Angles of tens of thousands of radians: the kernel's cos/sin agree with torch's on the same float32
    angle (an approximate cos would drift there)."""
    device = DEVICES[-1]
    args = inputs(device, torch.float32, 1, 64, 32, 1, 64, 1, 1, False, offset=0)
    positions = torch.arange(60_000, 60_064, device=device, dtype=torch.int32)[None]
    args = (*args[:4], positions, args[5])
    got = latent_rope_scores(*args, attention_scaling=1.0, scaling=0.125)
    ref = latent_rope_scores_ref(*args, attention_scaling=1.0, scaling=0.125)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def fused(model, value: bool | None):
    """Every latent attention of ``model`` with ``fused_decode = value``, then back to the default."""
    assert set_fused_decode(model, value)
    try:
        yield
    finally:
        set_fused_decode(model, None)


def calls_kernel(model, monkeypatch) -> list[int]:
    """Counts the fused decode kernel's calls (appended to the returned list) while ``model`` runs."""
    import lrkv_core.model.attention as attention

    calls: list[int] = []
    kernel = attention.latent_decode_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention, "latent_decode_attention", counted)
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "arch, group_size, cache",
    [
        ("llama", 1, {"name": "dense"}),
        ("llama", 2, {"name": "quantized", "bits": 4}),
        ("llama3", 2, {"name": "dense"}),  # Llama 3.x's scaled RoPE frequencies
        ("qwen2", 1, {"name": "dense"}),  # q/k biases; layer 1 slides over 6 tokens (the mask carries it)
        ("qwen3", 2, {"name": "dense"}),  # QK-norm of rebuilt keys in the kernel; layer 1 slides
        ("qwen3", 1, {"name": "quantized", "bits": 4}),
        ("phi3", 2, {"name": "dense"}),  # keys from the fused qkv_proj's rows; every layer slides
        ("gemma3", 2, {"name": "dense"}),  # (1 + w) key norm, query_pre_attn_scalar, per-layer RoPE bases
        ("mistral", 2, {"name": "tale", "low": 0.5, "keep": 0.25, "sink": 2, "buffer": 4}),
    ],
)
def test_decode_through_the_kernel_gives_the_unfused_logits(
    compress, monkeypatch, device, attn, arch, group_size, cache
):
    extra = {"sliding_window": SLIDING_WINDOW} if arch in ("mistral", "phi3") else {}
    model = tiny_model(arch, 2, attn_implementation=attn, **extra)
    comp = compress(model, group_size, 0.5, rank_multiple=1)[0].to(device)
    comp.config.lrkv["cache"] = cache
    ids = ids_for(2, 14).to(device)
    with fused(comp, False):
        ref, _ = stepwise(comp, ids, prefix=5)
    calls = calls_kernel(comp, monkeypatch)
    with fused(comp, True):
        got, _ = stepwise(comp, ids, prefix=5)
    assert len(calls) == 9 * 2  # 9 decode steps × 2 layers, every group in one launch; prefill unfused
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_left_padded_generate_through_the_kernel(compress, device):
    """Left padding reaches the kernel's path as the attention mask: greedy generations equal the unfused
    ones, and the pads' positions (whatever generate gives them) are masked."""
    comp = compress(tiny_model("llama", 2), 1, 0.5, rank_multiple=1)[0].to(device)
    ids, mask = left_padded((9, 4, 7))
    ids, mask = ids.to(device), mask.to(device)
    with fused(comp, False):
        ref = greedy(comp, ids, mask, max_new_tokens=10)
    with fused(comp, True):
        got = greedy(comp, ids, mask, max_new_tokens=10)
    assert torch.equal(got, ref) and (got[:, ids.shape[1] :] != PAD).any()


def test_fused_path_only_where_it_applies(compress, monkeypatch):
    """Prefill, training, a LoRA-wrapped k_up, a flash attention implementation and a dynamic RoPE all take
    the unfused path; on CPU tensors the default (None) does too."""
    comp = compress(tiny_model("llama", 2), 1, 0.5, rank_multiple=1)[0]
    attn = next(m for m in comp.modules() if isinstance(m, LatentAttention))
    q1, q3 = torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 3, 8)
    assert not attn.decodes_fused(q1)  # CPU tensors, default
    attn.fused_decode = True
    assert attn.decodes_fused(q1) and not attn.decodes_fused(q3)
    attn.train()
    assert not attn.decodes_fused(q1)
    attn.eval()
    monkeypatch.setattr(attn.rotary_emb, "rope_type", "dynamic")
    assert not attn.decodes_fused(q1)
    monkeypatch.setattr(attn.rotary_emb, "rope_type", "default")
    monkeypatch.setattr(comp.config, "_attn_implementation", "flash_attention_2")
    assert not attn.decodes_fused(q1)
    monkeypatch.setattr(comp.config, "_attn_implementation", "eager")
    up = attn.k_up[0]
    attn.k_up[0] = nn.Sequential(up)  # what a wrapper looks like to the module: not a plain Linear
    assert not attn.decodes_fused(q1)
    attn.k_up[0] = up
    assert attn.decodes_fused(q1)
