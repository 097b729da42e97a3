"""Time ``load_compressed`` against the same load with transformers' random weight init.

A Llama of about 250M parameters (random weights, built from a config: no download) is compressed at
ratio 0.5 with the data-free ``plain`` decomposition and saved; then both loaders run twice and the script
prints each time, the ratio, and the max |logit diff| against the model that was saved (both must be 0).

    python benchmarks/load_time.py [--layers 16] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_model
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from lrkv_core import load_compressed, save_compressed
from lrkv_core.conversion.convert import CompressionConfig, convert
from lrkv_core.model.fuse import build_latent_skeleton
from lrkv_core.model.io import WEIGHTS


def load_with_random_init(path: Path) -> torch.nn.Module:
    """The baseline: what load_compressed did before it skipped the init of weights it loads anyway."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=torch.float32)
    build_latent_skeleton(model)
    load_model(model, str(path / WEIGHTS), strict=False)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    torch.manual_seed(0)
    heads, head_dim = args.hidden // 64, 64
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden), num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=head_dim, vocab_size=32000,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    compressed = convert(
        model, None, CompressionConfig(ratio=0.5, group_size=2, decomposition="plain", allocator="uniform")
    )
    path = save_compressed(compressed, Path(tempfile.mkdtemp()) / "model")
    ids = torch.randint(0, config.vocab_size, (1, 32))
    with torch.no_grad():
        reference = compressed(ids).logits
    print(f"{n_params / 1e6:.0f}M-parameter Llama, {args.layers} layers, saved to {path}")
    times: dict[str, float] = {}
    for round_ in (1, 2):  # round 1 warms the file cache and the allocator
        for name, load in (("random init", load_with_random_init), ("load_compressed", load_compressed)):
            start = time.perf_counter()
            loaded = load(path)
            times[name] = time.perf_counter() - start
            with torch.no_grad():
                diff = (loaded(ids).logits - reference).abs().max().item()
            print(f"round {round_}: {name:16s} {times[name]:6.2f} s   max |logit diff| {diff:.1e}")
    print(f"load_compressed / random init (round 2): {times['load_compressed'] / times['random init']:.2f}")


if __name__ == "__main__":
    main()
