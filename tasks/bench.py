"""Prefect tasks of the bench flow: a data-free compressed version of a model, and one model's serving
measurements on the device the task runs on.

Measurements are cached like every other step, with the device they were taken on in the key (its name, the
torch build), so a re-run on the same machine is served from the store and a run on another device measures
again.
"""

from __future__ import annotations

import platform
from typing import Any

import torch
from prefect import task

from lrkv_core.conversion import pipeline
from lrkv_core.evaluation import serving
from lrkv_core.model.loading import load_model, parse_device

from .convert import CACHED, TASK_KEY, _local, _stored
from .device import model_pass, task_device
from .progress import note, step
from .store.artifacts import ArtifactRef


def device_identity(device: str) -> str:
    """What a measurement depends on besides the model: the device's name and the torch build."""
    dev = parse_device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = platform.processor() or platform.machine()
        name = f"{name}, {torch.get_num_threads()} threads"
    return f"{dev.type}: {name}; torch {torch.__version__}"


@task(name="bench_convert", cache_key_fn=TASK_KEY, **CACHED)
def bench_convert(
    model: ArtifactRef, ratio: float, bits: int | None, dtype: str, store: str, key_latents: str = "rebuilt"
) -> ArtifactRef:
    """A data-free compressed version of ``model`` (plain SVD, uniform ranks) at ``ratio``, with dense latents
    or ``bits``-bit rotated latents, of keys before RoPE (``key_latents="rebuilt"``) or after it
    (``"rotated"``): decode speed depends on the ranks, the storage and the keys' form, not on the plan."""
    label = f"r{ratio}" + (f"-{bits}bit" if bits else "")
    label += "-rotated-keys" if key_latents == "rotated" else ""
    with model_pass(), step(f"convert {label} (data-free)"):
        source = _local(model)
        return _stored(
            store, "model", "bench-models", "",
            lambda out: pipeline.convert_data_free_dir(
                source, out, ratio=ratio, bits=bits, dtype=dtype, key_latents=key_latents
            ),
        )  # fmt: skip


@task(name="bench_model", cache_key_fn=TASK_KEY, **CACHED)
def bench_model(
    model: ArtifactRef,
    label: str,
    contexts: list[int],
    batches: list[int],
    steps: int,
    warmup: int,
    dtype: str,
    device_id: str,
    store: str | None = None,
    static: bool = False,
    compiled: bool = False,
) -> dict[str, Any]:
    """Decode-step latency, prefill throughput, KV bytes and peak memory of one model at every context ×
    batch, on the task's device (``device_id`` names it, for the cache key and the record); over static
    caches, the decode step compiled, where asked (:func:`~lrkv_core.evaluation.serving.measure_point`)."""
    device = task_device()
    with model_pass(), step(f"bench {label}") as advance:
        loaded, _ = load_model(_local(model), dtype=dtype, device=device)
        points = serving.measure_grid(
            loaded, contexts, batches, steps=steps, warmup=warmup, static=static, compiled=compiled,
            progress=advance, on_point=lambda p: note(f"bench {label}: {p.line()}"),
        )  # fmt: skip
    return {
        "label": label,
        "device": device_id,
        "dtype": dtype,
        "static": static,
        "compiled": compiled,
        "points": [p.to_dict() for p in points],
    }


@task(name="bench_kernel", cache_key_fn=TASK_KEY, **CACHED)
def bench_kernel(
    model: ArtifactRef,
    label: str,
    contexts: list[int],
    batch: int,
    steps: int,
    warmup: int,
    dtype: str,
    device_id: str,
    store: str | None = None,
) -> dict[str, Any]:
    """One layer's decode attention alone at every context, against the copy bandwidth measured in the same
    task, on the task's device (``device_id`` names it, for the cache key and the record)."""
    device = task_device()
    with model_pass(), step(f"kernel {label}") as advance:
        loaded, _ = load_model(_local(model), dtype=dtype, device=device)
        points = serving.measure_kernels(
            loaded, contexts, batch, steps=steps, warmup=warmup, progress=advance,
            on_point=lambda p: note(f"kernel {label}: {p.line()}"),
        )  # fmt: skip
    return {"label": label, "device": device_id, "dtype": dtype, "points": [p.to_dict() for p in points]}
