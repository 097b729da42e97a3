"""The ``lrkv`` command line: ``lrkv convert`` (the Prefect flow) and ``lrkv eval`` (direct)."""

from __future__ import annotations

import json
import logging
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml
from rich.markup import escape

from lrkv_tasks.device import ENV as DEVICE_ENV

from .cluster import ENV as DASK_ENV
from .ops_cli import register_operations, require_home
from .options import (
    cache_storage,
    csv_list,
    dask_option,
    device_option,
    flag_overrides,
    parse_group_size,
    parse_set,
    path_option,
    quantized_cache,
    store_root,
)
from .report import console, print_eval, print_summary, recipe_error, rich_progress
from .report import fail as _fail

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Low-rank KV-cache compression (Palu and friends)."
)
# what a user error looks like: one line, no traceback (FileExistsError/FileNotFoundError are OSErrors)
USER_ERRORS = (ValueError, OSError, KeyError)


def _choices(registry) -> str:
    return " | ".join(sorted(registry.names()))


def _registries():
    from lrkv_core.allocation import ALLOCATORS, DEFAULT_ALLOCATOR
    from lrkv_core.cache import CACHE_STORAGES
    from lrkv_core.decompositions import DECOMPOSITIONS

    return DECOMPOSITIONS, ALLOCATORS, DEFAULT_ALLOCATOR, CACHE_STORAGES


DECOMPOSITIONS, ALLOCATORS, DEFAULT_ALLOCATOR, CACHE_STORAGES = _registries()
DATASET_FORMS = (
    "hf:NAME[:CONFIG[:SPLIT]] | text:PATH | parquet:PATH | builtin:NAME:SPLIT, each optionally [A%:B%]"
)

# options shared by the commands
ModelOption = Annotated[Optional[str], typer.Option(help="hub id, local dir or builtin:NAME")]
DatasetOption = Annotated[
    Optional[str],
    typer.Option(help=f"calibration data: {DATASET_FORMS}; default: WikiText-2 (builtin models: their own)"),
]
EvalDatasetOption = Annotated[
    Optional[str],
    typer.Option(
        help="evaluation data (same forms); default: the held-out part of the calibration data; 'none' skips"
    ),
]
VerboseOption = Annotated[bool, typer.Option(help="show Prefect's logs")]
DeviceOption = Annotated[
    Optional[str],
    typer.Option(
        envvar=DEVICE_ENV,
        parser=device_option,
        metavar="cpu|cuda|cuda:N|auto",
        help="where models compute (statistics, refinement, evaluation, LoRA): auto takes the GPU when "
        "torch sees one; decompositions stay on the CPU in float64; default cpu",
    ),
]
DaskOption = Annotated[
    Optional[str],
    typer.Option(
        envvar=DASK_ENV,
        parser=dask_option,
        metavar="local[:N]|tcp://HOST:PORT",
        help="run the flow's tasks on Dask: local[:N] starts N worker processes here for this command "
        "(default N: the CPU count, at most 4); tcp://HOST:PORT uses a running scheduler, whose workers need "
        "lrkv and the same store (a shared directory or s3://); default: threads in this process",
    ),
]


def _cache_option(what: str, default: str):
    return Annotated[
        Optional[str],
        typer.Option(
            help=f"{what}, by name or as a YAML mapping of its options, e.g. '{{name: gear, bits: 2}}' "
            f"({_choices(CACHE_STORAGES)}); default: {default}",
            parser=cache_storage,
            metavar="NAME|{name: NAME, ...}",
        ),
    ]


def _set_option(example: str):
    return Annotated[
        Optional[list[str]], typer.Option("--set", help=f"recipe override, e.g. --set {example}")
    ]


def _configure_prefect(store: str | None, verbose: bool) -> None:
    """Settings Prefect reads at start-up; set before it is imported, and only where the user has not."""
    from lrkv_tasks.store import RESULTS, LocalStore, is_s3

    local = LocalStore(None if is_s3(store) else store).path  # tasks keep their results in the store itself
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(local / RESULTS))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not verbose:  # the CLI shows progress and reports failures itself; run logs still reach the API
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
        logging.getLogger("mlflow").setLevel(logging.WARNING)


