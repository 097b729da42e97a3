"""What lrkv's decode kernels compile to on a GPU, measured without one: registers, spills, shared memory and
the machine instructions of each kernel, for a real model's shape.

lrkv's decode kernels read their latents far below a GPU's bandwidth (docs/fused-decode.md): on an H200
their times follow the instructions they issue per cached token (unpacking codes, dequantizing, address
arithmetic, moving tiles into shared memory for the matrix units) more than the bytes they read, and
registers past the hardware's 255 per thread spill to local memory. Both can be read from the compiled
kernel. This script calls the kernels' host functions with CPU tensors of the shape
(SmolLM2-135M's layer at half the KV width by default: 9 query heads over one latent group of rank 96,
batch 8, 65,536 tokens), stops at the launch, specializes the launch's arguments as Triton's JIT would on a
GPU (integers equal to 1 become constants, pointers and integers divisible by 16 are marked so), compiles
for the target (``--arch``, default 90: H100/H200) with the ptxas that ships with Triton, and reads the
cubin with its cuobjdump. Per kernel, storage and tiling it prints one line: registers per thread, bytes of
local memory per thread (spills), shared memory, the warps a multiprocessor holds at once (what the
registers and shared memory allow; more hide more latency), SASS instructions in the kernel, and counts
of global loads (and how many of them read 128 bits at once), shared loads and stores, local stores and
loads, matrix instructions and conversions (int↔float, float→bf16), with ``--out`` as JSON lines.

Counts are static (instructions in the code, not executed ones), and the loop over the cached tokens is
most of the code: a fewer-instruction kernel of the same tiling issues fewer per token. They are a guide
for changing a kernel without a GPU; a GPU's timing (``benchmarks/decode_step.py``, ``lrkv bench``)
decides.

    python benchmarks/kernel_sass.py                   # both kernels, dense and 2/3/4-bit codes
    python benchmarks/kernel_sass.py --kernels absorbed --bits 3 --tilings 0:4,32:4,64:8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from lrkv_core.quant import group_widths, pack_codes, quantize  # noqa: E402
from lrkv_kernels.latent_rope import flash, flash_absorbed  # noqa: E402
from lrkv_kernels.latent_rope.decode import LatentDecodeWeights  # noqa: E402
from lrkv_kernels.latent_rope.packed import PackedLatents  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SASS_LINE = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


class _Launch:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the arguments instead of running."""

    def __init__(self) -> None:
        self.args: tuple = ()
        self.kwargs: dict = {}

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.args, self.kwargs = args, kwargs

        return record


def launch_of(module, name: str, call) -> _Launch:
    """The arguments ``call()`` launches ``module.name`` with (the host function's own checks and layout
    code run; the kernel does not)."""
    launch, kernel = _Launch(), getattr(module, name)
    setattr(module, name, launch)
    try:
        call()
    except (IndexError, RuntimeError):  # the combine step reads partial sums no kernel wrote
        pass
    finally:
        setattr(module, name, kernel)
    if not launch.kwargs:
        raise RuntimeError(f"{name} was not launched")
    return launch


