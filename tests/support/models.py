"""The one factory of tiny random models for every test (built from configs, never downloaded).

Every architecture shares one shape: vocabulary 61, d = 32, 2 layers, H = 4 query heads of D = 8, GQA with 2
KV heads unless asked otherwise (OPT is MHA), weights drawn large enough (std 0.2) that predictions depend on
the context. Architecture differences:

- ``llama``, ``mistral``: no attention biases (pass ``sliding_window=SLIDING_WINDOW`` for a windowed Mistral);
- ``llama3``: Llama with Llama 3.x's RoPE scaling (``rope_type: llama3``), its original context shrunk to 64
  positions so that D = 8's two slowest frequencies are divided by the factor and the third is smoothed;
- ``qwen2``: q/k/v biases; layer 1 slides over ``SLIDING_WINDOW`` tokens (``max_window_layers=1``);
- ``qwen3``: QK-norm (per-head RMSNorm of queries and keys before RoPE), no biases; layer 1 slides as Qwen2's;
- ``gemma3`` (model type ``gemma3_text``): QK-norm with Gemma's (1 + weight) scale, softmax scale
  ``query_pre_attn_scalar``^-½ (6, not D), layer 0 slides over ``SLIDING_WINDOW`` tokens with its own RoPE
  base (100; the full layer's 10000);
- ``phi3``: one fused ``qkv_proj``, no biases (``sliding_window=SLIDING_WINDOW`` makes every layer slide);
- ``phi3_partial``: Phi-3 with partial rotary embeddings (``partial_rotary_factor=0.5``, as Phi-4-mini's
  0.75): the first 4 of each head's 8 dims rotate;
- ``opt``: no RoPE (learned positions), biases everywhere, MHA;
- ``gpt2``: an architecture lrkv does not support (for the refusal tests).

Attention biases are drawn at random (std 0.5; transformers initialises them to zero), and so are QK-norm
weights (1 + std 0.3; transformers initialises them to one), so a fusion that mishandles them fails.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lrkv_core.data.datasets import write_token_rows
from lrkv_core.model.adapters import get_adapter

SHARED = Path(__file__).resolve().parents[2].parent / "shared"

SLIDING_WINDOW = (
    6  # Qwen2's layer 1 (and a Mistral given it) slides over 6 tokens, fewer than the test inputs
)
PARQUET_VOCAB = 64  # token ids of token_parquet's rows, and the vocabulary of a saved tiny model by default

_TOKENS = dict(vocab_size=61, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_DECODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
_LLAMA_LIKE = _TOKENS | _DECODER | dict(intermediate_size=48, head_dim=8, initializer_range=0.2)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
_ARCHS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, _LLAMA_LIKE),
    "llama3": (LlamaConfig, LlamaForCausalLM, _LLAMA_LIKE | dict(rope_parameters=LLAMA3_ROPE)),
    "mistral": (MistralConfig, MistralForCausalLM, _LLAMA_LIKE),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        _LLAMA_LIKE | dict(use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1),
    ),
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        _LLAMA_LIKE | dict(use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1),
    ),
    "phi3": (Phi3Config, Phi3ForCausalLM, _LLAMA_LIKE),
    "phi3_partial": (Phi3Config, Phi3ForCausalLM, _LLAMA_LIKE | dict(partial_rotary_factor=0.5)),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        _LLAMA_LIKE
        | dict(
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=6,
            rope_local_base_freq=100.0,
            rope_theta=10000.0,
        ),
    ),
    "opt": (
        OPTConfig,
        OPTForCausalLM,
        _TOKENS | _DECODER | dict(ffn_dim=48, word_embed_proj_dim=32, init_std=0.2),
    ),
    "gpt2": (GPT2Config, GPT2LMHeadModel, _TOKENS | dict(n_embd=32, n_layer=2, n_head=4, n_positions=128)),
}
MHA_ONLY = ("opt", "gpt2")  # no num_key_value_heads: KV heads = query heads
UNSUPPORTED = ("gpt2",)
ARCHS = tuple(_ARCHS)


def tiny_config(arch: str = "llama", n_kv_heads: int | None = None, **overrides) -> PretrainedConfig:
    """The config of :func:`tiny_model` (``n_kv_heads`` defaults to 2, or H for MHA-only architectures)."""
    cfg_cls, _, kwargs = _ARCHS[arch]
    if arch in MHA_ONLY:
        if n_kv_heads not in (None, 4):
            raise ValueError(f"{arch} is MHA: it has 4 KV heads, not {n_kv_heads}")
    else:
        kwargs = kwargs | {"num_key_value_heads": 2 if n_kv_heads is None else n_kv_heads}
    return cfg_cls(**(kwargs | overrides))


def tiny_model(
    arch: str = "llama", n_kv_heads: int | None = None, seed: int = 0, **overrides
) -> PreTrainedModel:
    """A fresh 2-layer random model in eval mode, with random attention biases where it has biases (and
    random QK-norm weights where it norms queries and keys).

    ``overrides`` are config fields (``sliding_window=SLIDING_WINDOW``, ``vocab_size=97``, ...).
    """
    config = tiny_config(arch, n_kv_heads, **overrides)
    torch.manual_seed(seed)
    model = _ARCHS[arch][1](config)
    if arch in UNSUPPORTED:
        return model.eval()
    adapter = get_adapter(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for i in range(config.num_hidden_layers):
            for proj in "qkvo":
                bias = getattr(adapter.attention(model, i), getattr(adapter, f"{proj}_name")).bias
                if bias is not None:
                    bias.copy_(0.5 * torch.randn(bias.shape, generator=gen))
            if adapter.qk_norm is not None:
                attn = adapter.attention(model, i)
                for norm in (attn.q_norm, attn.k_norm):
                    norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=gen))
    return model.eval()


def tiny_model_dir(
    root: Path,
    arch: str = "llama",
    n_kv_heads: int | None = None,
    seed: int = 0,
    *,
    name: str | None = None,
    vocab_size: int = PARQUET_VOCAB,
    **overrides,
) -> Path:
    """:func:`tiny_model` saved (no tokenizer) at ``root / name`` (default ``tiny-<arch>``).

    Its vocabulary defaults to :data:`PARQUET_VOCAB`, the ids :func:`token_parquet` writes.
    """
    out = root / (name or f"tiny-{arch}")
    tiny_model(arch, n_kv_heads, seed, vocab_size=vocab_size, **overrides).save_pretrained(out)
    return out


def token_parquet(path: Path, *, rows: int, seq_len: int, vocab: int = PARQUET_VOCAB, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    return write_token_rows(rng.integers(3, vocab, size=(rows, seq_len)).astype(np.int32), path)


def with_bos(tokenizer):
    """A copy of a fast ``tokenizer`` that puts its BOS before every text, as Llama 3 and Gemma ones do."""
    import copy

    from tokenizers.processors import TemplateProcessing

    out = copy.deepcopy(tokenizer)
    out.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)]
    )
    return out
