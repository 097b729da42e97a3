"""Prefect tasks of the convert flow: resolve refs, one lrkv_core call, persist, return refs + metrics.

Cache keys come from content fingerprints (model files, calibration tokens, artifact hashes), the
parameters that matter and the code version (the lrkv version plus a hash of the lrkv_core and lrkv_tasks
sources, so a changed algorithm never reuses results of the old one), so an identical re-run recomputes
nothing and a killed run resumes from the last finished task.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

import lrkv_core
from lrkv_core import pipeline
from lrkv_core.fingerprint import hash_dir, hash_json, hash_sources
from lrkv_core.models import model_fingerprint, resolve_model_dir

from .progress import step
from .store import LocalStore


@functools.cache
def code_version() -> str:
    """The lrkv version plus a fingerprint of the code that computes results (lrkv_core, lrkv_tasks)."""
    sources = hash_sources(Path(lrkv_core.__file__).parent, Path(__file__).parent)
    return f"{lrkv_core.__version__}+{sources[:16]}"


def _key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    """Cache key: task name + code version + the (fingerprint-carrying) parameters."""
    return hash_json({"task": ctx.task.name, "code": code_version(), "params": params})


def _stat_signature(path: Path) -> list:
    """Cheap identity of files (name, size, mtime) used to decide whether to re-hash them."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def _resolve_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    model_dir = resolve_model_dir(params["ref"])
    return hash_json({"task": "resolve_model", "dir": str(model_dir), "files": _stat_signature(model_dir)})


def _dataset_signature(dataset: str) -> object:
    kind, _, rest = dataset.partition(":")
    if kind in ("text", "parquet") and Path(rest).exists():
        return _stat_signature(Path(rest))
    return dataset


def _calib_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    return _key(ctx, {**params, "dataset_files": _dataset_signature(params["dataset"])})


def export_is_current(built: dict, out: str) -> bool:
    """Whether ``out`` already holds exactly the built model (else the flow refreshes the export)."""
    dst = Path(out)
    return dst.is_dir() and (dst / "config.json").is_file() and hash_dir(dst) == built["fingerprint"]


CACHED = {"persist_result": True, "cache_expiration": None}


@task(name="resolve_model", cache_key_fn=_resolve_key, **CACHED)
def resolve_model(ref: str) -> dict:
    """Locate the model files and fingerprint them."""
    from transformers import AutoConfig

    from lrkv_core.adapters import get_adapter

    model_dir = resolve_model_dir(ref)
    config = AutoConfig.from_pretrained(str(model_dir))
    shape = get_adapter(config).shape(config)
    return {
        "ref": ref,
        "dir": str(model_dir),
        "fingerprint": model_fingerprint(model_dir),
        "model_type": config.model_type,
        "shape": {"L": shape.L, "d": shape.d, "H": shape.H, "Hkv": shape.Hkv, "D": shape.D},
    }


@task(name="extract_calibration", cache_key_fn=_calib_key, **CACHED)
def extract_calibration(
    model: dict, dataset: str, n_samples: int, seq_len: int, seed: int, store: str
) -> dict:
    """Draw calibration windows and store them as Parquet."""
    st = LocalStore(store)
    with st.staging(".parquet") as tmp:
        info = pipeline.calibrate(
            model["dir"], dataset, n_samples=n_samples, seq_len=seq_len, seed=seed, out_path=str(tmp)
        )
        info["path"], _ = st.put(tmp, "calibration")
    return info


@task(name="collect_stats", cache_key_fn=_key, **CACHED)
def collect_stats(model: dict, calib: dict, dtype: str, batch_size: int, store: str) -> dict:
    """Per-layer Gram matrices of the k/v_proj inputs."""
    st = LocalStore(store)
    with st.staging(".safetensors") as tmp, step("collect stats") as advance:
        info = pipeline.stats_file(
            model["dir"], calib["path"], str(tmp), dtype=dtype, batch_size=batch_size, progress=advance
        )
        info["path"], info["sha256"] = st.put(tmp, "stats")
    return info


@task(name="decompose_layer", cache_key_fn=_key, **CACHED)
def decompose_layer(
    model: dict, stats: dict | None, layer: int, group_size: int, method: str, store: str
) -> dict:
    """Full-spectrum factors of one layer's K and V, per group of KV heads."""
    st = LocalStore(store)
    with st.staging(".safetensors") as tmp:
        info = pipeline.decompose_file(
            model["dir"],
            stats["path"] if stats else None,
            layer,
            str(tmp),
            group_size=group_size,
            method=method,
        )
        info["path"], info["sha256"] = st.put(tmp, "factors")
    return info


@task(name="collect_fisher", cache_key_fn=_key, **CACHED)
def collect_fisher(model: dict, calib: dict, dtype: str, batch_size: int, per_row: bool, store: str) -> dict:
    """Diagonal empirical Fisher of the k/v_proj weights (for Fisher-based rank allocation)."""
    st = LocalStore(store)
    with st.staging(".safetensors") as tmp, step("collect Fisher") as advance:
        info = pipeline.fisher_file(
            model["dir"],
            calib["path"],
            str(tmp),
            dtype=dtype,
            batch_size=batch_size,
            per_row=per_row,
            progress=advance,
        )
        info["path"], info["sha256"] = st.put(tmp, "fisher")
    return info