def compile_launch(kernel, launch: _Launch, arch: int):
    """``kernel`` compiled for ``arch`` with ``launch``'s arguments specialized as Triton's JIT does."""
    values = list(launch.args) + [launch.kwargs[p.name] for p in kernel.params[len(launch.args) :]]
    signature, constants, attrs = {}, {}, {}
    for i, (param, value) in enumerate(zip(kernel.params, values, strict=True)):
        if param.is_constexpr:
            signature[param.name], constants[(i,)] = "constexpr", value
            continue
        specialize, align = not param.do_not_specialize, not param.do_not_specialize_on_alignment
        kind, spec = native_specialize_impl(BaseBackend, value, False, specialize, align)
        if kind == "constexpr":
            signature[param.name], constants[(i,)] = "constexpr", spec
        else:
            signature[param.name] = kind
            if spec == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: launch.kwargs[k] for k in ("num_warps", "num_stages")}
    source = ASTSource(kernel, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def resident_warps(registers: int, shared: int, warps: int) -> int:
    """Warps of one kernel that an sm_90 multiprocessor holds at once: 64K registers (allocated per warp in
    units of 256), 228 KB of shared memory (1 KB of it reserved per block), at most 32 blocks and 64
    warps."""
    per_warp = -(-registers * 32 // 256) * 256
    blocks = min(65536 // (per_warp * warps), (228 * 1024) // (shared + 1024), 32, 64 // warps)
    return blocks * warps


def resources(compiled) -> dict:
    """Registers, local memory (spills), shared memory and instruction counts of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [TOOLS / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True
        ).stdout
        sass = subprocess.run([TOOLS / "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    full = Counter(m.group(1) for m in map(SASS_LINE.match, sass.splitlines()) if m)
    ops = Counter()
    for op, n in full.items():
        ops[op.split(".")[0]] += n
    return {
        "registers": int(regs),
        "local_bytes": int(stack),
        "shared_bytes": compiled.metadata.shared,
        "resident_warps": resident_warps(int(regs), compiled.metadata.shared, compiled.metadata.num_warps),
        "instructions": sum(ops.values()),
        "global_loads": ops["LDG"],
        "global_loads_128bit": sum(
            n for op, n in full.items() if op.startswith("LDG") and op.endswith(".128")
        ),
        "shared_loads": ops["LDS"] + ops["LDSM"],
        "shared_stores": ops["STS"],
        "local_stores": ops["STL"],
        "local_loads": ops["LDL"],
        "mma": ops["HMMA"] + ops["HGMMA"],
        "conversions": ops["I2F"] + ops["I2FP"] + ops["F2F"] + ops["F2FP"] + ops["F2I"],
    }


def latents(B: int, S: int, rank: int, bits: int, gen: torch.Generator) -> torch.Tensor | PackedLatents:
    """Random bfloat16 latents (B, S, rank), or their ``bits``-bit codes as the quantized storage packs
    them."""
    h = torch.randn(B, S, rank, generator=gen).to(torch.bfloat16)
    if not bits:
        return h
    rows = quantize(h, group_widths([rank], None), bits)
    return PackedLatents(pack_codes(rows.codes, bits), rows.scale, rows.zero, bits, None, None, h.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="absorbed,rebuilt", help="absorbed (rotated keys), rebuilt")
    parser.add_argument("--bits", default="0,2,3,4", help="0: dense latents; else packed codes")
    parser.add_argument(
        "--tilings", default="0:4", help="tokens per tile (0: the kernel's default):warps, comma-separated"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--rank", type=int, default=96, help="the group's key and value rank")
    parser.add_argument("--heads", type=int, default=3, help="KV heads in the group (rebuilt keys)")
    parser.add_argument("--q-heads", type=int, default=9, help="query heads per group")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--arch", type=int, default=90, help="compute capability × 10 (90: H100, H200)")
    parser.add_argument("--out", type=Path, help="append each row as JSON here")
    args = parser.parse_args()
    if not set(args.kernels.split(",")) <= {"absorbed", "rebuilt"}:
        parser.error(f"--kernels takes absorbed and/or rebuilt, got {args.kernels!r}")
    if not set(args.bits.split(",")) <= {"0", "2", "3", "4", "8"}:
        parser.error(f"--bits takes 0 (dense), 2, 3, 4 or 8, got {args.bits!r}")

    B, S, r, s, D, nq = args.batch, args.context, args.rank, args.heads, args.head_dim, args.q_heads
    gen = torch.Generator().manual_seed(0)
    q_abs = torch.randn(B, nq, r, generator=gen).to(torch.bfloat16)
    q = torch.randn(B, nq, D, generator=gen).to(torch.bfloat16)
    up = torch.randn(s * D, r, generator=gen) / r**0.5
    rebuilt = LatentDecodeWeights.build([up], [None], [r], nq, torch.bfloat16, None, 0.0)
    absorbed = LatentDecodeWeights.layout([r], [r], nq, "cpu")
    positions = torch.arange(S, dtype=torch.int32).expand(B, S)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)

    def launch(name: str, h_k, h_v, opts: dict) -> tuple:
        """The module, kernel name and recorded launch of one kernel's host call."""
        if name == "absorbed":
            host, kernel = flash_absorbed.absorbed_decode_attention_triton, "_absorbed_decode_kernel"
            args = (q_abs, h_k, h_v, absorbed, 0.125)
            module = flash_absorbed
        else:
            host, kernel = flash.latent_decode_attention_triton, "_flash_decode_kernel"
            args = (q, h_k, h_v, rebuilt, positions, inv_freq, 1.0, 0.125)
            module = flash
        return module, kernel, launch_of(module, kernel, lambda: host(*args, **opts))

    for bits in [int(b) for b in args.bits.split(",")]:
        h_k, h_v = latents(B, S, r, bits, gen), latents(B, S, r, bits, gen)
        for tiling in args.tilings.split(","):
            block_s, warps = (int(x) for x in tiling.split(":"))
            opts = dict(n_splits=32, block_s=block_s or None, num_warps=warps, num_stages=1)
            for name in args.kernels.split(","):
                module, kernel, recorded = launch(name, h_k, h_v, opts)
                row = {"kernel": name, "bits": bits, "block_s": recorded.kwargs["BLOCK_S"], "warps": warps}
                row |= {"arch": args.arch} | resources(
                    compile_launch(getattr(module, kernel), recorded, args.arch)
                )
                print(json.dumps(row), flush=True)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
