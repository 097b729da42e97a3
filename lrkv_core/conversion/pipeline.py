"""Path-level steps of a conversion: each reads its inputs from files and writes its output to a file.

These are the single core calls behind the Prefect tasks (and the CLI's direct commands), so the tasks stay
thin: resolve refs, call one function here, persist, return refs and small metrics. Each wraps the same
step of the in-memory API (:mod:`lrkv_core.convert`) with file I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig

from ..allocation import LayerSummary, RankPlan, plan_from_summaries, summarize_layer
from ..cache import CACHE_STORAGES, CacheStorage
from ..data.datasets import eval_windows, extract_calibration, read_token_rows, token_sequences, window_prefix
from ..decompositions import (
    DECOMPOSITIONS,
    LayerWeights,
    decompose_layer,
    load_layer_factors,
    save_layer_factors,
)
from ..evaluation import metrics
from ..evaluation.hf_quantized_cache import HfQuantizedCacheSpec
from ..evaluation.longcontext import LongContextProtocol, LongContextResult, evaluate_long_context
from ..format import LrkvFormat
from ..model.adapters import get_adapter
from ..model.attention_rotated import rotated_key_inputs
from ..model.fuse import compress_model
from ..model.io import model_card, save_compressed
from ..model.loading import load_model, load_tokenizer, read_tensors, share_equal_weights
from ..statistics import (
    STATISTICS,
    LayerValue,
    Statistic,
    load_partial,
    load_statistic,
    save_partial,
    save_statistic,
    shard_span,
)
from ..statistics.joint import collect_joint
from .refine import RefineConfig, refine_plan

Progress = Callable[[int, int], None] | None
StatPaths = Mapping[str, str]  # statistic name -> its file


def calibrate(
    model_dir: str, dataset: str, *, n_samples: int, seq_len: int, seed: int, out_path: str
) -> dict:
    """Draw calibration windows with the model's tokenizer
    (:func:`lrkv_core.data.datasets.extract_calibration`)."""
    return extract_calibration(
        dataset, load_tokenizer(model_dir), n_samples=n_samples, seq_len=seq_len, seed=seed, out_path=out_path
    )


def statistic_file(
    model_dir: str,
    calib_path: str,
    statistic: str | Mapping[str, Any],
    out_path: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    batch_size: int = 8,
    progress: Progress = None,
    factors: Sequence[str] = (),
) -> dict:
    """One calibration statistic of every layer (a registered :class:`~lrkv_core.statistics.Statistic`),
    collected with the model on ``device`` and saved from the CPU.

    ``factors``: every layer's factors file, in layer order, for a statistic that reads them."""
    stat, rows = _statistic_rows(calib_path, statistic, factors)
    model, extra = _statistic_model(model_dir, stat, factors, dtype=dtype, device=device)
    values, meta = stat.collect(model, rows, batch_size=batch_size, progress=progress, **extra)
    return _save_statistic(stat, values, meta, out_path)


def statistics_files(
    model_dir: str,
    calib_path: str,
    statistics: Sequence[str | Mapping[str, Any]],
    out_paths: Sequence[str],
    *,
    dtype: str = "float32",
    device: str = "cpu",
    batch_size: int = 8,
    progress: Progress = None,
) -> list[dict]:
    """Several calibration statistics of every layer from one pass over their rows
    (:func:`~lrkv_core.statistics.joint.collect_joint`), each saved to its file of ``out_paths`` as
    :func:`statistic_file` saves it."""
    if len(statistics) != len(out_paths):
        raise ValueError(f"{len(statistics)} statistics need as many files, got {len(out_paths)}")
    stats = [STATISTICS.create(s) for s in statistics]
    for stat in stats:
        if stat.uses_factors:
            raise ValueError(f"statistic {stat.name} reads the factors: it does not share a pass")
    model, _ = load_model(model_dir, dtype=dtype, device=device)
    collected = collect_joint(
        stats, model, read_token_rows(calib_path), batch_size=batch_size, progress=progress
    )
    return [
        _save_statistic(stat, values, meta, out)
        for stat, (values, meta), out in zip(stats, collected, out_paths, strict=True)
    ]