@task(name="plan_ranks", cache_key_fn=_key, **CACHED)
def plan_ranks(layers: list[dict], compression: dict, fisher: dict | None, store: str) -> dict:
    """Allocate ranks for the target ratio; the plan is a JSON artifact plus a heatmap PNG."""
    from lrkv_core.ranks import RankPlan

    from .plots import plot_rank_heatmap

    st = LocalStore(store)
    options = {"skip_threshold": compression["skip_threshold"]} if compression.get("skip_threshold") else None
    with st.staging(".json") as tmp:
        info = pipeline.plan_file(
            [f["path"] for f in layers],
            str(tmp),
            ratio=compression["ratio"],
            rank_multiple=compression["rank_multiple"],
            allocator=compression["allocator"],
            fisher_path=fisher["path"] if fisher else None,
            options=options,
        )
        plan = RankPlan.load(tmp)
        info["path"], info["sha256"] = st.put(tmp, "plans")
    with st.staging(".png") as png:
        plot_rank_heatmap(plan, png)
        info["heatmap"], _ = st.put(png, "plans")
    return info


@task(name="build_model", cache_key_fn=_key, **CACHED)
def build_model(model: dict, layers: list[dict], plan: dict, method: str, dtype: str, store: str) -> dict:
    """Fuse factors into the model and save the compressed model directory."""
    st = LocalStore(store)
    with st.staging() as tmp:
        info = pipeline.build_file(
            model["dir"], [f["path"] for f in layers], plan["path"], str(tmp), method=method, dtype=dtype
        )
        info["path"], info["fingerprint"] = st.put(tmp, "models")
    return info


@task(name="export_model", cache_key_fn=_key, **CACHED)
def export_model(built: dict, out: str) -> dict:
    """Copy the compressed model directory to the user's --out."""
    from lrkv_core.io import is_compressed_dir

    dst = Path(out)
    if dst.exists() and any(dst.iterdir()) and not is_compressed_dir(dst):
        raise FileExistsError(f"{dst} exists and is not an lrkv model directory; refusing to overwrite it")
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(built["path"], tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return {"path": str(dst.resolve())}


@task(name="evaluate", cache_key_fn=_key, **CACHED)
def evaluate(model: dict, eval_cfg: dict, dtype: str, label: str, base: dict | None = None) -> dict:
    """Prefill and decode perplexity, measured KV bytes/token, and KL against ``base`` when given."""
    with step(f"evaluate {label}") as advance:
        return pipeline.evaluate_dir(
            model["path"] if "path" in model else model["dir"],
            eval_cfg["dataset"],
            seq_len=eval_cfg["seq_len"],
            max_windows=eval_cfg["max_windows"],
            decode_prefix=eval_cfg["decode_prefix"],
            decode_windows=eval_cfg["decode_windows"],
            batch_size=eval_cfg["batch_size"],
            dtype=dtype,
            base_dir=base["dir"] if base else None,
            progress=advance,
        )


@task(name="log_run", cache_key_fn=_key, **CACHED)
def log_run(
    recipe: dict,
    model: dict,
    calib: dict,
    plan: dict,
    built: dict,
    base_eval: dict | None,
    eval_: dict | None,
) -> dict:
    """Log params, metrics and artifacts of the conversion to MLflow."""
    from .recipe import flatten
    from .tracking import log_conversion, versions

    params = {f"recipe.{k}": v for k, v in flatten(recipe).items()}
    params.update({f"version.{k}": v for k, v in versions().items()})
    params.update(
        {
            "fingerprint.model": model["fingerprint"],
            "fingerprint.calibration": calib["fingerprint"],
            "fingerprint.compressed": built["fingerprint"],
        }
    )
    metrics = {"target_ratio": plan["target_ratio"], "achieved_ratio": plan["achieved_ratio"]}
    evals = {"base": base_eval, "compressed": eval_}
    for label, ev in evals.items():
        if ev is None:
            continue
        metrics[f"{label}_prefill_ppl"] = ev["prefill"]["ppl"]
        metrics[f"{label}_decode_ppl"] = ev["decode"]["ppl"]
        metrics[f"{label}_kv_bytes_per_token"] = ev["kv"]["kv_bytes_per_token"]
        for task_name, task_metrics in ev.get("zeroshot", {}).get("results", {}).items():
            for metric, value in task_metrics.items():
                metrics[f"{label}_zeroshot.{task_name}.{metric}"] = value
    if eval_ and "kl" in eval_:
        metrics["kl_base_compressed"] = eval_["kl"]["kl"]
        metrics["top1_agreement"] = eval_["kl"]["top1_agreement"]
    if base_eval and eval_:
        metrics["kv_bytes_ratio"] = eval_["kv"]["kv_bytes_per_token"] / base_eval["kv"]["kv_bytes_per_token"]
    tracking = recipe["tracking"]
    return log_conversion(
        tracking_uri=tracking["mlflow_uri"],
        experiment=tracking["experiment"],
        run_name=f"convert-{Path(model['ref']).name}-r{recipe['compression']['ratio']}-g{recipe['compression']['group_size']}",
        params=params,
        metrics=metrics,
        json_artifacts={
            "eval.json": {k: v for k, v in evals.items() if v is not None},
            "rank_plan.json": json.loads(Path(plan["path"]).read_text()),
            "recipe.json": recipe,
        },
        file_artifacts={"rank_plan_heatmap.png": plan["heatmap"]},
        tags={"lrkv.method": recipe["compression"]["name"], "lrkv.model": model["ref"]},
    ) | {"metrics": metrics}
