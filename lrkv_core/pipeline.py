"""Path-level steps of a conversion: each reads its inputs from files and writes its output to a file.

These are the single core calls behind the Prefect tasks (and the CLI's direct commands), so the
tasks stay thin: resolve refs, call one function here, persist, return refs and small metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import evaluate
from .adapters import get_adapter
from .data import eval_windows, extract_calibration, read_token_rows
from .decompose import JOINT_QK, decompose_layer, load_layer_factors, save_layer_factors
from .fisher import collect_fisher, load_fisher, save_fisher
from .fuse import compress_model
from .io import model_card, save_compressed
from .models import load_model, load_tokenizer, read_kv_weights, read_tensors
from .ranks import RankPlan, plan_from_factors
from .stats import collect_gram, load_gram, save_grams

Progress = Callable[[int, int], None] | None


def calibrate(
    model_dir: str, dataset: str, *, n_samples: int, seq_len: int, seed: int, out_path: str
) -> dict:
    """Draw calibration windows with the model's tokenizer (:func:`lrkv_core.data.extract_calibration`)."""
    return extract_calibration(
        dataset, load_tokenizer(model_dir), n_samples=n_samples, seq_len=seq_len, seed=seed, out_path=out_path
    )


def stats_file(
    model_dir: str,
    calib_path: str,
    out_path: str,
    *,
    dtype: str = "float32",
    batch_size: int = 8,
    progress: Progress = None,
) -> dict:
    """Gram matrices of every layer's k/v_proj input, written as safetensors."""
    model, _ = load_model(model_dir, dtype=dtype)
    rows = read_token_rows(calib_path)  # (N, T)
    grams, n_tokens = collect_gram(model, rows, batch_size=batch_size, progress=progress)
    save_grams(grams, n_tokens, out_path)
    return {"path": out_path, "n_tokens": n_tokens, "layers": len(grams)}


def decompose_file(
    model_dir: str, stats_path: str | None, layer: int, out_path: str, *, group_size: int, method: str
) -> dict:
    """Full-spectrum factors of one layer (k and v, every group), written as safetensors."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    adapter = get_adapter(config)
    shape = adapter.shape(config)
    w_k, w_v = read_kv_weights(model_dir, adapter, layer)
    gram = load_gram(stats_path, layer) if stats_path else None
    w_q = None
    if method in JOINT_QK and not adapter.rope:  # Eigen Attention's non-RoPE path: joint K∪Q key basis
        name = adapter.weight_name(layer, "q") + ".weight"
        w_q = read_tensors(model_dir, [name])[name]
    factors = decompose_layer(
        layer,
        w_k,
        w_v,
        gram,
        n_kv_heads=shape.Hkv,
        head_dim=shape.D,
        group_size=group_size,
        method=method,
        w_q=w_q,
    )
    save_layer_factors(factors, out_path)
    top = {kind: [float(f.sigma[0]) for f in factors.groups[kind]] for kind in ("k", "v")}
    return {"path": out_path, "layer": layer, "info": factors.info, "sigma_max": top}


def fisher_file(
    model_dir: str,
    calib_path: str,
    out_path: str,
    *,
    dtype: str = "float32",
    batch_size: int = 8,
    per_row: bool = True,
    progress: Progress = None,
) -> dict:
    """Diagonal empirical Fisher of every layer's k/v_proj weights, written as safetensors."""
    model, _ = load_model(model_dir, dtype=dtype)
    rows = read_token_rows(calib_path)  # (N, T)
    fisher, n = collect_fisher(model, rows, batch_size=batch_size, per_row=per_row, progress=progress)
    save_fisher(fisher, n, out_path, per_row=per_row)
    return {"path": out_path, "n_samples": n, "per_row": per_row}


def plan_file(
    factor_paths: list[str],
    out_path: str,
    *,
    ratio: float,
    rank_multiple: int,
    allocator: str,
    fisher_path: str | None = None,
    options: dict | None = None,
) -> dict:
    """Allocate ranks from the layers' factors (and Fisher, for the allocators that use it); writes JSON."""
    factors = [load_layer_factors(p) for p in factor_paths]
    fisher = load_fisher(fisher_path)[0] if fisher_path else None
    plan = plan_from_factors(
        factors, ratio=ratio, rank_multiple=rank_multiple, allocator=allocator, fisher=fisher, options=options
    )
    plan.save(out_path)
    return {"path": out_path, "target_ratio": plan.target_ratio, "achieved_ratio": plan.achieved_ratio}


def build_file(
    model_dir: str,
    factor_paths: list[str],
    plan_path: str,
    out_dir: str,
    *,
    method: str,
    dtype: str = "float32",
) -> dict:
    """Fuse the factors into the model and save the compressed model directory."""
    model, tokenizer = load_model(model_dir, dtype=dtype)
    factors = [load_layer_factors(p) for p in factor_paths]
    plan = RankPlan.load(plan_path)
    compress_model(model, factors, plan, method)
    save_compressed(model, out_dir, tokenizer=tokenizer, card=model_card(model.config.lrkv, model_dir))
    return {"path": out_dir, "achieved_ratio": plan.achieved_ratio}


def evaluate_dir(
    model_dir: str,
    dataset: str,
    *,
    seq_len: int,
    max_windows: int | None,
    decode_prefix: int,
    decode_windows: int,
    batch_size: int = 8,
    dtype: str = "float32",
    base_dir: str | None = None,
    progress: Progress = None,
) -> dict[str, Any]:
    """Prefill PPL, teacher-forced decode PPL and measured KV bytes/token of a (compressed or base) model.

    With ``base_dir``, also KL(base ‖ model) per token and top-1 agreement on the prefill windows.
    """
    model, tokenizer = load_model(model_dir, dtype=dtype)
    windows = eval_windows(dataset, tokenizer, seq_len=seq_len, max_windows=max_windows)  # (N, T)
    if not 0 < decode_prefix < seq_len:
        raise ValueError(f"decode prefix {decode_prefix} must be inside the window (1..{seq_len - 1})")
    prefill = evaluate.prefill_perplexity(model, windows, batch_size=batch_size, progress=progress)
    decode = evaluate.decode_perplexity(
        model, windows[:decode_windows], prefix_len=decode_prefix, batch_size=batch_size, progress=progress
    )
    kv = evaluate.kv_bytes_per_token(model, windows)
    out = {"prefill": prefill, "decode": decode, "kv": kv}
    if base_dir is not None:
        base, _ = load_model(base_dir, dtype=dtype)
        out["kl"] = evaluate.kl_and_agreement(base, model, windows, batch_size=batch_size, progress=progress)
    for result in out.values():
        result["protocol"]["dataset"] = dataset
    return out | {"model": str(model_dir)}