@app.command()
def convert(
    recipe: Annotated[
        Optional[Path], path_option("--recipe", "YAML recipe (strict: unknown keys fail)", "FILE")
    ] = None,
    model: ModelOption = None,
    dataset: DatasetOption = None,
    eval_dataset: EvalDatasetOption = None,
    ratio: Annotated[
        Optional[float], typer.Option(help="compressed KV width / original (0.5 halves the cache)")
    ] = None,
    group_size: Annotated[
        Optional[str], typer.Option(help="KV heads per group: 1 = M-LRD, Hkv = J-LRD, auto = min(Hkv, 4)")
    ] = None,
    decomposition: Annotated[
        Optional[str], typer.Option(help=f"{_choices(DECOMPOSITIONS)}. {DECOMPOSITIONS.help()}")
    ] = None,
    allocator: Annotated[
        Optional[str],
        typer.Option(help=f"{_choices(ALLOCATORS)} (default {DEFAULT_ALLOCATOR}). {ALLOCATORS.help()}"),
    ] = None,
    rank_multiple: Annotated[
        Optional[int], typer.Option(help="round ranks down to a multiple of this")
    ] = None,
    refine_steps: Annotated[
        Optional[int],
        typer.Option(
            help="Gauss–Newton steps refining the plan on its measured objective (0: the allocator's plan; "
            "default: kl 3, the others 0)"
        ),
    ] = None,
    bits: Annotated[
        Optional[int],
        typer.Option(
            help="quantize the cached latents: 2, 3, 4 or 8 (packed integer codes, fp16 per-token scales and "
            "zero-points) or 16 (fp16 latents); sets compression.cache to the quantized storage"
        ),
    ] = None,
    quant_group_size: Annotated[
        Optional[int],
        typer.Option(help="latents per quantization group (must divide every rank); default: a whole group"),
    ] = None,
    residual_length: Annotated[
        Optional[int], typer.Option(help="newest tokens kept in full precision (KIVI's residual); default 0")
    ] = None,
    cache: _cache_option("the compressed model's cache storage (instead of --bits)", "dense latents") = None,
    rotation: Annotated[
        Optional[str],
        typer.Option(
            help="none | hadamard | auto: orthogonal rotation of each group's latents fused into the weights "
            "(spreads outliers before quantization; auto: Hadamard where the rank allows, else seeded random)"
        ),
    ] = None,
    n_samples: Annotated[Optional[int], typer.Option(help="calibration windows (default 256)")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="calibration and evaluation window length")] = None,
    out: Annotated[
        Optional[Path], path_option("--out", "write the compressed model directory here", "DIR")
    ] = None,
    store: Annotated[
        Optional[str],
        typer.Option(
            help="artifact store root: a directory or s3://bucket/prefix (default <LRKV_HOME>/store)",
            parser=store_root,
            metavar="DIR|s3://BUCKET/PREFIX",
        ),
    ] = None,
    mlflow_uri: Annotated[
        Optional[str], typer.Option(help="MLflow tracking URI (default local SQLite)")
    ] = None,
    lora: Annotated[
        Optional[bool],
        typer.Option(
            "--lora/--no-lora",
            help="LoRA recovery after compression, merged so the cache keeps its size (the recipe's lora: "
            "section, else its defaults: r′ 32, α 32, lr 2e-4, cosine, 200 steps on the calibration data)",
        ),
    ] = None,
    lora_steps: Annotated[Optional[int], typer.Option(help="LoRA optimizer steps (implies --lora)")] = None,
    set_: _set_option("eval.max_windows=8") = None,
    device: DeviceOption = None,
    dask: DaskOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Convert a model to a latent KV cache, evaluate it and log the run to MLflow."""
    from lrkv_tasks.recipe import load_recipe, read_yaml, recipe_yaml

    flags = {
        "model": model,
        "calibration.dataset": dataset,
        "compression.ratio": ratio,
        "compression.group_size": parse_group_size(group_size),
        "compression.decomposition": decomposition,
        "compression.allocator": allocator,
        "compression.rank_multiple": rank_multiple,
        "compression.refine.steps": refine_steps,
        "compression.cache": quantized_cache(bits, quant_group_size, residual_length, cache),
        "compression.rotation": rotation,
        "calibration.n_samples": n_samples,
        "calibration.seq_len": seq_len,
        "eval.seq_len": seq_len,
        "out": str(out) if out else None,
        "store": store,
        "tracking.mlflow_uri": mlflow_uri,
        "eval.dataset": eval_dataset,
    }
    overrides = flag_overrides(flags, "eval.dataset")
    if seq_len is not None:
        overrides.setdefault("eval.decode_prefix", seq_len // 2)
    overrides.update(parse_set(set_ or []))
    try:
        overrides = _lora_overrides(lora, lora_steps, read_yaml(recipe)) | overrides
        rec = load_recipe(recipe, overrides)
    except (ValueError, OSError, yaml.YAMLError) as e:  # pydantic (a ValueError), file and YAML errors
        raise _fail(f"invalid recipe: {recipe_error(e)}", 2) from None
    require_home()  # Prefect's and MLflow's local databases, logs and caches live there
    _configure_prefect(rec.store, verbose)
    try:
        _build_builtin(rec.model)
        from lrkv_tasks.preflight import prepare

        prepared = prepare(rec)  # everything cheap is checked before Prefect starts
    except USER_ERRORS as e:
        raise _fail(str(e)) from None
    console.print("[bold]recipe[/bold]\n" + escape(recipe_yaml(prepared.recipe)), soft_wrap=True)
    for note in prepared.notes:
        console.print(f"[cyan]note:[/cyan] {escape(note)}", soft_wrap=True)
    _use_device(device)
    with _dask(dask, prepared.recipe.store), _prefect_api() as supervise:
        from lrkv_flows.convert import convert_flow  # imports Prefect: after the cheap checks

        try:
            with supervise, rich_progress():
                result = convert_flow(prepared.recipe)
        except USER_ERRORS as e:
            raise _fail(str(e)) from None
    print_summary(result)


def _use_device(device: str | None) -> None:
    """``--device``: the tasks' ``LRKV_DEVICE`` for this command (set before a local Dask cluster starts, so
    its workers inherit it)."""
    if device:
        os.environ[DEVICE_ENV] = device
        console.print(f"models compute on {device}", soft_wrap=True)


def _lora_overrides(lora: bool | None, steps: int | None, recipe: dict) -> dict:
    """``--lora`` adds a default ``lora:`` section when the recipe has none; ``--no-lora`` removes it."""
    if lora is False:
        if steps is not None:
            raise typer.BadParameter("--lora-steps contradicts --no-lora")
        return {"lora": None}
    out = {}
    if (lora or steps is not None) and not recipe.get("lora"):
        out["lora"] = {}
    if steps is not None:
        out["lora.steps"] = steps
    return out


@contextmanager
def _prefect_api():
    """Connect to a Prefect API (a running server, else one this process owns: :mod:`lrkv_flows.apiserver`)
    and yield the context that runs a flow under signal handling (:mod:`lrkv_flows.interrupt`)."""
    from lrkv_flows.apiserver import connect
    from lrkv_flows.interrupt import supervised

    try:
        server = connect()
    except RuntimeError as e:
        raise _fail(str(e)) from None
    except KeyboardInterrupt:  # Ctrl-C while the API server starts: its set-up is left clean (apiserver.py)
        console.print("interrupted (SIGINT) while starting the Prefect API server")
        raise typer.Exit(130) from None
    try:
        yield supervised(server, lambda line: console.print(escape(line), soft_wrap=True))
    except KeyboardInterrupt:  # Ctrl-C outside the flow's own handlers (e.g. while its modules load)
        console.print("interrupted (SIGINT)")
        raise typer.Exit(130) from None
    finally:
        if server is not None:
            server.stop()


@contextmanager
def _dask(value: str | None, store: str | None):
    """``--dask``: the flow's tasks on a Dask cluster for the block (:mod:`lrkv_flows.cluster`)."""
    from lrkv_tasks.store import default_store_root, is_s3

    from .apiserver import running_services
    from .cluster import dask_cluster, parse_dask

    if value and parse_dask(value).address and not (os.environ.get("PREFECT_API_URL") or running_services()):
        raise _fail(
            f"--dask {value} needs a Prefect server its workers can reach: run `lrkv up` or set "
            "PREFECT_API_URL (the API this command would start for itself is on 127.0.0.1 and ends with it)"
        )
    with ExitStack() as stack:
        try:
            spec = stack.enter_context(dask_cluster(value))
        except OSError as e:
            raise _fail(str(e)) from None
        if spec is not None:
            console.print(f"tasks run on {spec.describe()}", soft_wrap=True)
        if spec is not None and spec.workers is None and not is_s3(store):
            where = escape(store or str(default_store_root()))
            console.print(
                f"[cyan]note:[/cyan] the Dask workers read and write the artifact store {where}: on other "
                "hosts it must be a directory they share, or s3:// (--store)",
                soft_wrap=True,
            )
        yield spec


