"""Tiny model directories on disk for task and flow tests (built from configs, never downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lrkv_core.data import write_token_rows

SHARED = Path(__file__).resolve().parents[2].parent / "shared"


def tiny_llama_dir(root: Path, *, n_kv_heads: int = 2, seed: int = 0) -> Path:
    """A saved 2-layer GQA Llama (no tokenizer) at ``root / 'tiny-llama'``."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=n_kv_heads,
        head_dim=8,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    out = root / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def token_parquet(path: Path, *, rows: int, seq_len: int, vocab: int = 64, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    return write_token_rows(rng.integers(3, vocab, size=(rows, seq_len)).astype(np.int32), path)
