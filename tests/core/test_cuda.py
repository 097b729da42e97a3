"""The library on a CUDA device: statistics, decomposition, the default allocator and its refinement, fusion
and the latent cache all follow the model's device, and a model converted there behaves as on the CPU.

Skipped without a CUDA device (CI has none); run on a GPU machine with ``pytest tests/core/test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from lrkv_core.model.attention import set_fused_decode
from tests.support.inputs import greedy, ids_for, left_padded
from tests.support.latents import stepwise
from tests.support.models import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def convert(model, rows, **config):
    config = CompressionConfig(**({"group_size": 2, "rank_multiple": 1} | config))
    return plan_conversion(model, rows, config).apply(model)


@pytest.mark.parametrize("decomposition", ["whitened", "plain", "pca"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
def test_full_rank_on_cuda_reproduces_the_original(arch, decomposition):
    model = tiny_model(arch).double().cuda()
    ids = ids_for(3, 20).cuda()
    with torch.no_grad():
        ref = model(ids).logits
    rows = ids_for(8, 24, seed=3).cuda()
    comp = convert(model, rows, ratio=1.0, allocator="uniform", decomposition=decomposition)
    assert next(comp.parameters()).is_cuda
    with torch.no_grad():
        got = comp(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("allocator", ["kl", "fisher", "fisher-greedy", "eigen", "lorc"])
def test_allocators_on_cuda_give_the_cpu_conversion(allocator):
    """Statistics collected on the GPU (the default ``kl``'s gradients, refined on the rows' loss by one
    step; Palu's Fisher): the plan and the compressed logits are those of the same conversion on the CPU."""
    rows = ids_for(16, 24, seed=5)
    kw = dict(ratio=0.5, allocator=allocator, refine={"steps": 1})
    cpu = convert(tiny_model("llama", 2).double(), rows, **kw)
    gpu = convert(tiny_model("llama", 2).double().cuda(), rows.cuda(), **kw)
    assert gpu.config.lrkv["ranks_k"] == cpu.config.lrkv["ranks_k"]
    assert gpu.config.lrkv["ranks_v"] == cpu.config.lrkv["ranks_v"]
    ids = ids_for(2, 16)
    # HF computes RoPE tables in float32: CUDA's and the CPU's cos differ in the last bits
    with torch.no_grad():
        torch.testing.assert_close(gpu(ids.cuda()).logits.cpu(), cpu(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", [{"name": "dense"}, {"name": "quantized", "bits": 4}])
def test_generate_on_cuda_uses_the_fused_kernel(dtype, cache):
    """On CUDA a decode step takes the fused kernel by default; greedy generation from left-padded prompts
    equals the unfused path's (in float32; in bfloat16 the logits agree to its precision)."""
    model = tiny_model("llama", 2)
    comp = convert(model, ids_for(8, 24, seed=3), ratio=0.5, cache=cache).to("cuda", dtype)
    attn = set_fused_decode(comp, None)
    assert attn and all(m.decodes_fused(torch.zeros(1, 4, 1, 8, device="cuda", dtype=dtype)) for m in attn)
    ids, mask = (t.cuda() for t in left_padded((9, 4, 7)))
    fused = greedy(comp, ids, mask, max_new_tokens=12)
    set_fused_decode(comp, False)
    unfused = greedy(comp, ids, mask, max_new_tokens=12)
    stepped, _ = stepwise(comp, ids_for(2, 14).cuda(), prefix=4)
    set_fused_decode(comp, None)
    stepped_fused, _ = stepwise(comp, ids_for(2, 14).cuda(), prefix=4)
    if dtype == torch.float32:
        assert torch.equal(fused, unfused)
        torch.testing.assert_close(stepped_fused, stepped, rtol=1e-5, atol=1e-5)
    else:
        assert (stepped_fused.float() - stepped.float()).abs().max() < 0.1 * stepped.float().abs().max()


@pytest.mark.parametrize(
    "cache, kernel",
    [({"name": "dense"}, False), ({"name": "quantized", "bits": 3}, True)],
    ids=["dense", "3bit"],
)
def test_rotated_keys_on_cuda_decode_through_sdpa_or_the_kernel(monkeypatch, cache, kernel):
    """Latents of rotated keys in bfloat16 on CUDA: dense ones decode through torch's SDPA (faster there than
    the absorbed kernel), a quantized cache's packed codes through the kernel; generation agrees with the
    other path's (step by step) to bfloat16's precision, and the attention alone is timed on both, the
    one taken first."""
    import lrkv_core.model.attention_rotated as rotated_module
    from lrkv_core.evaluation import serving

    comp = convert(
        tiny_model("llama", 2), ids_for(8, 24, seed=3), ratio=0.5, allocator="uniform", rank_multiple=8,
        key_latents="rotated", cache=cache,
    ).to("cuda", torch.bfloat16)  # fmt: skip
    calls = []
    absorbed = rotated_module.absorbed_decode_attention
    monkeypatch.setattr(
        rotated_module, "absorbed_decode_attention", lambda *a, **k: calls.append(1) or absorbed(*a, **k)
    )
    ids, mask = (t.cuda() for t in left_padded((9, 4, 7)))
    greedy(comp, ids, mask, max_new_tokens=4)  # left-padded prompts: steps with a mask
    assert bool(calls) == kernel
    ids = ids_for(2, 14).cuda()
    chosen, _ = stepwise(comp, ids, prefix=4)
    set_fused_decode(comp, not kernel)
    other, _ = stepwise(comp, ids, prefix=4)
    set_fused_decode(comp, None)
    assert (chosen.float() - other.float()).abs().max() < 0.1 * other.float().abs().max()
    taken, beside = serving.measure_attention(
        comp, context=64, batch=2, copy_bytes_per_s=1e12, matmul_flop_per_s=1e12, steps=2, warmup=1
    )
    assert (taken.path, beside.path) == (("triton absorbed", "torch unfused")[:: 1 if kernel else -1])
    assert taken.taken and not beside.taken and taken.time_ms > 0 and beside.time_ms > 0
    assert beside.difference < 0.05  # the two paths agree to bfloat16's precision on this GPU


def test_pipeline_steps_on_cuda_give_the_cpu_results(tmp_path):
    """What the flow's tasks run with ``--device cuda``: a statistic, the evaluation (with KL against the
    original) and LoRA recovery compute on the GPU and give the CPU's numbers."""
    from lrkv_core.conversion import pipeline
    from lrkv_core.lora import recover_dir
    from lrkv_core.statistics import load_statistic
    from tests.support.models import tiny_model_dir, token_parquet

    model_dir = tiny_model_dir(tmp_path)
    calib = token_parquet(tmp_path / "calib.parquet", rows=12, seq_len=32)
    data = f"parquet:{calib}"
    grams = {}
    for device in ("cpu", "cuda"):
        pipeline.statistic_file(
            str(model_dir), str(calib), "gram", str(tmp_path / f"gram-{device}"), device=device
        )
        grams[device] = load_statistic(str(tmp_path / f"gram-{device}"), 0)
    torch.testing.assert_close(grams["cuda"], grams["cpu"], rtol=1e-5, atol=1e-4)

    rows = torch.randint(3, 64, (8, 24), generator=torch.Generator().manual_seed(1))
    comp = convert(tiny_model("llama", 2, vocab_size=64), rows, ratio=0.5)
    from lrkv_core import save_compressed

    out = save_compressed(comp, tmp_path / "compressed")
    kw = dict(seq_len=32, max_windows=4, decode_prefix=16, decode_windows=2, base_dir=str(model_dir))
    cpu = pipeline.evaluate_dir(str(out), data, device="cpu", **kw)
    gpu = pipeline.evaluate_dir(str(out), data, device="cuda", **kw)
    assert abs(gpu.prefill["nll"] - cpu.prefill["nll"]) < 1e-4
    assert abs(gpu.decode["nll"] - cpu.decode["nll"]) < 1e-4  # decode on the GPU: the fused kernel
    assert gpu.kv_bytes_per_token == cpu.kv_bytes_per_token
    assert abs(gpu.kl_to_base - cpu.kl_to_base) < 1e-5

    lora = dict(steps=3, r=4, batch_size=2, seq_len=16, eval_every=0, checkpoint_every=0)
    runs = {
        d: recover_dir(str(out), str(tmp_path / f"lora-{d}"), lora, dataset=data, device=d)
        for d in ("cpu", "cuda")
    }
    assert len(runs["cuda"]["history"]) == 3
    for a, b in zip(runs["cuda"]["history"], runs["cpu"]["history"]):
        assert abs(a["loss"] - b["loss"]) < 1e-3