def _build_builtin(model_ref: str) -> None:
    """A ``builtin:`` model is built here on first use (about two minutes), with a progress bar."""
    if not model_ref.startswith("builtin:"):
        return
    from lrkv_demo.builtin import ensure_builtin_model
    from lrkv_tasks.progress import step

    with rich_progress(), step(f"{model_ref} (built on first use)") as advance:
        name = model_ref.split(":", 1)[1]
        ensure_builtin_model(name, progress=lambda done, total, _loss: advance(done, total))


@app.command()
def ablate(
    recipe: Annotated[
        Optional[Path], path_option("--recipe", "YAML ablation recipe: base (convert recipe) + grid", "FILE")
    ] = None,
    model: ModelOption = None,
    dataset: DatasetOption = None,
    eval_dataset: EvalDatasetOption = None,
    decompositions: Annotated[
        Optional[str], typer.Option(help=f"comma list of {_choices(DECOMPOSITIONS)}")
    ] = None,
    group_sizes: Annotated[Optional[str], typer.Option(help="comma list, e.g. 1,2,auto")] = None,
    allocators: Annotated[Optional[str], typer.Option(help=f"comma list of {_choices(ALLOCATORS)}")] = None,
    ratios: Annotated[Optional[str], typer.Option(help="comma list, e.g. 0.7,0.5,0.3")] = None,
    out_dir: Annotated[
        Optional[Path], path_option("--out-dir", "write ablation.csv/.md/.png here", "DIR")
    ] = None,
    set_: _set_option("base.eval.max_windows=8") = None,
    device: DeviceOption = None,
    dask: DaskOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Run a grid of conversions on one model and write a comparison table, a plot and an MLflow run."""
    from lrkv_tasks.recipe import AblateRecipe, apply_overrides, read_yaml

    flags = {
        "base.model": model,
        "base.calibration.dataset": dataset,
        "base.eval.dataset": eval_dataset,
        "decompositions": csv_list(decompositions),
        "group_sizes": csv_list(group_sizes, parse_group_size),
        "allocators": csv_list(allocators),
        "ratios": csv_list(ratios, float),
    }
    overrides = flag_overrides(flags, "base.eval.dataset") | parse_set(set_ or [])
    try:
        rec = AblateRecipe.model_validate(apply_overrides(read_yaml(recipe), overrides))
    except (ValueError, OSError, yaml.YAMLError) as e:
        raise _fail(f"invalid recipe: {recipe_error(e)}", 2) from None
    require_home()  # Prefect's and MLflow's local databases, logs and caches live there
    _configure_prefect(rec.base.store, verbose)
    try:
        _build_builtin(rec.base.model)
    except USER_ERRORS as e:
        raise _fail(str(e)) from None
    _use_device(device)
    with _dask(dask, rec.base.store), _prefect_api() as supervise:
        from lrkv_flows.ablate import ablate_flow

        with supervise, rich_progress():
            result = ablate_flow(rec, str(out_dir) if out_dir else None)
    console.print(result["markdown"])
    run = result["mlflow"]
    console.print(f"wrote {result['dir']}; MLflow run {run['run_id']} at {run['tracking_uri']}")


@app.command()
def search(
    recipe: Annotated[
        Optional[Path], path_option("--recipe", "YAML search recipe: base (convert recipe) + search", "FILE")
    ] = None,
    model: ModelOption = None,
    dataset: DatasetOption = None,
    eval_dataset: EvalDatasetOption = None,
    max_ppl_rise: Annotated[
        Optional[str],
        typer.Option(help="prefill PPL rise over the original allowed: 1% or 0.01 (default 1%)"),
    ] = None,
    max_kl: Annotated[
        Optional[float], typer.Option(help="KL(original ‖ compressed) nats/token allowed")
    ] = None,
    ratios: Annotated[Optional[str], typer.Option(help="width ratios bisected per arm, comma list")] = None,
    bits: Annotated[
        Optional[str],
        typer.Option(
            help="cache storages searched, comma list: B (rotated B-bit latents) or dense (default 3,4,dense)"
        ),
    ] = None,
    allocators: Annotated[Optional[str], typer.Option(help=f"comma list of {_choices(ALLOCATORS)}")] = None,
    n_samples: Annotated[Optional[int], typer.Option(help="calibration windows (default 256)")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="calibration and evaluation window length")] = None,
    out: Annotated[Optional[Path], path_option("--out", "export the model found here", "DIR")] = None,
    out_dir: Annotated[
        Optional[Path], path_option("--out-dir", "write search.csv/.md and the Pareto plot here", "DIR")
    ] = None,
    store: Annotated[
        Optional[str],
        typer.Option(help="artifact store root", parser=store_root, metavar="DIR|s3://BUCKET/PREFIX"),
    ] = None,
    mlflow_uri: Annotated[
        Optional[str], typer.Option(help="MLflow tracking URI (default local SQLite)")
    ] = None,
    set_: _set_option("base.eval.max_windows=8") = None,
    device: DeviceOption = None,
    dask: DaskOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Find the smallest KV cache within a quality budget (bisection on the width ratio per cache storage and
    allocator), then convert, export and register it; logs the Pareto front to MLflow."""
    from lrkv_tasks.recipe import apply_overrides, read_yaml
    from lrkv_tasks.search_recipe import SearchRecipe

    try:
        rise = None if max_ppl_rise is None else _fraction(max_ppl_rise)
    except ValueError:
        raise _fail(f"invalid option: --max-ppl-rise takes 1% or 0.01, got {max_ppl_rise!r}", 2) from None
    try:
        caches = csv_list(bits, lambda b: "dense" if b == "dense" else {"name": "quantized", "bits": int(b)})
    except ValueError:
        raise _fail(f"invalid option: --bits takes e.g. 3,4,dense, got {bits!r}", 2) from None
    flags = {
        "base.model": model,
        "base.calibration.dataset": dataset,
        "base.eval.dataset": eval_dataset,
        "base.calibration.n_samples": n_samples,
        "base.calibration.seq_len": seq_len,
        "base.eval.seq_len": seq_len,
        "base.eval.decode_prefix": seq_len // 2 if seq_len else None,
        "base.out": str(out) if out else None,
        "base.store": store,
        "base.tracking.mlflow_uri": mlflow_uri,
        "search.max_ppl_rise": rise,
        "search.max_kl": max_kl,
        "search.ratios": csv_list(ratios, float),
        "search.caches": caches,
        "search.allocators": csv_list(allocators),
    }
    overrides = flag_overrides(flags, "base.eval.dataset") | parse_set(set_ or [])
    try:
        rec = SearchRecipe.model_validate(apply_overrides(read_yaml(recipe), overrides))
    except (ValueError, OSError, yaml.YAMLError) as e:
        raise _fail(f"invalid recipe: {recipe_error(e)}", 2) from None
    require_home()
    _configure_prefect(rec.base.store, verbose)
    try:
        _build_builtin(rec.base.model)
    except USER_ERRORS as e:
        raise _fail(str(e)) from None
    _use_device(device)
    with _dask(dask, rec.base.store), _prefect_api() as supervise:
        from lrkv_flows.search import search_flow

        try:
            with supervise, rich_progress():
                result = search_flow(rec, str(out_dir) if out_dir else None)
        except USER_ERRORS as e:
            raise _fail(str(e)) from None
    console.print(result["summary"]["markdown"], markup=False, highlight=False, soft_wrap=True)
    print_summary(result["winner"])


def _fraction(text: str) -> float:
    """``1%`` or ``0.01`` as 0.01."""
    return float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)


