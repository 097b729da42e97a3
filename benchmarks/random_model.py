"""Save a Llama of a real model's shape with random weights, for speed measurements that need no download.

Decode speed depends on the shapes, not the values: ``lrkv bench --model DIR`` on such a directory measures
what it would on the real model (its compressed versions are data-free: uniform ranks). The shapes are
``decode_step.py``'s (``smollm2`` is SmolLM2-135M's, ``llama-8b`` Llama-3.1-8B's); the positions are raised to
what the longest context needs, since a random model has no trained limit.

    python benchmarks/random_model.py --shape smollm2 --positions 70000 --out /tmp/smollm2-random
"""

from __future__ import annotations

import argparse

import torch
from decode_step import SHAPES
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--positions", type=int, default=70_000, help="max_position_embeddings")
    parser.add_argument("--dtype", default="bfloat16", help="the weights' dtype as saved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    s = SHAPES[args.shape]
    config = LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.d, intermediate_size=s.ffn, num_hidden_layers=s.layers,
        num_attention_heads=s.H, num_key_value_heads=s.Hkv, head_dim=s.D,
        rope_parameters={"rope_type": "default", "rope_theta": s.theta},
        max_position_embeddings=args.positions, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"saved a random {args.shape} ({n / 1e6:.1f} M parameters, {args.dtype}) to {args.out}")


if __name__ == "__main__":
    main()