def statistic_shard_file(
    model_dir: str,
    calib_path: str,
    statistic: str | Mapping[str, Any],
    out_path: str,
    *,
    shard: int,
    count: int,
    dtype: str = "float32",
    device: str = "cpu",
    batch_size: int = 8,
    progress: Progress = None,
    factors: Sequence[str] = (),
) -> dict:
    """:func:`statistic_file` over shard ``shard`` of ``count`` of the statistic's rows (contiguous, the
    first ``units mod count`` shards one unit longer: :func:`~lrkv_core.statistics.shard_span`): its partial
    sums, saved for :func:`merge_statistic_files`. Every shard must use the same statistic, calibration,
    model, dtype, factors and (for a per-batch Fisher) batch size. Raises ``ValueError`` for an index outside
    ``0..count − 1`` or more shards than rows, before the model loads."""
    stat, rows = _statistic_rows(calib_path, statistic, factors)
    shard_span(stat.rows(rows).shape[0], (shard, count), stat.unit(batch_size))
    model, extra = _statistic_model(model_dir, stat, factors, dtype=dtype, device=device)
    part = stat.collect_shard(
        model, rows, shard=(shard, count), batch_size=batch_size, progress=progress, **extra
    )
    save_partial(part, out_path)
    return {
        "statistic": part.statistic,
        "layers": len(part.sums),
        "shard": list(part.shard),
        "span": list(part.span),
        **part.counts,
    }


def merge_statistic_files(partial_paths: Sequence[str], out_path: str) -> dict:
    """Add up the partial sums of every shard (:func:`statistic_shard_file`) into the statistic's file: the
    same header, values (up to the rounding of the order of additions) and summary as :func:`statistic_file`
    over all the rows. Raises ``ValueError`` unless the files are one statistic's, each shard once."""
    if not partial_paths:
        raise ValueError("merge_statistic_files needs the partial file of every shard, got none")
    parts = [load_partial(path) for path in partial_paths]
    stat = STATISTICS.create(parts[0].statistic)
    values, meta = stat.merge(parts)
    return _save_statistic(stat, values, meta, out_path)


def _statistic_rows(
    calib_path: str, statistic: str | Mapping[str, Any], factors: Sequence[str]
) -> tuple[Statistic, torch.Tensor]:
    """The statistic and every calibration row (N, T)."""
    stat = STATISTICS.create(statistic)
    if stat.uses_factors and not factors:
        raise ValueError(f"statistic {stat.name} reads the factors: give every layer's factors file")
    return stat, read_token_rows(calib_path)


def _statistic_model(
    model_dir: str, stat: Statistic, factors: Sequence[str], *, dtype: str, device: str
) -> tuple[nn.Module, dict[str, Any]]:
    """The model on ``device``, and the keyword arguments of ``collect`` beyond the rows (the factors)."""
    model, _ = load_model(model_dir, dtype=dtype, device=device)
    extra = {"factors": [load_layer_factors(path) for path in factors]} if stat.uses_factors else {}
    return model, extra


def _save_statistic(stat: Statistic, values: list[LayerValue], meta: dict[str, Any], out_path: str) -> dict:
    save_statistic(stat, values, meta, out_path)
    return {"statistic": stat.to_dict(), "layers": len(values), **meta}


def _layer_stats(stats: StatPaths, layer: int) -> dict[str, Any]:
    return {name: load_statistic(path, layer) for name, path in stats.items()}


def read_layer_weights(model_dir: str, layer: int, reads: Collection[str] = ()) -> LayerWeights:
    """The layer's k/v projection weights (and those of ``reads``: "q", "o"), read from the safetensors
    files without the model."""
    config = AutoConfig.from_pretrained(model_dir)
    adapter = get_adapter(config)
    names = {p: adapter.weight_name(layer, p) + ".weight" for p in {"k", "v", *reads}}
    t = read_tensors(model_dir, sorted(set(names.values())))  # Phi-3: one fused qkv_proj, sliced below
    return LayerWeights(**{p: t[name][adapter.rows(config, p)] for p, name in names.items()})


