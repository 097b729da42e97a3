"""Prefect tasks of the convert flow: resolve refs, one lrkv_core call, persist, return refs + metrics.

Every task returns an :class:`~lrkv_tasks.store.artifacts.ArtifactRef` (or a small dict of metrics) and is
cached on content fingerprints (:mod:`lrkv_tasks.keys`). Each task's parameters are only what its step reads,
so, for example, another allocator reuses the statistics and factors of an earlier run.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.futures import PrefectFuture

from lrkv_core.conversion import pipeline
from lrkv_core.conversion.steps import Step, statistic_inputs
from lrkv_core.model.loading import model_fingerprint, resolve_model_dir
from lrkv_core.statistics.precision import calibration_precision
from lrkv_core.system.fingerprint import hash_dir
from lrkv_core.system.openmp import release_thread_pool

from .device import model_pass, task_device
from .keys import calibration_key, resolve_key, task_key
from .progress import step
from .recipes.convert_recipe import LongEvalRecipe
from .records import checked
from .store.artifact_store import StoreIntegrityError, local_path, open_store
from .store.artifacts import ArtifactRef

_RUN_SECONDS: dict[uuid.UUID, float] = {}
_RUN_SECONDS_LOCK = threading.Lock()


def _note_run_time(task, task_run, state) -> None:
    """``on_completion`` hook: the task run's own run time (0 for a cache hit, which never runs)."""
    with _RUN_SECONDS_LOCK:
        _RUN_SECONDS[task_run.id] = task_run.total_run_time.total_seconds()


def _release_thread_pool(task, task_run, state) -> None:
    """``on_completion`` and ``on_failure`` hook, run in the task's thread: the thread's OpenMP workers go,
    so the tasks that compute next keep theirs spinning (:mod:`lrkv_core.system.openmp`)."""
    release_thread_pool()


def run_seconds(task_run_id: uuid.UUID, wait: float = 3.0) -> float | None:
    """Seconds the task run spent Running, as its engine measured them (None if unknown).

    A task run in this process noted them in its completion hook. One that ran elsewhere (a Dask worker)
    noted them there, so they are read from the Prefect API, which records the final state a moment after
    the worker reports it: asked again for up to ``wait`` seconds until the run shows as finished."""
    with _RUN_SECONDS_LOCK:
        if task_run_id in _RUN_SECONDS:
            return _RUN_SECONDS.pop(task_run_id)
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + wait
    with get_client(sync_client=True) as client:
        while True:
            try:
                run = client.read_task_run(task_run_id)
            except Exception:  # not recorded yet (404) or the API is briefly unavailable
                run = None
            if run is not None and run.state is not None and run.state.is_final():
                return run.total_run_time.total_seconds()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)


# results persist as JSON (never pickle) in the store, and a hit is checked before use (lrkv_tasks.records)
CACHED = {
    "persist_result": True,
    "result_serializer": "json",
    "cache_expiration": None,
    "on_completion": [_note_run_time, _release_thread_pool],
    "on_failure": [_release_thread_pool],
}
TASK_KEY = checked(task_key)


def _local(ref: ArtifactRef) -> str:
    """A local path of the artifact (downloaded and verified first when the store is remote)."""
    return str(local_path(ref.uri))


def _stats(stats: dict[str, ArtifactRef]) -> dict[str, str]:
    return {name: _local(ref) for name, ref in stats.items()}


def _stored(store: str, kind: str, folder: str, suffix: str, make: Callable[[str], dict]) -> ArtifactRef:
    """Run ``make(path)`` (one core call writing one file or directory at ``path``), then move what it
    wrote into the store under its content hash; the reference carries the metadata ``make`` returned."""
    st = open_store(store)
    with st.staging(suffix) as tmp:
        meta = make(str(tmp))
        path, digest = st.put(tmp, folder)
    return ArtifactRef(kind=kind, uri=path, sha256=digest, meta=meta)


@task(name="resolve_model", cache_key_fn=checked(resolve_key), **CACHED)
def resolve_model(ref: str, store: str | None = None) -> ArtifactRef:
    """Locate the model files and fingerprint them."""
    from transformers import AutoConfig

    from lrkv_core.model.adapters import get_adapter

    model_dir = resolve_model_dir(ref)
    config = AutoConfig.from_pretrained(str(model_dir))
    shape = get_adapter(config).shape(config)
    meta = {
        "ref": ref,
        "model_type": config.model_type,
        "shape": {"L": shape.L, "d": shape.d, "H": shape.H, "Hkv": shape.Hkv, "D": shape.D},
    }
    return ArtifactRef(
        kind="source-model", uri=str(model_dir), sha256=model_fingerprint(model_dir), meta=meta
    )


