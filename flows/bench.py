"""The bench flow: how fast a model and its compressed versions serve on one device, as cached tasks.

For the original model, a data-free compressed version at each ratio (dense latents, and ``bits``-bit rotated
latents when asked) for each form of the cached keys asked (``keys``: latents of the keys before RoPE, rebuilt
at every step, or after it, ``rotated``), and any compressed directories given, it measures on the flow's
device (``LRKV_DEVICE``): decode-step latency at every context (one batch size), prefill throughput, the KV
bytes the cache holds and peak memory (:mod:`lrkv_core.evaluation.serving`); then the serving trade: within
the memory the original's cache takes at the batch and the longest context, each compressed model runs the
largest batch that fits, and its tokens/s are set against the original's; and one layer's decode attention
alone at every context against its roofline (bytes and FLOPs of the step, a copy's bandwidth and a matrix
product's rate measured in the same task: :func:`~lrkv_core.evaluation.serving.measure_kernels`). Results are
logged to MLflow (tables, metrics, the JSON) and attached to the flow run as a markdown artifact; every
measurement is a cached task whose key names the device, so a re-run on the same machine is served from the
store.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from lrkv_core.decompositions import KEY_LATENTS
from lrkv_core.evaluation.serving import batch_within_budget, path_note
from lrkv_tasks import bench as b
from lrkv_tasks import convert as t
from lrkv_tasks.device import task_device
from lrkv_tasks.progress import note
from lrkv_tasks.recipes.convert_recipe import TrackingRecipe
from lrkv_tasks.recipes.preflight import bench_contexts, check_bench_models
from lrkv_tasks.store.artifact_store import open_store
from lrkv_tasks.tracking.mlflow_runs import close_run, log_results, open_run

from .convert import _record
from .runner import ConfiguredTaskRunner


@flow(name="lrkv-bench", log_prints=True, task_runner=ConfiguredTaskRunner())
def bench_flow(
    model: str,
    ratios: list[float] | None = None,
    bits: list[int] | None = None,
    compressed: list[str] | None = None,
    contexts: list[int] | None = None,
    batch: int = 8,
    steps: int = 16,
    warmup: int = 2,
    dtype: str = "float32",
    tracking: TrackingRecipe | None = None,
    store: str | None = None,
    static: bool = False,
    compiled: bool = False,
    keys: list[str] | None = None,
) -> dict:
    """Serving measurements of ``model`` and its compressed versions (see the module); ``static``: every
    model decodes over a preallocated cache, ``compiled``: its decode step compiled too; ``keys``: the forms
    of the cached keys the data-free versions take (``rebuilt``, the default, and/or ``rotated``)."""
    ratios = [0.5] if ratios is None else ratios
    keys = keys or ["rebuilt"]
    if not set(keys) <= set(KEY_LATENTS) or len(set(keys)) != len(keys):
        raise ValueError(f"keys must be distinct among {', '.join(KEY_LATENTS)}, got {keys}")
    contexts = bench_contexts(model, contexts, warmup + steps)  # the defaults the model's positions hold
    if batch < 1 or steps < 1 or warmup < 0 or not contexts or min(contexts) < 1:
        raise ValueError("batch, steps and every context must be ≥ 1 and warmup ≥ 0")
    if compiled and (not static or warmup < 1):
        raise ValueError("a compiled decode step needs static caches (static=True) and warmup ≥ 1")
    check_bench_models(model, compressed or [], keys, contexts[-1], warmup + steps)  # as the CLI does
    tracking = tracking or TrackingRecipe()
    st = open_store(store)
    root, storage = st.root, st.result_storage()

    def stored(task):
        return task.with_options(result_storage=storage)

    timings: list[dict] = []
    device_id = b.device_identity(task_device())
    original = _record(timings, "resolve_model", stored(t.resolve_model).submit(model, root))
    models = {"original": original}
    for key_latents in keys:
        for ratio in ratios:
            for nbits in [None, *(bits or [])]:
                label = f"lrkv r{ratio}" + (f" {nbits}-bit" if nbits else "")
                label += " rotated keys" if key_latents == "rotated" else ""
                future = stored(b.bench_convert).submit(original, ratio, nbits, dtype, root, key_latents)
                models[label] = _record(timings, f"bench_convert[{label}]", future)
    for path in compressed or []:
        models[f"lrkv {Path(path).name}"] = _record(
            timings, f"resolve_model[{path}]", stored(t.resolve_model).submit(path, root)
        )

    def measure(label: str, ctxs: list[int], batches: list[int]) -> dict:
        future = stored(b.bench_model).submit(
            models[label], label, ctxs, batches, steps, warmup, dtype, device_id, root, static, compiled
        )
        return _record(timings, f"bench_model[{label}, batch {','.join(map(str, batches))}]", future)

    # each model whole (its decode grid, then its batch at the original's cache budget) before the next, so
    # that a run stopped by a time limit has logged every figure of the models it reached
    longest, measured, rows, serving = contexts[-1], {}, [], []
    for label in models:
        measured[label] = measure(label, contexts, [batch])
        model_rows = _rows(label, measured, contexts, batch)
        rows += model_rows
        for r in model_rows if label != "original" else []:
            note(
                f"decode step of {label} at {r['context']} tokens, batch {batch}: "
                f"{r['decode_over_original']:.2f}× the original's"
            )
        base = _point(measured["original"], longest, batch)
        point = _point(measured[label], longest, batch)
        fits = batch_within_budget(base["kv_bytes"], point["kv_bytes_per_token"], longest)
        if fits != batch:
            point = _point(measure(label, [longest], [fits]), longest, fits)
        row = {
            "model": label,
            "batch": fits,
            "decode_ms": point["decode_ms"],
            "tokens_per_s": point["tokens_per_s"],
            "tokens_per_s_over_original": point["tokens_per_s"] / base["tokens_per_s"],
            "kv_bytes": point["kv_bytes"],
        }
        serving.append(row)
        note(
            f"serving {label} within the original's cache at {longest} tokens: batch {fits}, "
            f"{row['tokens_per_s']:.1f} tokens/s ({row['tokens_per_s_over_original']:.2f}× the original's)"
        )
    budget = base["kv_bytes"]
    kernel_rows = []
    for label in models:
        future = stored(b.bench_kernel).submit(
            models[label], label, contexts, batch, steps, warmup, dtype, device_id, root
        )
        kernel = _record(timings, f"bench_kernel[{label}]", future)
        kernel_rows += [{"model": label, **point} for point in kernel["points"]]
    result = {
        "device": device_id,
        "dtype": dtype,
        "contexts": contexts,
        "batch": batch,
        "steps": steps,
        "static": static,
        "compiled": compiled,
        "keys": keys,
        "rows": rows,
        "serving": {"context": longest, "cache_budget_bytes": budget, "rows": serving},
        "kernel": kernel_rows,
        "timings": timings,
    }
    markdown = bench_markdown(model, result)
    result["mlflow"] = _log(model, result, tracking)
    result["markdown"] = markdown
    create_markdown_artifact(markdown, key="lrkv-bench", description=f"lrkv serving benchmark of {model}")
    print(markdown)
    return result


def _point(measured: dict, context: int, batch: int) -> dict:
    return next(p for p in measured["points"] if p["context"] == context and p["batch"] == batch)


def _rows(label: str, measured: dict[str, dict], contexts: list[int], batch: int) -> list[dict]:
    """The decode table's rows of model ``label``, one per context, each against the original's step."""
    rows = []
    for context in contexts:
        p, base = _point(measured[label], context, batch), _point(measured["original"], context, batch)
        rows.append(
            {
                "model": label,
                "context": context,
                "batch": batch,
                "decode_ms": p["decode_ms"],
                "decode_over_original": p["decode_ms"] / base["decode_ms"],
                "tokens_per_s": p["tokens_per_s"],
                "prefill_tokens_per_s": p["prefill_tokens_per_s"],
                "kv_bytes_per_token": p["kv_bytes_per_token"],
                "peak_memory_bytes": p["peak_memory_bytes"],
            }
        )
    return rows


def _caches(result: dict) -> str:
    if not result.get("static"):
        return "dynamic caches"
    steps = "decode steps compiled" if result.get("compiled") else "decode steps not compiled"
    return f"static caches (KV bytes: the preallocated buffers), {steps}"


def bench_markdown(model: str, result: dict) -> str:
    """The decode table and the serving trade as markdown."""
    lines = [
        f"# lrkv bench: {model}",
        "",
        f"Device: {result['device']}; {result['dtype']}; batch {result['batch']}; median of "
        f"{result['steps']} decode steps per point; {_caches(result)}.",
        "",
        "| model | context | decode ms | × original | tokens/s | prefill tokens/s | KV B/token | peak MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['context']} | {r['decode_ms']:.3f} | {r['decode_over_original']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r['prefill_tokens_per_s']:.0f} | {r['kv_bytes_per_token']:.0f} | "
            f"{r['peak_memory_bytes'] / 2**20:.0f} |"
        )
    trade = result["serving"]
    lines += [
        "",
        f"Serving at the original's cache budget ({trade['cache_budget_bytes'] / 2**20:.1f} MiB at "
        f"{trade['context']} tokens):",
        "",
        "| model | batch | decode ms | tokens/s | × original |",
        "|---|---|---|---|---|",
    ]
    for r in trade["rows"]:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['decode_ms']:.3f} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s_over_original']:.2f} |"
        )
    lines += [
        "",
        "One layer's decode attention alone, against the bytes it must move (cache + key up-projections + "
        "queries and output) and a copy's bandwidth, and its FLOPs against a matrix product's rate, both "
        "measured in the same task; where a Triton kernel can run, the path the model's step does not take "
        "over the same cache is timed beside the one it takes (not taken):",
        "",
        "| model | context | path | µs | KB moved | GB/s | of copy | copy GB/s | GFLOP/s | of matmul | "
        "matmul GFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["kernel"]:
        lines.append(
            f"| {r['model']} | {r['context']} | {r['path']}{path_note(r['taken'], r.get('difference'))} | "
            f"{r['time_ms'] * 1e3:.1f} | "
            f"{r['bytes'] / 1e3:.1f} | {r['achieved_gb_per_s']:.3g} | {r['fraction_of_copy']:.3g} | "
            f"{r['copy_gb_per_s']:.3g} | {r['gflop_per_s']:.3g} | {r['fraction_of_matmul']:.3g} | "
            f"{r['matmul_gflop_per_s']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def _log(model: str, result: dict, tracking: TrackingRecipe) -> dict:
    """One MLflow run: the decode and serving tables, the headline ratios as metrics, the whole result."""
    from prefect.runtime import flow_run

    tags = {"lrkv.kind": "bench", "lrkv.model": model, "lrkv.device": result["device"]}
    tags["lrkv.prefect_flow_run"] = str(flow_run.id)
    run = open_run(tracking.mlflow_uri, tracking.experiment, f"bench-{Path(model).name}", tags)
    metrics = {}
    for r in result["rows"]:
        key = r["model"].replace(" ", "_")
        metrics[f"{key}.decode_ms.ctx{r['context']}"] = r["decode_ms"]
        metrics[f"{key}.decode_over_original.ctx{r['context']}"] = r["decode_over_original"]
    for r in result["serving"]["rows"]:
        metrics[f"{r['model'].replace(' ', '_')}.serving_tokens_per_s_over_original"] = r[
            "tokens_per_s_over_original"
        ]
    for r in (r for r in result["kernel"] if r["taken"]):  # the path each model's decode step takes
        key = f"{r['model'].replace(' ', '_')}.kernel_fraction_of_%s.ctx{r['context']}"
        metrics[key % "copy"], metrics[key % "matmul"] = r["fraction_of_copy"], r["fraction_of_matmul"]
    names = ("device", "dtype", "contexts", "batch", "steps", "static", "compiled", "keys")
    params = {k: result[k] for k in names} | {"model": model}
    try:
        log_results(
            run,
            params=params,
            metrics=metrics,
            json_artifacts={"bench.json": {k: v for k, v in result.items() if k != "timings"}},
            tables={"bench_decode.json": _columns(result["rows"]), "bench_serving.json": _columns(
                result["serving"]["rows"]
            ), "bench_kernel.json": _columns(result["kernel"])},
        )  # fmt: skip
    except BaseException:
        close_run(run, "FAILED")
        raise
    close_run(run, "FINISHED")
    return run


def _columns(rows: list[dict]) -> dict[str, list]:
    keys = dict.fromkeys(key for r in rows for key in r)  # every row's, in order (a cached row may lack one)
    return {key: [r.get(key) for r in rows] for key in keys}