def decompose_file(
    model_dir: str,
    stats: StatPaths,
    layer: int,
    out_path: str,
    *,
    group_size: int,
    decomposition: str | Mapping[str, Any],
    key_latents: str = "rebuilt",
) -> dict:
    """Full-spectrum factors of one layer (k and v, every group; with ``key_latents: rotated`` also the keys
    after RoPE), written as safetensors."""
    config = AutoConfig.from_pretrained(model_dir)
    adapter = get_adapter(config)
    shape = adapter.shape(config)
    method = DECOMPOSITIONS.create(decomposition)
    extra, rotary_dim = rotated_key_inputs(adapter, config, key_latents)
    weights = read_layer_weights(model_dir, layer, method.reads(adapter.rope) | extra)
    factors = decompose_layer(
        layer,
        weights,
        _layer_stats(stats, layer),
        n_kv_heads=shape.Hkv,
        head_dim=shape.D,
        group_size=group_size,
        decomposition=method,
        key_latents=key_latents,
        rotary_dim=rotary_dim,
    )
    save_layer_factors(factors, out_path)
    top = {kind: [float(f.sigma[0]) for f in factors.groups[kind]] for kind in ("k", "v")}
    return {"layer": layer, "info": factors.info, "sigma_max": top}


def summarize_file(factors_path: str, stats: StatPaths, out_path: str, *, features: list[str]) -> dict:
    """The layer's spectra and the named features (a small artifact: planning never loads factors)."""
    factors = load_layer_factors(factors_path)
    summary = summarize_layer(factors, _layer_stats(stats, factors.layer), features)
    summary.save(out_path)
    return {"layer": factors.layer, "features": sorted(summary.features)}


def plan_file(
    model_dir: str,
    summary_paths: list[str],
    out_path: str,
    *,
    ratio: float,
    group_size: int,
    rank_multiple: int,
    allocator: str | Mapping[str, Any],
) -> dict:
    """Allocate ranks from the layers' summaries; writes the plan as JSON."""
    config = AutoConfig.from_pretrained(model_dir)
    plan = plan_from_summaries(
        [LayerSummary.load(p) for p in summary_paths],
        ratio=ratio,
        group_size=group_size,
        head_dim=get_adapter(config).shape(config).D,
        rank_multiple=rank_multiple,
        allocator=allocator,
    )
    plan.save(out_path)
    return {"target_ratio": plan.target_ratio, "achieved_ratio": plan.achieved_ratio, "kept": plan.kept}


def refine_file(
    model_dir: str,
    calib_path: str,
    factor_paths: list[str],
    plan_path: str,
    out_path: str,
    config: RefineConfig | Mapping[str, Any],
    *,
    dtype: str = "float32",
    device: str = "cpu",
    batch_size: int = 8,
    progress: Progress = None,
) -> dict:
    """Refine a plan as ``config`` says (:class:`lrkv_core.conversion.refine.RefineConfig`) on the calibration
    rows, the model on ``device``; the summary lists the objective's value for each kept plan under its
    name."""
    config = RefineConfig.create(config)
    objective = config.objective
    model, _ = load_model(model_dir, dtype=dtype, device=device)
    plan = refine_plan(
        model,
        [load_layer_factors(p) for p in factor_paths],
        RankPlan.load(plan_path),
        read_token_rows(calib_path),
        config,
        batch_size=batch_size,
        progress=progress,
    )
    plan.save(out_path)
    kept = [s[objective] for s in plan.details.get("refine", {}).get("steps", []) if s.get("kept", True)]
    return {
        "target_ratio": plan.target_ratio,
        "achieved_ratio": plan.achieved_ratio,
        "kept": plan.kept,
        "objective": objective,
        objective: kept,
    }


