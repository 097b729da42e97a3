"""A decode step at long context on a GPU: the original attention against lrkv's latents, whole steps captured
in CUDA graphs so that the comparison measures the cache, not Python.

For a real model's shape (random weights: no download; ``smollm2`` is SmolLM2-135M's, ``llama-8b``
Llama-3.1-8B's) it builds the decoder stack twice from the same weights:

- **original**: per layer RMSNorm, q/k/v projections, RoPE, the new key and value written into a preallocated
  (static) cache, attention through torch's ``scaled_dot_product_attention`` (its flash kernel on a GPU, GQA
  without repeating the KV heads), o_proj, RMSNorm and the SwiGLU MLP; then the final norm and the LM head;
- **lrkv**: the same, with lrkv's decode path: ``k_down``/``v_down`` (data-free SVD of each group's
  k/v projection at ``--ratio`` of the KV width, as ``plain`` gives), the new latents written into a static
  latent cache, attention through the flash-decoding kernel over latents
  (:func:`lrkv_kernels.latent_rope.latent_decode_attention`: keys rebuilt in registers, values folded into
  o_proj), and the folded o_proj;
- **lrkv-rotated**: the same, with the key latents projecting each group's keys *after* RoPE
  (``h_k = Uᵀ rope(k)``, U the group's left singular vectors at ``--ratio``), the queries absorbed
  (``U_jᵀ rope(q)``), and attention over the latents as a multi-query attention of head dim r: no key is
  rebuilt (:mod:`lrkv_kernels.latent_rope.absorbed`; timed through its Triton kernel and torch's SDPA).
  ``--keys`` chooses which of the two lrkv paths run.

Printed, per context: the attention of one layer alone (CUDA-graph replays: the original's SDPA; lrkv's
kernel; Palu's per-group scores kernel with softmax and the value product in torch; the rotated keys' kernel
and SDPA), with the bytes each reads and the bandwidth that makes; then a whole decode step of the stack
(the cache prefilled to the context, one token written at the next position, attention over all of it;
CUDA-graph replays timed with CUDA events, median of ``--repeats`` runs of ``--steps``); and the serving
trade: within the memory the original's cache takes at ``--batch``, lrkv holds ``⌊1/ratio_bytes⌋`` times the
batch, and tokens/s at each.
Every row is also written as JSON to ``--out``. With ``--bits``, ``--unpack codes`` has the kernels read the
packed codes one at a time instead of a word at a time (their default), to time the two readings.

Before timing, the stack is checked at full rank (rank = the whole KV width) on a small prefix decoded token
by token: lrkv's logits must equal the original's (float32); on a GPU the rotated keys' kernel is also
compared with its torch reference (float32 and bfloat16).

    python benchmarks/decode_step.py --shape smollm2 --context 16384,32768,65536 --batch 8
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import statistics
import sys
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    import lrkv_kernels  # noqa: F401
except ImportError:  # a checkout without the package installed: the kernels live in kernels/
    spec = importlib.util.spec_from_file_location(
        "lrkv_kernels", Path(__file__).resolve().parents[1] / "kernels" / "__init__.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["lrkv_kernels"] = module
    spec.loader.exec_module(module)

from lrkv_kernels.latent_rope import (
    LatentDecodeWeights,
    PackedLatents,
    absorbed_decode_attention,
    latent_decode_attention,
    latent_rope_scores,
)

_packing = importlib.util.spec_from_file_location(  # torch alone: no need for lrkv_core's dependencies
    "lrkv_packing", Path(__file__).resolve().parents[1] / "lrkv_core" / "quant" / "packing.py"
)
packing = importlib.util.module_from_spec(_packing)
_packing.loader.exec_module(packing)


@dataclass(frozen=True)
class Shape:
    layers: int
    d: int
    H: int
    Hkv: int
    D: int
    ffn: int
    vocab: int
    theta: float
    group: int  # lrkv's default group size for this many KV heads (the largest divisor up to 4)


SHAPES = {
    "smollm2": Shape(30, 576, 9, 3, 64, 1536, 49152, 100000.0, 3),
    "llama-8b": Shape(32, 4096, 32, 8, 128, 14336, 128256, 500000.0, 4),
    "tiny": Shape(2, 64, 4, 2, 16, 128, 97, 10000.0, 2),  # the full-rank check on the CPU
}


BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
TILINGS = [
    (0, 4, 1),  # the kernel's defaults
    (64, 4, 1, 0, 1, 0),  # one KV head per product, scores in float32
    (32, 4, 1),
    (64, 8, 1),
    (16, 4, 1),
]  # tokens/tile, warps, stages[, scores in the latents' dtype, KV heads per block, hoist B_k, splits]
TILING_FIELDS = (
    "block_s",
    "num_warps",
    "num_stages",
    "latent_scores",
    "heads_per_block",
    "hoist",
    "n_splits",
)
ROTATED_TILINGS = [(0, 4, 1), (128, 4, 1), (64, 4, 2), (128, 8, 2)]  # tokens/tile, warps, stages[, splits]
ROTATED_FIELDS = ("block_s", "num_warps", "num_stages", "n_splits")


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Stack:
    """The weights of a decoder stack (random, seeded) and the original's decode step over a static cache."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.shape, self.device, self.dtype = shape, device, dtype
        gen = torch.Generator(device).manual_seed(seed)
        s = shape

        def w(*dims):
            return (torch.randn(*dims, generator=gen, device=device) / math.sqrt(dims[-1])).to(dtype)

        self.embed = w(s.vocab, s.d)
        self.layers = [
            dict(
                ln1=torch.ones(s.d, device=device, dtype=dtype),
                ln2=torch.ones(s.d, device=device, dtype=dtype),
                q=w(s.H * s.D, s.d),
                k=w(s.Hkv * s.D, s.d),
                v=w(s.Hkv * s.D, s.d),
                o=w(s.d, s.H * s.D),
                gate=w(s.ffn, s.d),
                up=w(s.ffn, s.d),
                down=w(s.d, s.ffn),
            )  # fmt: skip
            for _ in range(s.layers)
        ]
        self.norm = torch.ones(s.d, device=device, dtype=dtype)
        self.inv_freq = 1.0 / s.theta ** (torch.arange(0, s.D, 2, device=device).float() / s.D)

    def tables(self, position: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        angle = position * self.inv_freq  # float32, as HF's rotary embedding
        emb = torch.cat((angle, angle))
        return emb.cos().to(self.dtype).expand(batch, -1), emb.sin().to(self.dtype).expand(batch, -1)

    def mlp_and_head(self, x: torch.Tensor, layer: dict, attn: torch.Tensor) -> torch.Tensor:
        x = x + attn
        h = rms_norm(x, layer["ln2"])
        return x + (F.silu(h @ layer["gate"].T) * (h @ layer["up"].T)) @ layer["down"].T

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm) @ self.embed.T


