"""The decode attention's roofline arithmetic (bytes and FLOPs of one step, counted by hand), the copy
bandwidth probe, and one layer's attention timed alone on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from lrkv_core.cache import LatentView
from lrkv_core.evaluation import serving
from tests.support.latents import filled_store


def test_dense_step_cost_by_hand() -> None:
    # B=2, S=10, H=4, Hkv=2, D=8, float32: K and V 2·2·2·10·8·4 B, q and out 2·(2·4·8·4) B
    cost = serving.dense_attention_cost(batch=2, context=10, heads=4, kv_heads=2, head_dim=8, itemsize=4)
    assert cost.bytes == 2560 + 512
    assert cost.flops == 4 * 2 * 4 * 10 * 8  # q·K and p·V, 2·S·D each per query head


def test_latent_step_cost_by_hand() -> None:
    # B=1, S=5, H=4, D=2, two groups of one KV head (nq = 2 query heads each), r_k = (3, 1), r_v = (2, 2)
    cost = serving.latent_attention_cost(
        batch=1, context=5, heads=4, head_dim=2, group_size=1, ranks_k=(3, 1), ranks_v=(2, 2),
        cache_bytes=100, weight_bytes=50, itemsize=2,
    )  # fmt: skip
    rebuild = 2 * 5 * 2 * 3 + 2 * 5 * 2 * 1  # 2·S·(s·D)·r_k per group
    scores = 2 * 4 * 5 * 2  # 2·S·D per query head
    values = 2 * (2 * 2 * 5 * 2)  # 2·S·r_v per query head, two heads per group
    assert cost.flops == rebuild + scores + values == 240
    assert cost.bytes == 100 + 50 + (4 * 2 + 2 * 4) * 2  # cache, weights, q (H·D) and out (nq·Σ r_v)


def test_view_bytes_count_latents_and_positions() -> None:
    h_k, h_v = torch.zeros(2, 5, 4), torch.zeros(2, 5, 6, dtype=torch.float16)
    positions = torch.zeros(2, 5, dtype=torch.int32)
    view = LatentView.from_latents(h_k, h_v, positions, (3, 1), (6,))
    assert serving.view_nbytes(view) == 2 * 5 * 4 * 4 + 2 * 5 * 6 * 2 + 2 * 5 * 4


def test_view_bytes_of_packed_latents_are_the_codes_and_scales() -> None:
    h = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(0))
    view = filled_store({"name": "quantized", "bits": 4}, h, h, [9]).view()
    assert view.packed is not None and view.positions is None
    codes = 2 * 9 * (16 * 4 // 8)  # per latent kind: 16 codes of 4 bits a token
    scales = 2 * 9 * 2 * 2  # scale and zero (float16) per token and quantization group
    groups = 2 + 1  # key groups (8, 8), one value group (16)
    assert serving.view_nbytes(view) == 2 * codes + groups * scales
    assert serving.view_nbytes(view) < serving.view_nbytes(LatentView(view.keys, view.values, None))


def test_copy_bandwidth_is_measured() -> None:
    bw = serving.copy_bandwidth(torch.device("cpu"), 1 << 20, steps=2, warmup=1)
    assert math.isfinite(bw) and bw > 0
    with pytest.raises(ValueError):
        serving.copy_bandwidth(torch.device("cpu"), 4)


ROOFS = dict(context=12, batch=2, copy_bytes_per_s=1e9, matmul_flop_per_s=1e9, steps=2, warmup=1)


def test_matmul_rate_is_measured() -> None:
    rate = serving.matmul_flops(torch.device("cpu"), torch.float32, 64, steps=2, warmup=1)
    assert math.isfinite(rate) and rate > 0
    with pytest.raises(ValueError, match="n ≥ 1"):
        serving.matmul_flops(torch.device("cpu"), torch.float32, 0)


def test_time_call_times_every_step() -> None:
    calls = []
    times = serving.time_call(lambda: calls.append(1), torch.device("cpu"), steps=3, warmup=2)
    assert len(times) == 3 and len(calls) == 5 and all(t >= 0 for t in times)


def test_attention_alone_counts_the_caches_it_reads(compress) -> None:
    """The original's SDPA reads its dense K/V; the compressed model's unfused CPU path (what its decode step
    takes here) reads its latents and key up-projections: fewer bytes at half rank; every figure measured."""
    from lrkv_core.model.attention import LatentAttention
    from tests.support.latents import tiny_compressed
    from tests.support.models import tiny_model

    original, comp = tiny_model(), tiny_compressed(compress)
    cfg = original.config
    D = cfg.hidden_size // cfg.num_attention_heads
    [dense] = serving.measure_attention(original, **ROOFS)
    expected = serving.dense_attention_cost(2, 12, cfg.num_attention_heads, cfg.num_key_value_heads, D, 4)
    assert dense.path == "torch sdpa" and (dense.bytes, dense.flops) == (expected.bytes, expected.flops)
    [latent] = serving.measure_attention(comp, **ROOFS)  # the kernel is not taken on the CPU
    layer = next(m for m in comp.modules() if isinstance(m, LatentAttention))
    cache = 2 * 12 * (sum(layer.layout.ranks_k) + sum(layer.layout.ranks_v)) * 4 + 2 * 12 * 4  # + positions
    weights = sum(p.numel() * 4 for up in layer.k_up for p in up.parameters())
    nq = cfg.num_attention_heads // len(layer.layout.ranks_k)
    io = 2 * (cfg.num_attention_heads * D + nq * sum(layer.layout.ranks_v)) * 4  # q in, output out
    assert latent.path == "torch unfused" and latent.bytes == cache + weights + io < dense.bytes
    for point in (dense, latent):
        row = point.to_dict()
        assert row["time_ms"] > 0 and row["fraction_of_copy"] == row["achieved_gb_per_s"] / 1.0
        assert math.isclose(row["fraction_of_matmul"], row["gflop_per_s"] / 1.0) and row["taken"]


@pytest.mark.parametrize("key_latents", ["rebuilt", "rotated"])
def test_where_the_step_takes_a_kernel_the_torch_path_is_timed_beside_it(key_latents) -> None:
    """With the kernel on (here in Triton's interpreter), the kernel's point is the one taken, and the
    unfused torch path over the same cache and with the same floor is timed beside it, its output compared
    with the kernel's; the module's choice is left as it was."""
    from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
    from lrkv_core.model.attention import set_fused_decode
    from tests.support.models import tiny_model

    rows = torch.randint(3, 61, (4, 16), generator=torch.Generator().manual_seed(0))
    options = dict(ratio=0.5, group_size=2, allocator="uniform", rank_multiple=2, key_latents=key_latents)
    comp = plan_conversion(tiny_model(), rows, CompressionConfig(**options)).apply(tiny_model())
    modules = set_fused_decode(comp, True)
    kernel, torch_path = serving.measure_attention(comp, **ROOFS)
    assert kernel.path == ("triton absorbed" if key_latents == "rotated" else "triton flash") and kernel.taken
    assert torch_path.path == "torch unfused" and not torch_path.taken
    assert kernel.difference is None and 0 <= torch_path.difference < 1e-5  # the same output, float32
    assert torch_path.line().startswith("context 12 × batch 2, torch unfused (not taken, output within ")
    assert (torch_path.bytes, torch_path.flops) == (kernel.bytes, kernel.flops)
    assert kernel.time_ms > 0 and torch_path.time_ms > 0
    assert all(m.fused_decode is True for m in modules)


def test_a_compressed_model_without_rope_gives_no_kernel_rows(compress) -> None:
    """OPT's latent attention folds B_k into q_proj and has no separate decode path: no rows, no error; the
    original OPT is measured as any dense model."""
    from tests.support.latents import tiny_compressed
    from tests.support.models import tiny_model

    kw = dict(batch=2, steps=1, warmup=0, copy_nbytes=1 << 16, matmul_n=16)
    assert serving.measure_kernels(tiny_compressed(compress, "opt"), [8], **kw) == []
    assert [p.path for p in serving.measure_kernels(tiny_model("opt", 4), [8], **kw)] == ["torch sdpa"]


def test_a_point_over_static_caches_holds_preallocated_buffers_and_can_compile_its_step(compress) -> None:
    """``static``: the original decodes over transformers' StaticCache, the compressed model over a
    StaticLatentCache (its hook swaps the empty static cache), each sized for the prefill and every step, and
    the bytes are those buffers; ``compiled``: the step through ``torch.compile`` (inductor on the CPU)."""
    from lrkv_core.model.attention import LatentAttention
    from tests.support.latents import tiny_compressed
    from tests.support.models import tiny_model

    original, comp = tiny_model(), tiny_compressed(compress)
    cfg = original.config
    D = cfg.hidden_size // cfg.num_attention_heads
    kwargs = dict(context=10, batch=2, steps=3, warmup=2)
    length = 10 + 2 + 3
    dense = serving.measure_point(original, static=True, **kwargs)
    counters = cfg.num_hidden_layers * 8  # each layer's int64 count of the tokens written
    buffers = cfg.num_hidden_layers * 2 * 2 * cfg.num_key_value_heads * length * D * 4
    assert dense.kv_bytes == buffers + counters
    latent = serving.measure_point(comp, static=True, **kwargs)
    layers = [m for m in comp.modules() if isinstance(m, LatentAttention)]
    widths = [sum(m.layout.ranks_k) + sum(m.layout.ranks_v) for m in layers]
    # float32 latents and int32 positions, for 15 tokens; a dynamic cache holds the 10 prefilled ones
    assert latent.kv_bytes == sum(2 * length * (4 * w + 4) for w in widths) + counters
    assert serving.measure_point(comp, **kwargs).kv_bytes == sum(2 * 10 * (4 * w + 4) for w in widths)
    for point in (dense, latent):
        assert point.decode_ms > 0 and point.prefill_tokens_per_s > 0
    torch._dynamo.reset()
    compiled = serving.measure_point(comp, static=True, compiled=True, **kwargs)
    assert compiled.kv_bytes == latent.kv_bytes and compiled.decode_ms > 0
    with pytest.raises(ValueError, match="needs a static cache"):
        serving.measure_point(comp, compiled=True, **kwargs)


def test_attention_alone_over_latents_of_rotated_keys_counts_no_rebuilt_keys(compress) -> None:
    """A rotated-keys conversion's decode attention is measured too: no positions read, and FLOPs that
    absorb the queries and score the latents instead of rebuilding keys."""
    from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
    from lrkv_core.model.attention_rotated import RotatedKeyAttention
    from tests.support.models import tiny_model

    model = tiny_model()
    rows = torch.randint(3, 61, (4, 16), generator=torch.Generator().manual_seed(0))
    options = dict(ratio=0.5, group_size=2, allocator="uniform", rank_multiple=2)
    config = CompressionConfig(**options, key_latents="rotated")
    comp = plan_conversion(model, rows, config).apply(model)
    layer = next(m for m in comp.modules() if isinstance(m, RotatedKeyAttention))
    cfg, (r_k,), (r_v,) = comp.config, layer.layout.ranks_k, layer.layout.ranks_v
    [point] = serving.measure_attention(comp, **ROOFS)
    H, D = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    cache = 2 * 12 * (r_k + r_v) * 4  # latents only: no positions
    io = 2 * (H * D + H * r_v) * 4
    up = layer.layout.group_size * D * r_k * 4  # B_k, which the queries absorb
    assert point.path == "torch unfused" and point.bytes == cache + up + io
    assert point.flops == 2 * (2 * H * D * r_k + 2 * H * 12 * r_k + 2 * H * 12 * r_v)
    kw = dict(steps=1, warmup=0, copy_nbytes=1 << 20, matmul_n=16)
    assert len(serving.measure_kernels(comp, [12], 2, **kw)) == 1