@task(name="extract_calibration", cache_key_fn=checked(calibration_key), **CACHED)
def extract_calibration(
    model: ArtifactRef, dataset: str, n_samples: int, seq_len: int, seed: int, store: str
) -> ArtifactRef:
    """Draw calibration windows and store them as Parquet."""
    st = open_store(store)
    with step(f"extract calibration from {dataset}"), st.staging(".parquet") as tmp:
        info = pipeline.calibrate(
            _local(model), dataset, n_samples=n_samples, seq_len=seq_len, seed=seed, out_path=str(tmp)
        )
        path, _ = st.put(tmp, "calibration")
    info.pop("path", None)
    return ArtifactRef(kind="calibration", uri=path, sha256=info.pop("fingerprint"), meta=info)


@task(
    name="collect_statistic",
    task_run_name="collect_statistic[{statistic[name]}]",
    cache_key_fn=TASK_KEY,
    **CACHED,
)
def collect_statistic(
    model: ArtifactRef,
    calib: ArtifactRef,
    statistic: dict,
    dtype: str,
    batch_size: int,
    store: str,
    layers: list[ArtifactRef] | None = None,
    precision: str = "float32",
) -> ArtifactRef:
    """One calibration statistic of every layer (Gram, Fisher, ...; ``layers``: the factors it reads;
    ``precision``: the passes' decoder stack's, :mod:`lrkv_core.statistics.precision`)."""
    return _collect(
        model, calib, statistic, dtype, batch_size, store, layers, "statistic", pipeline.statistic_file,
        precision=precision,
    )  # fmt: skip


def _collect(
    model, calib, statistic, dtype, batch_size, store, layers, kind, write, label="", *, precision, **where
) -> ArtifactRef:
    """Run ``write`` (a pipeline statistic writer, with ``where``: its shard) into the store."""
    pass_in = calibration_precision(precision)
    with model_pass(), pass_in, step(f"collect {statistic['name']}{label}") as advance:
        return _stored(
            store,
            kind,
            "statistics",
            ".safetensors",
            lambda out: write(
                _local(model),
                _local(calib),
                statistic,
                out,
                **where,
                dtype=dtype,
                device=task_device(),
                batch_size=batch_size,
                progress=advance,
                factors=[_local(f) for f in layers or ()],
            ),
        )


@task(
    name="collect_statistics",
    task_run_name="collect_statistics[{label}]",
    cache_key_fn=TASK_KEY,
    **CACHED,
)
def collect_statistics(
    model: ArtifactRef,
    calib: ArtifactRef,
    statistics: list[dict],
    label: str,
    dtype: str,
    batch_size: int,
    store: str,
    precision: str = "float32",
) -> dict[str, ArtifactRef]:
    """Several calibration statistics of every layer from one pass over their rows (``label``: their names,
    for the run's name); each statistic's file in the store, by name."""
    st = open_store(store)
    pass_in = calibration_precision(precision)
    with model_pass(), pass_in, step(f"collect {label} (one pass)") as advance, ExitStack() as stack:
        tmps = [stack.enter_context(st.staging(".safetensors")) for _ in statistics]
        metas = pipeline.statistics_files(
            _local(model),
            _local(calib),
            statistics,
            [str(t) for t in tmps],
            dtype=dtype,
            device=task_device(),
            batch_size=batch_size,
            progress=advance,
        )
        refs = {}
        for stat, tmp, meta in zip(statistics, tmps, metas, strict=True):
            path, digest = st.put(tmp, "statistics")
            refs[stat["name"]] = ArtifactRef(kind="statistic", uri=path, sha256=digest, meta=meta)
    return refs


@task(
    name="pick_statistic",
    task_run_name="pick_statistic[{name}]",
    cache_key_fn=TASK_KEY,
    **CACHED,
)
def pick_statistic(collected: dict[str, ArtifactRef], name: str) -> ArtifactRef:
    """One statistic's file among those a joint pass collected."""
    return collected[name]