class Original:
    """The original attention over a static cache K, V (per layer (B, Hkv, S_max, D))."""

    def __init__(self, stack: Stack, batch: int, capacity: int, backend: str = "flash") -> None:
        s, dev, dt = stack.shape, stack.device, stack.dtype
        self.stack, self.backend = stack, backend
        self.k = [torch.zeros(batch, s.Hkv, capacity, s.D, device=dev, dtype=dt) for _ in range(s.layers)]
        self.v = [torch.zeros_like(k) for k in self.k]

    def fill(self) -> None:
        for t in (*self.k, *self.v):
            t.normal_()

    def choose(self, backend: str) -> None:
        self.backend = backend

    def attention(self, i: int, h: torch.Tensor, pos: int, cos, sin) -> torch.Tensor:
        s, L = self.stack.shape, self.stack.layers[i]
        B = h.shape[0]
        q = rope((h @ L["q"].T).view(B, s.H, 1, s.D), cos[:, None, None], sin[:, None, None])
        k = rope((h @ L["k"].T).view(B, s.Hkv, s.D), cos[:, None], sin[:, None])
        self.k[i][:, :, pos] = k
        self.v[i][:, :, pos] = (h @ L["v"].T).view(B, s.Hkv, s.D)
        K, V = self.k[i][:, :, : pos + 1], self.v[i][:, :, : pos + 1]
        if self.backend == "default":
            out = F.scaled_dot_product_attention(q, K, V, enable_gqa=s.H != s.Hkv)  # (B, H, 1, D)
        else:
            with sdpa_kernel(BACKENDS[self.backend]):
                out = F.scaled_dot_product_attention(q, K, V, enable_gqa=s.H != s.Hkv)
        return out.reshape(B, -1) @ L["o"].T

    def bytes_per_token(self) -> int:
        s = self.stack.shape
        return 2 * s.layers * s.Hkv * s.D * self.k[0].element_size()

    def step(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        cos, sin = self.stack.tables(pos, x.shape[0])
        for i, L in enumerate(self.stack.layers):
            x = self.stack.mlp_and_head(x, L, self.attention(i, rms_norm(x, L["ln1"]), pos, cos, sin))
        return self.stack.logits(x)


class Latent:
    """lrkv's decode path over a static latent cache H_k (B, S_max, R_k), H_v (B, S_max, R_v) per layer: the
    same stack, each group's k/v projections cut to ``rank`` (keys to ``rank_k``, default ``rank``) by a
    data-free SVD, B_v folded into o_proj.

    ``rotated``: the key latents project each group's keys *after* RoPE on the left singular vectors U of its
    k projection (``h_k = Uᵀ rope(k)``), and each query head is absorbed (``U_jᵀ rope(q)``), so attention
    rebuilds no key (:mod:`lrkv_kernels.latent_rope.absorbed`); exact at full rank like the default."""

    def __init__(
        self,
        stack: Stack,
        rank: int,
        batch: int,
        capacity: int,
        bits: int = 0,
        rotated: bool = False,
        rank_k: int | None = None,
        unpack_words: bool = True,
    ) -> None:
        s, dev, dt = stack.shape, stack.device, stack.dtype
        rank_k = rank_k or rank
        self.stack, self.rank, self.rank_k, self.bits, self.rotated = stack, rank, rank_k, bits, rotated
        self.unpack_words = unpack_words
        G, nq, n_rep = s.Hkv // s.group, s.H // (s.Hkv // s.group), s.H // s.Hkv
        self.layers = []
        for L in stack.layers:
            k_down, v_down, ups, o_blocks, bases, absorbed = [], [], [], [], [], []
            for g in range(G):
                rows = slice(g * s.group * s.D, (g + 1) * s.group * s.D)
                uk, sk, vk = torch.linalg.svd(L["k"][rows].float(), full_matrices=False)
                uv, sv, vv = torch.linalg.svd(L["v"][rows].float(), full_matrices=False)
                k_down.append(vk[:rank_k])
                ups.append((uk[:, :rank_k] * sk[:rank_k]).to(dt))  # B_k (s·D, r_k)
                bases.append(uk[:, :rank_k])  # U (s·D, r_k), orthonormal: the rotated keys' basis
                v_down.append(vv[:rank])
                b_v = uv[:, :rank] * sv[:rank]  # (s·D, r)
                for h in range(g * nq, (g + 1) * nq):  # W_o,h B_v,g,h
                    j = (h - g * nq) // n_rep
                    o_blocks.append(L["o"][:, h * s.D : (h + 1) * s.D].float() @ b_v[j * s.D : (j + 1) * s.D])
                    absorbed.append(uk[j * s.D : (j + 1) * s.D, :rank_k])  # U_j (D, r_k)
            self.layers.append(
                dict(
                    k_down=torch.cat(k_down).to(dt),
                    v_down=torch.cat(v_down).to(dt),
                    o=torch.cat(o_blocks, dim=1).to(dt),
                    weights=LatentDecodeWeights.build(ups, [None] * G, [rank] * G, nq, dt),
                    basis=torch.stack(bases).to(dt),  # (G, s·D, r)
                    absorb=torch.stack(absorbed).to(dt),  # (H, D, r)
                )  # fmt: skip
            )
            self.layers[-1]["groups"] = self.layers[-1][
                "weights"
            ].groups()  # read once: no sync when captured
        widths = (G * rank_k, G * rank)  # keys', values' latents per token
        if bits:  # the quantized storage's layout: packed codes, a float16 scale and zero per token and group
            self.hk, self.hv = (
                [torch.zeros(batch, capacity, packing.packed_width(R, bits), device=dev, dtype=torch.uint8)
                 for _ in range(s.layers)]
                for R in widths
            )  # fmt: skip
            self.scales = [
                torch.zeros(4, batch, capacity, G, device=dev, dtype=torch.float16) for _ in range(s.layers)
            ]  # k scale, k zero, v scale, v zero
        else:
            self.hk, self.hv = (
                [torch.zeros(batch, capacity, R, device=dev, dtype=dt) for _ in range(s.layers)]
                for R in widths
            )
        self.positions = torch.arange(capacity, device=dev, dtype=torch.int32).expand(batch, -1)
        self.kernel = "dispatch"
        self.stats: dict = {}

    def fill(self) -> None:
        for t in (*self.hk, *self.hv):
            if self.bits:
                t.random_(0, 256)  # any bytes are valid codes
            else:
                t.normal_()
        for t in getattr(self, "scales", []):
            t[0::2].uniform_(0.05, 0.5)
            t[1::2].uniform_(-1.0, 0.0)

    def write(self, i: int, pos: int, hk: torch.Tensor, hv: torch.Tensor) -> None:
        """The step's new latents into the cache: as they are, or quantized per group (min-max, round to
        nearest) and packed in the quantized storage's layout. The storage's own quantizer also rounds its
        float16 scales outward and checks them for overflow, which reads back to the host: left out here so
        that the step can be captured in a CUDA graph."""
        if not self.bits:
            self.hk[i][:, pos], self.hv[i][:, pos] = hk, hv
            return
        G = self.scales[i].shape[-1]
        for j, (h, codes) in enumerate(((hk, self.hk[i]), (hv, self.hv[i]))):
            x = h.float().view(h.shape[0], G, -1)
            lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
            scale = ((hi - lo) / (2**self.bits - 1)).clamp_min(1e-8)
            q = ((x - lo) / scale).round().clamp(0, 2**self.bits - 1).to(torch.uint8).flatten(1)
            codes[:, pos] = packing.pack_codes(q, self.bits, check=False)  # no sync
            self.scales[i][2 * j, :, pos] = scale[..., 0].half()
            self.scales[i][2 * j + 1, :, pos] = lo[..., 0].half()

    def latents(self, i: int, n: int):
        """Layer i's first n cached tokens as the kernel reads them."""
        if not self.bits:
            return self.hk[i][:, :n], self.hv[i][:, :n]
        sc = self.scales[i][:, :, :n]
        return tuple(
            PackedLatents(codes[:, :n], sc[2 * j], sc[2 * j + 1], self.bits, None, None, self.stack.dtype)
            for j, codes in enumerate((self.hk[i], self.hv[i]))
        )

    def choose(self, kernel) -> None:
        """The flash-decoding kernel's settings (a tuple of :data:`TILING_FIELDS`, or with ``rotated`` of
        :data:`ROTATED_FIELDS`), ``"dispatch"`` (its defaults through the dispatcher, any device),
        ``"palu-scores"`` or, with ``rotated``, ``"sdpa"`` (torch's attention over the latents, its own
        choice of backend) or ``"sdpa-<backend>"`` (one of :data:`BACKENDS`)."""
        self.kernel = kernel
        self.stats = {}

    def bytes_per_token(self) -> int:
        return latent_bytes_per_token(self.stack, self.rank_k, self.rank, self.bits)

    def attention(self, i: int, h: torch.Tensor, pos: int, cos, sin) -> torch.Tensor:
        s, L, M = self.stack.shape, self.stack.layers[i], self.layers[i]
        B = h.shape[0]
        q = rope((h @ L["q"].T).view(B, s.H, s.D), cos[:, None], sin[:, None])
        if self.rotated:
            return self.rotated_attention(i, h, pos, q, cos, sin)
        self.write(i, pos, h @ M["k_down"].T, h @ M["v_down"].T)
        hk, hv = self.latents(i, pos + 1)
        positions = self.positions[:, : pos + 1]
        args = (q, hk, hv, M["weights"], positions, self.stack.inv_freq, 1.0, s.D**-0.5)
        if self.kernel == "dispatch":
            out = latent_decode_attention(*args)  # (B, Σ_g nq·r)
        elif isinstance(self.kernel, tuple):
            from lrkv_kernels.latent_rope.flash import latent_decode_attention_triton

            options = dict(zip(TILING_FIELDS, self.kernel, strict=False))
            for key in ("block_s", "heads_per_block", "n_splits"):  # 0: the kernel's default
                options[key] = options.get(key) or None
            for key in ("latent_scores", "hoist"):  # -1 or absent: the kernel's default
                flag = options.get(key, -1)
                options[key] = None if flag < 0 else bool(flag)
            out = latent_decode_attention_triton(
                *args, **options, unpack_words=self.unpack_words, stats=self.stats
            )  # fmt: skip
        elif self.bits:
            raise ValueError("Palu's scores kernel reads dense latents only")
        else:  # Palu's scores kernel per group, softmax and the value product in torch
            outs, G = [], s.Hkv // s.group
            nq = s.H // G
            for g, (_, cols_v, up, _) in enumerate(M["groups"]):
                cols_k = slice(g * self.rank_k, (g + 1) * self.rank_k)
                scores = latent_rope_scores(
                    q[:, g * nq : (g + 1) * nq, None], hk[..., cols_k], up, None, positions,
                    self.stack.inv_freq, 1.0, s.D**-0.5,
                )  # fmt: skip
                probs = torch.softmax(scores, dim=-1).to(hv.dtype)
                outs.append((probs @ hv[:, None, :, cols_v]).reshape(B, -1))
            out = torch.cat(outs, dim=-1)
        return out @ M["o"].T

    def rotated_attention(self, i: int, h: torch.Tensor, pos: int, q: torch.Tensor, cos, sin) -> torch.Tensor:
        """Keys rotated, then projected on each group's basis into the cache; queries absorbed; attention
        over the latents as a multi-query attention of head dim r (the kernel, or torch's SDPA)."""
        s, L, M = self.stack.shape, self.stack.layers[i], self.layers[i]
        B, G = h.shape[0], s.Hkv // s.group
        k = rope((h @ L["k"].T).view(B, s.Hkv, s.D), cos[:, None], sin[:, None]).view(B, G, -1)
        self.write(i, pos, torch.einsum("bgc,gcr->bgr", k, M["basis"]).flatten(1), h @ M["v_down"].T)
        q_abs = torch.einsum("bhd,hdr->bhr", q, M["absorb"])  # (B, H, r)
        hk, hv = self.latents(i, pos + 1)
        if isinstance(self.kernel, str) and self.kernel.startswith("sdpa"):  # "sdpa" or "sdpa-<backend>"
            if self.bits:
                raise ValueError("torch's attention reads dense latents only")
            keys, values = (x.unflatten(-1, (G, -1)).transpose(1, 2) for x in (hk, hv))  # (B, G, S, r)
            backend = self.kernel.partition("-")[2]
            with sdpa_kernel(BACKENDS[backend]) if backend else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(
                    q_abs[:, :, None], keys, values, scale=s.D**-0.5, enable_gqa=G != s.H
                )  # fmt: skip
            out = out.reshape(B, -1)
        elif isinstance(self.kernel, tuple):
            from lrkv_kernels.latent_rope.flash_absorbed import absorbed_decode_attention_triton

            options = {k: v or None for k, v in zip(ROTATED_FIELDS, self.kernel, strict=False)}
            options["num_warps"], options["num_stages"] = self.kernel[1], self.kernel[2]
            out = absorbed_decode_attention_triton(
                q_abs, hk, hv, M["weights"], s.D**-0.5, **options, unpack_words=self.unpack_words
            )  # fmt: skip
        else:
            out = absorbed_decode_attention(q_abs, hk, hv, M["weights"], s.D**-0.5)
        return out @ M["o"].T

    def step(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        cos, sin = self.stack.tables(pos, x.shape[0])
        for i, L in enumerate(self.stack.layers):
            x = self.stack.mlp_and_head(x, L, self.attention(i, rms_norm(x, L["ln1"]), pos, cos, sin))
        return self.stack.logits(x)


def latent_bytes_per_token(stack: Stack, rank_k: int, rank_v: int, bits: int) -> int:
    """Bytes of lrkv's cache per token (all layers, keys and values): latents in the model's dtype, or packed
    ``bits``-bit codes and a float16 scale and zero-point per group."""
    s = stack.shape
    G = s.Hkv // s.group
    if not bits:
        return s.layers * G * (rank_k + rank_v) * stack.embed.element_size()
    return s.layers * (sum(packing.packed_width(G * r, bits) for r in (rank_k, rank_v)) + 2 * 2 * G * 2)


def check_full_rank(device: torch.device, rotated: bool = False) -> float:
    """lrkv at full rank decodes a prefix token by token to the original's logits (float32)."""
    shape = SHAPES["tiny"] if device.type == "cpu" else SHAPES["smollm2"]
    stack = Stack(shape, device, torch.float32, seed=1)
    batch, steps = 2, 40
    orig = Original(stack, batch, steps, backend="default")  # float32: torch's own choice (not flash)
    lat = Latent(stack, shape.group * shape.D, batch, steps, rotated=rotated)
    ids = torch.randint(shape.vocab, (batch, steps), generator=torch.Generator().manual_seed(0)).to(device)
    worst = 0.0
    for t in range(steps):
        x = stack.embed[ids[:, t]]
        a, b = orig.step(x, t), lat.step(x, t)
        worst = max(worst, float((a - b).abs().max() / a.abs().max()))
    return worst


def check_rotated_kernel(device: torch.device, bits: int, dtype: torch.dtype, context: int = 3000) -> float:
    """Relative error of the rotated-keys kernel against its torch reference on a layer of random latents
    (SmolLM2's shape at half width; dense or packed ``bits``-bit codes) in ``dtype``."""
    from lrkv_kernels.latent_rope import absorbed_decode_attention_ref

    stack = Stack(SHAPES["smollm2"], device, dtype, seed=2)
    lat = Latent(stack, 96, 4, context, bits, rotated=True)
    lat.fill()
    hk, hv = lat.latents(0, context)
    q = torch.randn(4, stack.shape.H, 96, device=device, dtype=dtype)
    weights = lat.layers[0]["weights"]
    got = absorbed_decode_attention(q, hk, hv, weights, 0.125).double()
    ref = absorbed_decode_attention_ref(q, hk, hv, weights, 0.125).double()
    return float((got - ref).norm() / ref.norm())


def cuda_graph_ms(fn, steps: int, repeats: int) -> float:
    """Median milliseconds per call of ``fn`` (no arguments) captured in a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def emit(out, row: dict) -> None:
    print(json.dumps(row), flush=True)
    if out is not None:
        out.write(json.dumps(row) + "\n")
        out.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(set(SHAPES) - {"tiny"}), default="smollm2")
    ap.add_argument("--context", default="16384,32768,65536")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.5, help="lrkv's KV width over the original's")
    ap.add_argument("--key-ratio", type=float, default=None, help="the keys' width, if not --ratio")
    ap.add_argument("--group", type=int, default=None, help="KV heads per latent group (default: lrkv's)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bits", type=int, default=0, help="lrkv's latents quantized to 2, 3 or 4 bits (packed)")
    ap.add_argument(
        "--unpack", choices=("words", "codes"), default="words",
        help="packed codes read a word at a time (the kernels' default) or one code at a time",
    )  # fmt: skip
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="check,attention,step,serving")
    ap.add_argument("--device", default="cuda", help="cpu: only the full-rank check (Triton's interpreter)")
    ap.add_argument("--out", type=Path, default=None, help="append JSON rows here")
    ap.add_argument(
        "--keys", default="rebuilt,rotated",
        help="lrkv's key latents: rebuilt (projected before RoPE, keys rebuilt in the kernel), rotated "
        "(projected after RoPE, queries absorbed), or both",
    )  # fmt: skip
    ap.add_argument(
        "--tilings", default=None,
        help="the kernel's settings to time, e.g. '0,4,1;64,4,1,1,4,1' (tokens per tile (0: default), warps, "
        "stages[, scores in the latents' dtype (-1: default), KV heads per block (0: default), hoist B_k "
        "(-1: default), splits (0: default)]); default: TILINGS",
    )  # fmt: skip
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: --device cpu runs the full-rank check alone (the timings need a GPU)")
    parts = set(args.parts.split(","))
    out = args.out.open("a") if args.out else None
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    meta = dict(shape=args.shape, device=name, torch=torch.__version__, ratio=args.ratio, bits=args.bits)
    if args.bits:
        meta["unpack"] = args.unpack
    key_kinds = {"rebuilt": "lrkv", "rotated": "lrkv-rotated"}
    unknown = set(args.keys.split(",")) - set(key_kinds)
    if unknown:
        ap.error(f"--keys takes {' and/or '.join(key_kinds)}, got {', '.join(sorted(unknown))}")
    kinds = [key_kinds[keys] for keys in args.keys.split(",")]
    if "check" in parts:
        for kind in kinds:
            error = check_full_rank(device, rotated=kind == "lrkv-rotated")
            emit(out, dict(meta, part="full-rank check", model=kind, max_relative_logit_error=error))
        if "lrkv-rotated" in kinds and device.type == "cuda":
            for dtype in (torch.float32, torch.bfloat16):
                error = check_rotated_kernel(device, args.bits, dtype)
                emit(
                    out,
                    dict(meta, part="rotated kernel vs reference", dtype=str(dtype), relative_error=error),
                )
    if device.type != "cuda":
        return
    dtype = getattr(torch, args.dtype)
    shape = SHAPES[args.shape]
    if args.group:
        if shape.Hkv % args.group:
            ap.error(f"--group {args.group} does not divide the {shape.Hkv} KV heads")
        shape = replace(shape, group=args.group)
    meta["group"] = shape.group
    rank = int(args.ratio * shape.group * shape.D) // 8 * 8
    rank_k = int((args.key_ratio or args.ratio) * shape.group * shape.D) // 8 * 8
    meta["key_ratio"] = args.key_ratio or args.ratio
    contexts = [int(c) for c in args.context.split(",")]
    stack = Stack(shape, device, dtype)
    emit(out, dict(meta, part="device copy", gb_per_s=round(copy_bandwidth(device), 1)))
    best: dict[tuple[str, int], str] = {}  # each side's fastest attention at a context, for its steps
    steps: dict[tuple[str, int], float] = {}
    for kind in ("original", *kinds):
        if kind == "original":
            cache = Original(stack, args.batch, max(contexts) + 1)
        else:
            rotated = kind == "lrkv-rotated"
            cache = Latent(
                stack, rank, args.batch, max(contexts) + 1, args.bits, rotated, rank_k, args.unpack == "words"
            )  # fmt: skip
        cache.fill()
        x = stack.embed[torch.arange(args.batch, device=device)]
        for ctx in contexts:
            tilings = (
                TILINGS
                if not args.tilings
                else [tuple(map(int, t.split(","))) for t in args.tilings.split(";")]
            )
            if kind == "original":
                options = [*BACKENDS, "default"]
            elif kind == "lrkv-rotated":
                sdpa = ["sdpa", *(f"sdpa-{b}" for b in BACKENDS)]
                options = [*ROTATED_TILINGS] if args.bits else [*ROTATED_TILINGS, *sdpa]
            else:
                options = [*tilings] if args.bits else [*tilings, "palu-scores"]
            timed = {}
            if "attention" in parts:
                h = rms_norm(x, stack.layers[0]["ln1"])
                cos, sin = stack.tables(ctx, args.batch)
                for option in options:
                    cache.choose(option)
                    try:
                        ms = cuda_graph_ms(
                            partial(cache.attention, 0, h, ctx, cos, sin), args.steps * 5, args.repeats
                        )
                    except Exception as err:  # noqa: BLE001  (a backend or tiling that does not fit these inputs)
                        emit(
                            out,
                            dict(
                                meta,
                                part="one layer's attention",
                                model=kind,
                                kernel=str(option),
                                context=ctx,
                                error=str(err).splitlines()[0][:200],
                            ),
                        )
                        continue
                    timed[option] = ms
                    read = cache.bytes_per_token() // shape.layers * (ctx + 1) * args.batch
                    emit(
                        out,
                        dict(
                            meta,
                            part="one layer's attention",
                            model=kind,
                            kernel=str(option),
                            context=ctx,
                            batch=args.batch,
                            ms=round(ms, 4),
                            cache_gb_read=round(read / 1e9, 4),
                            cache_gb_per_s=round(read / ms / 1e6, 1),
                            **(dict(kernel_stats=dict(cache.stats)) if kind != "original" else {}),
                        ),
                    )
            fastest = min(timed, key=timed.get) if timed else options[0]
            best[kind, ctx] = str(fastest)
            if "step" in parts:
                cache.choose(fastest)
                ms = cuda_graph_ms(partial(cache.step, x, ctx), args.steps, args.repeats)
                steps[kind, ctx] = ms
                emit(
                    out,
                    dict(
                        meta,
                        part="decode step",
                        model=kind,
                        kernel=str(fastest),
                        context=ctx,
                        batch=args.batch,
                        ms=round(ms, 3),
                        kv_bytes_per_token=cache.bytes_per_token(),
                    ),
                )
        del cache
        torch.cuda.empty_cache()
    for kind in kinds:
        for ctx in contexts:
            if (kind, ctx) in steps:
                emit(
                    out,
                    dict(
                        meta,
                        part="decode step ratio",
                        model=kind,
                        context=ctx,
                        batch=args.batch,
                        lrkv_over_original=round(steps[kind, ctx] / steps["original", ctx], 3),
                    ),
                )
    if "serving" in parts:
        ctx = max(contexts)
        for kind in kinds:
            tiling = best.get((kind, ctx))
            original = best.get(("original", ctx), "flash")
            serving(stack, (rank_k, rank), ctx, original, tiling, args, meta, out, kind)


def serving(
    stack: Stack,
    ranks: tuple[int, int],
    ctx: int,
    backend: str,
    tiling,
    args,
    meta: dict,
    out,
    kind: str = "lrkv",
) -> None:
    """Within the memory the original's cache takes at ``--batch`` × ``ctx`` tokens, lrkv holds a larger
    batch: tokens/s of each at its own largest batch (a decode step of every row)."""
    orig = Original(stack, args.batch, ctx + 1)
    orig.choose(backend)
    per_token = orig.bytes_per_token()
    budget = per_token * (ctx + 1) * args.batch
    orig.fill()
    x = stack.embed[torch.arange(args.batch, device=stack.device)]
    ms_o = cuda_graph_ms(partial(orig.step, x, ctx), args.steps, args.repeats)
    del orig
    torch.cuda.empty_cache()
    s = stack.shape
    rank_k, rank = ranks
    latent_per_token = latent_bytes_per_token(stack, rank_k, rank, args.bits)
    batch_l = budget // (latent_per_token * (ctx + 1))
    lat = Latent(stack, rank, batch_l, ctx + 1, args.bits, kind == "lrkv-rotated", rank_k)
    if tiling is not None:
        lat.choose(eval(tiling) if tiling.startswith("(") else tiling)  # noqa: S307 (our own repr)
    lat.fill()
    x = stack.embed[torch.arange(batch_l, device=stack.device) % s.vocab]
    ms_l = cuda_graph_ms(partial(lat.step, x, ctx), args.steps, args.repeats)
    tps_o, tps_l = args.batch / ms_o * 1e3, batch_l / ms_l * 1e3
    emit(
        out,
        dict(
            meta,
            part="serving at a fixed cache budget",
            model=kind,
            context=ctx,
            cache_budget_gb=round(budget / 1e9, 2),
            original_batch=args.batch,
            original_ms=round(ms_o, 3),
            original_tokens_per_s=round(tps_o, 1),
            original_kv_bytes_per_token=per_token,
            lrkv_batch=int(batch_l),
            lrkv_ms=round(ms_l, 3),
            lrkv_kv_bytes_per_token=latent_per_token,
            lrkv_tokens_per_s=round(tps_l, 1),
            lrkv_over_original_tokens_per_s=round(tps_l / tps_o, 3),
        ),
    )


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a device-to-device copy of 2 GB (bytes read plus written), for the roofline."""
    a = torch.empty(2**30, device=device, dtype=torch.uint8)
    b = torch.empty_like(a)
    ms = cuda_graph_ms(partial(b.copy_, a), 10, 3)
    del a, b
    return 2 * 2**30 / ms / 1e6


if __name__ == "__main__":
    main()
