"""How long a conversion takes on a device: the data-driven steps of ``lrkv_core.convert`` timed end to end.

A random Llama of a real model's shape (``--shape``, as in benchmarks/fused_decode.py; built from its config,
no download) and random calibration rows (``--rows`` of ``--seq-len`` tokens): the time of a conversion
depends on the shapes, not on the values. Each setting of ``--settings`` plans a conversion at ``--ratio``
with the model on ``--device`` (statistics, the plan's refinement) and its decompositions on the CPU, then
fuses it. Printed: seconds per setting, the first setting's seconds subtracted from the others' (what the
allocator adds), and the ranks each chose.

    python benchmarks/convert_time.py --device cuda [--shape smollm2] [--rows 256] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from fused_decode import SHAPES, sync  # benchmarks/, the script's own directory
from transformers import LlamaConfig, LlamaForCausalLM

from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from lrkv_core.model.loading import parse_device
from lrkv_core.system.dtypes import parse_dtype

SETTINGS = {
    "uniform": dict(allocator="uniform"),  # the Gram and the decompositions: what every setting pays
    "default": {},  # kl with 3 refinement steps on 128 rows
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {sorted(SETTINGS)}")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=args.seq_len + 8)
    original = LlamaForCausalLM(config).to(device, dtype).eval()
    rows = torch.randint(0, config.vocab_size, (args.rows, args.seq_len))
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu, {torch.get_num_threads()} threads"
    )
    print(
        f"random {args.shape} ({config.num_hidden_layers} layers, {config.num_key_value_heads} KV heads of "
        f"{config.head_dim}), {args.dtype} on {where}; {args.rows} calibration rows of {args.seq_len} "
        f"tokens, ratio {args.ratio}"
    )  # fmt: skip
    print("| setting | seconds | over the first | ranks K (layer 0) | ranks V (layer 0) |")
    print("|---|---|---|---|---|")
    first = None
    for name in args.settings.split(","):
        model = copy.deepcopy(original)
        sync(device)
        start = time.perf_counter()
        conversion = plan_conversion(model, rows, CompressionConfig(ratio=args.ratio, **SETTINGS[name]))
        conversion.apply(model)
        sync(device)
        seconds = time.perf_counter() - start
        first = seconds if first is None else first
        ranks = conversion.plan.ranks
        print(
            f"| {name} | {seconds:.1f} | {seconds - first:+.1f} | {ranks['k'][0]} | {ranks['v'][0]} |",
            flush=True,
        )
        del model


if __name__ == "__main__":
    main()