def build_file(
    model_dir: str,
    factor_paths: list[str],
    plan_path: str,
    out_dir: str,
    *,
    decomposition: str | Mapping[str, Any],
    cache: Mapping[str, Any] | None = None,
    rotation: Mapping[str, Any] | None = None,
    dtype: str = "float32",
    attention: str | None = None,
) -> dict:
    """Fuse the factors (rotated by ``rotation``) into the model, as the ``attention`` kind named (None: the
    architecture's), and save the compressed model directory."""
    model, tokenizer = load_model(model_dir, dtype=dtype)
    factors = [load_layer_factors(p) for p in factor_paths]
    plan = RankPlan.load(plan_path)
    decomposition = DECOMPOSITIONS.create(decomposition).to_dict()
    compress_model(
        model,
        factors,
        plan,
        decomposition=decomposition,
        cache=cache,
        rotation=rotation,
        attention=attention,
    )
    card = model_card(LrkvFormat.of(model.config), model_dir)
    save_compressed(model, out_dir, tokenizer=tokenizer, card=card)
    return {"achieved_ratio": plan.achieved_ratio}


def convert_data_free_dir(
    model_dir: str,
    out_dir: str,
    *,
    ratio: float,
    bits: int | None = None,
    dtype: str = "float32",
    key_latents: str = "rebuilt",
) -> dict:
    """A data-free compressed version of a model (plain SVD of the weights, uniform ranks, the default group
    size), with dense latents or, with ``bits``, quantized latents rotated first (``rotation: auto``), saved
    to ``out_dir``: what decode speed is measured on, since it depends on the ranks and the storage only.

    With ``key_latents="rotated"`` it caches latents of the keys after RoPE
    (:mod:`~lrkv_core.model.attention_rotated`), their RoPE-equivariant basis fitted to ``W_k`` and ``W_q``
    alone (the layer input's Gram taken as the identity): the ranks and shapes a calibrated basis has."""
    from .convert import CompressionConfig, convert

    model, tokenizer = load_model(model_dir, dtype=dtype)
    cache = {"name": "quantized", "bits": bits} if bits else "dense"
    config = CompressionConfig(
        ratio=ratio,
        decomposition="plain",
        allocator="uniform",
        cache=cache,
        rotation="auto" if bits else "none",
        key_latents=key_latents,
    )
    given = {}
    if key_latents == "rotated":  # the basis reads the input's Gram: the identity, for want of data
        shape = get_adapter(model.config).shape(model.config)
        given["gram"] = [torch.eye(shape.d, dtype=torch.float64) for _ in range(shape.L)]
    convert(model, None, config, statistics=given)
    card = model_card(LrkvFormat.of(model.config), model_dir)
    save_compressed(model, out_dir, tokenizer=tokenizer, card=card)
    return {"ratio": ratio, "bits": bits, "key_latents": key_latents}


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
    device: str = "cpu",
    base_dir: str | None = None,
    hf_quantized_cache: str | HfQuantizedCacheSpec | None = None,
    cache: str | Mapping[str, Any] | CacheStorage | None = None,
    progress: Progress = None,
) -> metrics.EvalResult:
    """Prefill PPL, teacher-forced decode PPL and measured KV bytes/token of a (compressed or base) model.

    With ``base_dir``, also KL(base ‖ model) per token and top-1 agreement on the prefill windows. With
    ``hf_quantized_cache`` (a spec or ``BACKEND:BITS[:GROUP[:RESIDUAL]]``), an original model is evaluated
    through transformers' ``QuantizedCache`` (:mod:`lrkv_core.evaluation.hf_quantized_cache`), the anchor for
    lrkv's quantized latent cache. With ``cache`` (a storage's name or recipe form), a compressed model is
    evaluated with that cache storage instead of the one it was saved with (:func:`use_cache_storage`). The
    models run on ``device``.
    """
    model, tokenizer = load_model(model_dir, dtype=dtype, device=device)
    storage = None if cache is None else use_cache_storage(model, cache)
    windows = eval_windows(dataset, tokenizer, seq_len=seq_len, max_windows=max_windows)  # (N, T)
    if not 0 < decode_prefix < seq_len:
        raise ValueError(f"decode prefix {decode_prefix} must be inside the window (1..{seq_len - 1})")
    spec = hf_quantized_cache
    if isinstance(spec, str):
        spec = HfQuantizedCacheSpec.parse(spec)
    factory = None if spec is None else functools.partial(spec.make, model.config)
    prefill = metrics.prefill_perplexity(
        model, windows, batch_size=batch_size, cache_factory=factory, progress=progress
    )
    decode = metrics.decode_perplexity(
        model,
        windows[:decode_windows],
        prefix_len=decode_prefix,
        batch_size=batch_size,
        cache_factory=factory,
        progress=progress,
    )
    kv = metrics.kv_bytes_per_token(model, windows, cache_factory=factory)
    out = {"prefill": prefill, "decode": decode, "kv": kv}
    if base_dir is not None:
        base, _ = load_model(base_dir, dtype=dtype, device=device)
        share_equal_weights(model, base)  # both held at once: the tensors they have in common, once
        out["kl"] = metrics.kl_and_agreement(base, model, windows, batch_size=batch_size, progress=progress)
    for result in out.values():
        result["protocol"]["dataset"] = dataset
        result["protocol"]["leading_tokens"] = window_prefix(dataset, tokenizer)
        if spec is not None:
            result["protocol"]["hf_quantized_cache"] = spec.to_dict()
        if storage is not None:
            result["protocol"]["cache"] = storage.to_dict()
    return metrics.EvalResult(model=str(model_dir), **out)