@app.command()
def bench(
    model: Annotated[str, typer.Option(help="the original model: hub id, local dir or builtin:NAME")],
    ratios: Annotated[
        str, typer.Option(help="KV width ratios of the data-free compressed versions measured, comma list")
    ] = "0.5",
    bits: Annotated[
        Optional[str], typer.Option(help="also each ratio with B-bit rotated latents, comma list (2,3,4,8)")
    ] = None,
    compressed: Annotated[
        Optional[list[str]], typer.Option(help="a compressed model directory to measure too (repeatable)")
    ] = None,
    contexts: Annotated[str, typer.Option(help="context lengths, comma list")] = "1024,4096,16384",
    batch: Annotated[int, typer.Option(help="sequences decoded together")] = 8,
    steps: Annotated[int, typer.Option(help="timed decode steps per point (their median is reported)")] = 16,
    warmup: Annotated[int, typer.Option(help="untimed decode steps before them")] = 2,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "float32",
    experiment: Annotated[str, typer.Option(help="MLflow experiment")] = "lrkv",
    store: Annotated[Optional[str], typer.Option(help="artifact store (default $LRKV_HOME/store)")] = None,
    json_out: Annotated[
        Optional[Path], path_option("--json-out", "write the result JSON here", "FILE")
    ] = None,
    device: DeviceOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Measure serving speed (decode-step latency by context, prefill throughput, KV bytes, peak memory, and
    tokens/s at the original's cache budget) of a model and its compressed versions, as cached Prefect
    tasks logged to MLflow."""
    from lrkv_tasks.recipe import TrackingRecipe

    try:
        ratio_list, context_list = csv_list(ratios, float), csv_list(contexts, int)
        bit_list = csv_list(bits, int) or []
    except ValueError as e:
        raise _fail(f"invalid option: {e}", 2) from None
    bad_bits = any(b not in (2, 3, 4, 8) for b in bit_list)
    if not ratio_list or any(not 0 < r <= 1 for r in ratio_list) or bad_bits:
        raise _fail("--ratios must be in (0, 1] and --bits among 2, 3, 4, 8", 2)
    if not context_list or min(context_list) < 1 or batch < 1 or steps < 1 or warmup < 0:
        raise _fail("--contexts, --batch and --steps must be ≥ 1 and --warmup ≥ 0", 2)
    require_home()
    _configure_prefect(store, verbose)
    try:
        _build_builtin(model)
    except USER_ERRORS as e:
        raise _fail(str(e)) from None
    _use_device(device)
    with _prefect_api() as supervise:
        from lrkv_flows.bench import bench_flow

        with supervise, rich_progress():
            try:
                result = bench_flow(
                    model, ratio_list, bit_list, compressed, context_list, batch, steps, warmup, dtype,
                    TrackingRecipe(experiment=experiment), store,
                )  # fmt: skip
            except USER_ERRORS as e:
                raise _fail(str(e)) from None
    console.print(result["markdown"])
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({k: v for k, v in result.items() if k != "markdown"}, indent=2))
        console.print(f"wrote {json_out}")
    run = result["mlflow"]
    console.print(f"MLflow run {run['run_id']} at {run['tracking_uri']}")


@app.command("eval")
def eval_cmd(
    model_dir: Annotated[str, typer.Argument(help="compressed model dir (or any supported model)")],
    dataset: Annotated[str, typer.Option(help=DATASET_FORMS)],
    seq_len: int = 256,
    max_windows: Optional[int] = None,
    decode_prefix: Optional[int] = None,
    decode_windows: int = 16,
    batch_size: int = 8,
    json_out: Annotated[
        Optional[Path], path_option("--json-out", "write the result JSON here", "FILE")
    ] = None,
    base: Annotated[
        Optional[str], typer.Option(help="the original model: adds KL(base ‖ model) and top-1 agreement")
    ] = None,
    tasks: Annotated[Optional[str], typer.Option(help="lm-eval zero-shot tasks, comma list")] = None,
    tasks_path: Annotated[
        Optional[Path], path_option("--tasks-path", "directory of local lm-eval task YAMLs", "DIR")
    ] = None,
    limit: Annotated[Optional[int], typer.Option(help="documents per zero-shot task")] = None,
    hf_quant_cache: Annotated[
        Optional[str],
        typer.Option(
            help="evaluate an original model through transformers' QuantizedCache, the anchor for lrkv's "
            "quantized cache: BACKEND:BITS[:GROUP[:RESIDUAL]], e.g. hqq:4 (hqq: 2/3/4/8 bits, quanto: 2/4; "
            "per-token groups, default group = head dim, residual 0); needs `pip install 'lrkv\\[anchor]'`"
        ),
    ] = None,
    cache: _cache_option(
        "evaluate a compressed model with another cache storage", "the one it was saved with"
    ) = None,
    device: DeviceOption = None,
    suite: Annotated[
        str,
        typer.Option(
            help="standard: prefill/decode PPL, KV bytes; long: continuation NLL after long contexts and "
            "needle retrieval through the model's cache (--lengths, --depths, --samples, --continuation)"
        ),
    ] = "standard",
    lengths: Annotated[
        Optional[str], typer.Option(help="--suite long: context/prompt lengths (default 1024,2048,4096,8192)")
    ] = None,
    depths: Annotated[
        Optional[str], typer.Option(help="--suite long: needle depths in 0..1 (default 0,0.25,0.5,0.75,1)")
    ] = None,
    samples: Annotated[int, typer.Option(help="--suite long: prompts per task × length × depth")] = 4,
    continuation: Annotated[int, typer.Option(help="--suite long: tokens scored after each context")] = 256,
    needles: Annotated[
        Optional[str],
        typer.Option(help="--suite long: passkey,needle,multikey,variables (default the first three)"),
    ] = None,
    seed: Annotated[int, typer.Option(help="--suite long: the retrieval prompts' seed")] = 0,
) -> None:
    """Evaluate a model: prefill PPL, teacher-forced decode PPL, measured KV bytes/token."""
    device = device or "cpu"
    if suite != "standard":
        long_options = dict(lengths=lengths, depths=depths, samples=samples, continuation=continuation)
        long_options |= {"needles": needles, "seed": seed}
        return _eval_long(
            model_dir, dataset, suite, long_options, max_windows, json_out,
            base_dir=base, hf_quantized_cache=hf_quant_cache, cache=cache, device=device,
        )  # fmt: skip
    try:
        res = _evaluate(
            model_dir,
            dataset,
            seq_len,
            decode_prefix,
            max_windows=max_windows,
            decode_windows=decode_windows,
            batch_size=batch_size,
            base_dir=base,
            hf_quantized_cache=hf_quant_cache,
            cache=cache,
            device=device,
        )
        if tasks:
            from lrkv_tasks.zeroshot import run_zeroshot

            with rich_progress(), _step("zero-shot tasks"):
                res["zeroshot"] = run_zeroshot(
                    model_dir,
                    csv_list(tasks),
                    include_path=str(tasks_path) if tasks_path else None,
                    limit=limit,
                    batch_size=batch_size,
                    device=device,
                )
    except USER_ERRORS as e:
        raise _fail(str(e)) from None
    print_eval(model_dir, res)
    text = json.dumps(res, indent=2)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text)
        console.print(f"wrote {json_out}")
    else:
        console.print_json(text)


def _step(description: str):
    from lrkv_tasks.progress import step

    return step(description)


def _evaluate(model_dir: str, dataset: str, seq_len: int, decode_prefix: int | None, **options) -> dict:
    """:func:`lrkv_core.pipeline.evaluate_dir` with the CLI's progress (``options``: its keywords)."""
    from lrkv_core.pipeline import evaluate_dir

    if decode_prefix is not None and not 0 < decode_prefix < seq_len:
        raise ValueError(f"--decode-prefix {decode_prefix} must be inside the window (1..{seq_len - 1})")
    with rich_progress(), _step("evaluate") as advance:
        prefix = decode_prefix or seq_len // 2
        return evaluate_dir(
            model_dir, dataset, seq_len=seq_len, decode_prefix=prefix, progress=advance, **options
        )


def _eval_long(
    model_dir: str, dataset: str, suite: str, opts: dict, windows: int | None, json_out: Path | None, **kwargs
) -> None:
    """``lrkv eval --suite long``: :func:`lrkv_core.pipeline.evaluate_long_dir`, printed as tables."""
    from lrkv_core.pipeline import evaluate_long_dir
    from lrkv_tasks.recipe import LongEvalRecipe

    if suite != "long":
        raise _fail(f"--suite must be standard or long, got {suite!r}")
    try:
        given = {
            "lengths": csv_list(opts["lengths"], int),
            "depths": csv_list(opts["depths"], float),
            "needles": csv_list(opts["needles"]),
        }
        fixed = {"continuation": opts["continuation"], "samples": opts["samples"], "seed": opts["seed"]}
        section = LongEvalRecipe(**{k: v for k, v in given.items() if v}, **fixed, windows=windows or 8)
        protocol = section.protocol(dataset)
        with rich_progress(), _step("long-context suite") as advance:
            res = evaluate_long_dir(model_dir, dataset, protocol, progress=advance, **kwargs)
    except USER_ERRORS as e:
        raise _fail(recipe_error(e)) from None
    console.print(f"long-context suite: {model_dir}\n\n{res.markdown()}", markup=False, highlight=False)
    text = json.dumps(res.to_dict() | {"model": model_dir}, indent=2)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text)
        console.print(f"wrote {json_out}")
    else:
        console.print_json(text)


register_operations(app)  # pull, deploy, up, down, runs (flows/ops_cli.py)

if __name__ == "__main__":
    app()