@task(
    name="collect_statistic_shard",
    task_run_name="collect_statistic[{statistic[name]}/{shard}]",
    cache_key_fn=TASK_KEY,
    **CACHED,
)
def collect_statistic_shard(
    model: ArtifactRef,
    calib: ArtifactRef,
    statistic: dict,
    shard: int,
    count: int,
    dtype: str,
    batch_size: int,
    store: str,
    layers: list[ArtifactRef] | None = None,
    precision: str = "float32",
) -> ArtifactRef:
    """The sums of one calibration statistic over shard ``shard`` of ``count`` of its rows."""
    label = f" (shard {shard + 1} of {count})"
    write = pipeline.statistic_shard_file
    return _collect(
        model, calib, statistic, dtype, batch_size, store, layers, "statistic-shard", write, label,
        precision=precision, shard=shard, count=count,
    )  # fmt: skip


@task(
    name="merge_statistic",
    task_run_name="merge_statistic[{statistic[name]}]",
    cache_key_fn=TASK_KEY,
    **CACHED,
)
def merge_statistic(statistic: dict, shards: list[ArtifactRef], store: str) -> ArtifactRef:
    """One calibration statistic from the sums of all its shards: the values one pass over the rows gives."""
    with step(f"merge {statistic['name']} ({len(shards)} shards)"):
        return _stored(
            store,
            "statistic",
            "statistics",
            ".safetensors",
            lambda out: pipeline.merge_statistic_files([_local(s) for s in shards], out),
        )


@task(name="decompose_layer", cache_key_fn=TASK_KEY, **CACHED)
def decompose_layer(
    model: ArtifactRef,
    stats: dict[str, ArtifactRef],
    layer: int,
    group_size: int,
    decomposition: dict,
    store: str,
    key_latents: str = "rebuilt",
) -> ArtifactRef:
    """Full-spectrum factors of one layer's K and V, per group of KV heads (and its keys after RoPE)."""
    with step(f"decompose layer {layer}"):
        return _stored(
            store,
            "factors",
            "factors",
            ".safetensors",
            lambda out: pipeline.decompose_file(
                _local(model),
                _stats(stats),
                layer,
                out,
                group_size=group_size,
                decomposition=decomposition,
                key_latents=key_latents,
            ),
        )


@task(name="summarize_layer", cache_key_fn=TASK_KEY, **CACHED)
def summarize_layer(
    factors: ArtifactRef, stats: dict[str, ArtifactRef], features: list[str], store: str
) -> ArtifactRef:
    """The layer's spectra and the features the allocator reads (planning never loads factors)."""
    return _stored(
        store,
        "summary",
        "summaries",
        ".safetensors",
        lambda out: pipeline.summarize_file(_local(factors), _stats(stats), out, features=features),
    )


@task(name="plan_ranks", cache_key_fn=TASK_KEY, **CACHED)
def plan_ranks(
    model: ArtifactRef,
    summaries: list[ArtifactRef],
    ratio: float,
    group_size: int,
    rank_multiple: int,
    allocator: dict,
    store: str,
) -> ArtifactRef:
    """Allocate ranks for the target ratio; the plan is a JSON artifact plus a heatmap PNG."""
    with step("plan ranks"):
        plan = _stored(
            store,
            "plan",
            "plans",
            ".json",
            lambda out: pipeline.plan_file(
                _local(model),
                [_local(s) for s in summaries],
                out,
                ratio=ratio,
                group_size=group_size,
                rank_multiple=rank_multiple,
                allocator=allocator,
            ),
        )

    return _with_heatmap(plan, store)


def _with_heatmap(plan: ArtifactRef, store: str) -> ArtifactRef:
    """The plan's reference with its rank heatmap (a PNG in the store) in its metadata."""
    from lrkv_core.allocation import RankPlan

    from .tracking.plots import plot_rank_heatmap

    def draw(out: str) -> dict:
        plot_rank_heatmap(RankPlan.load(_local(plan)), out)
        return {"plan": plan.sha256}

    heatmap = _stored(store, "figure", "plans", ".png", draw)
    return plan.model_copy(update={"meta": plan.meta | {"heatmap": heatmap.uri}})


@task(name="refine_plan", cache_key_fn=TASK_KEY, **CACHED)
def refine_plan(
    model: ArtifactRef,
    calib: ArtifactRef,
    layers: list[ArtifactRef],
    plan: ArtifactRef,
    refine: dict,
    dtype: str,
    batch_size: int,
    store: str,
    precision: str = "float32",
) -> ArtifactRef:
    """Refine the allocator's plan on its measured objective over calibration rows (Gauss–Newton steps; the
    options of :class:`lrkv_core.conversion.refine.RefineConfig`)."""
    with model_pass(), calibration_precision(precision), step("refine plan") as advance:
        refined = _stored(
            store,
            "plan",
            "plans",
            ".json",
            lambda out: pipeline.refine_file(
                _local(model),
                _local(calib),
                [_local(f) for f in layers],
                _local(plan),
                out,
                refine,
                dtype=dtype,
                device=task_device(),
                batch_size=batch_size,
                progress=advance,
            ),
        )
    return _with_heatmap(refined, store)