def evaluate_long_dir(
    model_dir: str,
    dataset: str,
    protocol: LongContextProtocol,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    base_dir: str | None = None,
    hf_quantized_cache: str | HfQuantizedCacheSpec | None = None,
    cache: str | Mapping[str, Any] | CacheStorage | None = None,
    progress: Progress = None,
) -> LongContextResult:
    """The long-context suite (:mod:`lrkv_core.evaluation.longcontext`) of a model on ``dataset``'s token
    stream, through the cache it deploys (``cache``: another storage; ``hf_quantized_cache``: transformers'
    QuantizedCache for an original model); with ``base_dir``, the original model on the same windows and
    prompts."""
    model, tokenizer = load_model(model_dir, dtype=dtype, device=device)
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer: the long-context suite builds prompts from text")
    storage = None if cache is None else use_cache_storage(model, cache)
    spec = hf_quantized_cache
    if isinstance(spec, str):
        spec = HfQuantizedCacheSpec.parse(spec)
    factory = None if spec is None else functools.partial(spec.make, model.config)
    base = None
    if base_dir is not None:
        base = load_model(base_dir, dtype=dtype, device=device)[0]
        share_equal_weights(model, base)
    used = storage.to_dict() if storage is not None else (spec.to_dict() if spec is not None else None)
    protocol = replace(protocol, dataset=dataset, cache=used)
    seqs = token_sequences(dataset, tokenizer)
    return evaluate_long_context(
        model, tokenizer, seqs, protocol, base=base, cache_factory=factory, progress=progress,
        prefix=window_prefix(dataset, tokenizer),
    )  # fmt: skip


def use_cache_storage(model, cache: str | Mapping[str, Any] | CacheStorage) -> CacheStorage:
    """Make a compressed ``model`` cache its latents with another storage strategy from now on (its weights
    do not change: a cache storage is a runtime policy). Raises ``ValueError`` for a model that is not
    compressed, an unknown storage or option, or options that cannot hold the model's ranks."""
    if not getattr(model.config, "lrkv", None):
        raise ValueError(
            "a cache storage applies to lrkv-compressed models only; this model has a dense KV cache"
        )
    storage = CACHE_STORAGES.create(cache)
    fmt = LrkvFormat.of(model.config)
    storage.check_ranks(sorted({r for layer in (*fmt.ranks_k, *fmt.ranks_v) for r in layer}))
    storage.check_rotation(fmt.rotation)
    model.config.lrkv["cache"] = storage.to_dict()
    return storage