@task(name="build_model", cache_key_fn=TASK_KEY, **CACHED)
def build_model(
    model: ArtifactRef,
    layers: list[ArtifactRef],
    plan: ArtifactRef,
    decomposition: dict,
    cache: dict,
    dtype: str,
    store: str,
    rotation: dict | None = None,
    attention: str | None = None,
) -> ArtifactRef:
    """Fuse factors (rotated) into the model, as the named attention kind, and save the compressed model
    directory."""
    with model_pass(), step("build model"):
        return _stored(
            store,
            "model",
            "models",
            "",
            lambda out: pipeline.build_file(
                _local(model),
                [_local(f) for f in layers],
                _local(plan),
                out,
                decomposition=decomposition,
                cache=cache,
                rotation=rotation,
                dtype=dtype,
                attention=attention,
            ),
        )


@dataclass(frozen=True)
class StepContext:
    """What every step of a conversion reads besides its own inputs: the source model and calibration
    (references or futures of them), the compute dtype, the calibration batch size and the artifact store;
    ``stored`` gives a task its result storage."""

    model: Any
    calib: Any
    dtype: str
    batch_size: int
    store: str
    stored: Callable[[Any], Any]
    precision: str = "float32"  # what the passes over the calibration rows compute the decoder stack in


def step_label(step: Step) -> str:
    """The name a step's task run has in the flow's timings and the Prefect UI."""
    p = step.params
    if step.kind == "statistics":
        return f"collect_statistics[{','.join(r['name'] for r in p['statistics'])}]"
    if step.kind == "pick":
        return f"pick_statistic[{p['statistic']['name']}]"
    if step.kind in ("statistic", "statistic_shard", "merge_statistic"):
        name = p["statistic"]["name"]
        if step.kind == "statistic_shard":
            return f"collect_statistic[{name}/{p['shard']}]"
        return f"{'merge' if step.kind == 'merge_statistic' else 'collect'}_statistic[{name}]"
    if step.kind in ("decompose", "summarize"):
        return f"{step.kind}_layer[{p['layer']}]"
    return {"plan": "plan_ranks", "refine": "refine_plan", "build": "build_model"}[step.kind]


def submit_step(step: Step, results: Mapping[str, Any], ctx: StepContext) -> PrefectFuture:
    """Submit ``step`` (of :func:`lrkv_core.conversion.steps.conversion_steps`) as its cached task;
    ``results`` maps the names of the steps it reads to their futures (or references), so the task starts when
    they are done."""
    p = step.params
    inputs = [results[name] for name in step.inputs]
    stats = {name: results[s] for name, s in statistic_inputs(step).items()}
    stored = ctx.stored
    if step.kind == "statistic":
        return stored(collect_statistic).submit(
            ctx.model, ctx.calib, p["statistic"], ctx.dtype, ctx.batch_size, ctx.store, layers=inputs or None,
            precision=ctx.precision,
        )  # fmt: skip
    if step.kind == "statistics":
        label = ",".join(r["name"] for r in p["statistics"])
        return stored(collect_statistics).submit(
            ctx.model, ctx.calib, p["statistics"], label, ctx.dtype, ctx.batch_size, ctx.store, ctx.precision
        )
    if step.kind == "pick":
        return stored(pick_statistic).submit(inputs[0], p["statistic"]["name"])
    if step.kind == "statistic_shard":
        args = (p["shard"], p["count"], ctx.dtype, ctx.batch_size, ctx.store)
        shard = stored(collect_statistic_shard)
        return shard.submit(
            ctx.model, ctx.calib, p["statistic"], *args, layers=inputs or None, precision=ctx.precision
        )
    if step.kind == "merge_statistic":
        return stored(merge_statistic).submit(p["statistic"], inputs, ctx.store)
    if step.kind == "decompose":
        args = (p["layer"], p["group_size"], p["decomposition"], ctx.store)
        key_latents = p.get("key_latents", "rebuilt")
        return stored(decompose_layer).submit(ctx.model, stats, *args, key_latents=key_latents)
    if step.kind == "summarize":
        return stored(summarize_layer).submit(inputs[0], stats, p["features"], ctx.store)
    if step.kind == "plan":
        args = (p["ratio"], p["group_size"], p["rank_multiple"], p["allocator"], ctx.store)
        return stored(plan_ranks).submit(ctx.model, inputs, *args)
    if step.kind == "refine":
        *layers, plan = inputs
        args = (p, ctx.dtype, ctx.batch_size, ctx.store, ctx.precision)
        return stored(refine_plan).submit(ctx.model, ctx.calib, layers, plan, *args)
    if step.kind == "build":
        *layers, plan = inputs
        return stored(build_model).submit(
            ctx.model,
            layers,
            plan,
            p["decomposition"],
            p["cache"],
            ctx.dtype,
            ctx.store,
            rotation=p["rotation"],
            attention=p.get("attention"),
        )
    raise ValueError(f"the convert flow has no task for {step.kind} steps")


def copy_model_dir(src: Path, dst: Path, sha256: str | None = None) -> Path:
    """Copy a model directory to ``dst`` atomically: into a uniquely named temporary sibling, checked against
    ``sha256`` (the content hash it must have) when given, then swapped in so that the old ``dst`` survives
    any crash (:func:`lrkv_core.system.files.replace_dir`). An existing ``dst`` is replaced only if it is an
    lrkv model directory (or empty)."""
    from lrkv_core.model.io import is_compressed_dir
    from lrkv_core.system.files import replace_dir

    if dst.exists() and any(dst.iterdir()) and not is_compressed_dir(dst):
        raise FileExistsError(f"{dst} exists and is not an lrkv model directory; refusing to overwrite it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        tmp = staging / dst.name
        shutil.copytree(src, tmp)
        if sha256 is not None and hash_dir(tmp) != sha256:
            raise StoreIntegrityError(f"the copy of {src} in {dst.parent} does not hash to {sha256[:12]}…")
        replace_dir(tmp, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dst


def export_is_current(built: ArtifactRef, out: str) -> bool:
    """Whether ``out`` already holds exactly the built model (else the flow refreshes the export)."""
    dst = Path(out)
    return dst.is_dir() and (dst / "config.json").is_file() and hash_dir(dst) == built.sha256


@task(name="export_model", cache_key_fn=TASK_KEY, **CACHED)
def export_model(built: ArtifactRef, out: str, store: str | None = None) -> ArtifactRef:
    """Copy the compressed model directory to the user's --out (checked against its sha256 before and after
    the copy; swapped in atomically)."""
    with step(f"export to {out}"):
        dst = copy_model_dir(Path(_local(built)), Path(out), built.sha256)
    return ArtifactRef(kind="export", uri=str(dst.resolve()), sha256=built.sha256)


@task(name="evaluate", cache_key_fn=TASK_KEY, **CACHED)
def evaluate(
    model: ArtifactRef,
    eval_cfg: dict,
    dtype: str,
    label: str,
    base: ArtifactRef | None = None,
    store: str | None = None,
) -> dict[str, Any]:
    """Prefill and decode perplexity, measured KV bytes/token, and KL against ``base`` when given."""
    with model_pass(), step(f"evaluate {label}") as advance:
        result = pipeline.evaluate_dir(
            _local(model),
            eval_cfg["dataset"],
            seq_len=eval_cfg["seq_len"],
            max_windows=eval_cfg["max_windows"],
            decode_prefix=eval_cfg["decode_prefix"],
            decode_windows=eval_cfg["decode_windows"],
            batch_size=eval_cfg["batch_size"],
            dtype=dtype,
            device=task_device(),
            base_dir=_local(base) if base else None,
            progress=advance,
        )
        return result.to_dict()  # a JSON record: EvalResult.from_dict reads it back


@task(name="evaluate_long", cache_key_fn=TASK_KEY, **CACHED)
def evaluate_long(
    model: ArtifactRef,
    dataset: str,
    long_cfg: dict,
    dtype: str,
    label: str,
    base: ArtifactRef | None = None,
    store: str | None = None,
) -> dict[str, Any]:
    """The long-context suite (``eval.long``) of ``model`` on ``dataset``: continuation NLL per context length
    and the retrieval grid, through the cache it deploys, with ``base`` (the original) on the same windows
    and prompts; :meth:`lrkv_core.evaluation.longcontext.LongContextResult.to_dict`."""
    protocol = LongEvalRecipe(**long_cfg).protocol(dataset)
    with model_pass(), step(f"long-context suite {label}") as advance:
        result = pipeline.evaluate_long_dir(
            _local(model),
            dataset,
            protocol,
            dtype=dtype,
            device=task_device(),
            base_dir=_local(base) if base else None,
            progress=advance,
        )
    return result.to_dict()
