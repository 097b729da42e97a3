"""``lrkv bench``: decode, prefill and memory of an original and its compressed versions, measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..options import (
    csv_list,
    list_option,
    path_option,
)
from ..report import console, fail, rich_progress
from .common import (
    DeviceOption,
    VerboseOption,
    prefect_api,
    start_command,
    use_device,
    user_errors,
)


def bench(
    model: Annotated[str, typer.Option(help="the original model: hub id, local dir or builtin:NAME")],
    ratios: Annotated[
        str, typer.Option(help="KV width ratios of the data-free compressed versions measured, comma list")
    ] = "0.5",
    bits: Annotated[
        Optional[str], typer.Option(help="also each ratio with B-bit rotated latents, comma list (2,3,4,8)")
    ] = None,
    keys: Annotated[
        str,
        typer.Option(
            help="the forms of the cached keys the data-free versions take, comma list: rebuilt (latents of "
            "the keys before RoPE, rebuilt at each step), rotated (latents of the keys after RoPE)"
        ),
    ] = "rebuilt",
    compressed: Annotated[
        Optional[list[str]], typer.Option(help="a compressed model directory to measure too (repeatable)")
    ] = None,
    contexts: Annotated[
        Optional[str],
        typer.Option(
            help="context lengths, comma list [default: 1024,4096,16384, each past the model's positions "
            "replaced by the longest they hold]"
        ),
    ] = None,
    batch: Annotated[int, typer.Option(help="sequences decoded together")] = 8,
    steps: Annotated[int, typer.Option(help="timed decode steps per point (their median is reported)")] = 16,
    warmup: Annotated[int, typer.Option(help="untimed decode steps before them")] = 2,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "float32",
    static: Annotated[
        bool, typer.Option("--static", help="decode over preallocated caches (StaticLatentCache)")
    ] = False,
    compile_steps: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="compile the decode step (torch.compile; CUDA graphs on a GPU); needs --static",
        ),
    ] = False,
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
    from lrkv_core.decompositions import KEY_LATENTS
    from lrkv_tasks.recipes.convert_recipe import TrackingRecipe

    ratio_list = list_option(ratios, float, "--ratios")
    context_list = list_option(contexts, int, "--contexts")  # None: the defaults the model holds
    bit_list = list_option(bits, int, "--bits") or []
    key_list = csv_list(keys, str)
    bad_bits = any(b not in (2, 3, 4, 8) for b in bit_list)
    if not ratio_list or any(not 0 < r <= 1 for r in ratio_list) or bad_bits:
        raise fail("--ratios must be in (0, 1] and --bits among 2, 3, 4, 8", 2)
    bad_contexts = context_list is not None and (not context_list or min(context_list) < 1)
    if bad_contexts or batch < 1 or steps < 1 or warmup < 0:
        raise fail("--contexts, --batch and --steps must be ≥ 1 and --warmup ≥ 0", 2)
    if not key_list or not set(key_list) <= set(KEY_LATENTS) or len(set(key_list)) != len(key_list):
        raise fail(f"--keys takes rebuilt and/or rotated, each once (got {keys!r})", 2)
    if compile_steps and not static:
        raise fail("--compile needs --static (a compiled step runs over a preallocated cache)", 2)
    if compile_steps and warmup < 1:
        raise fail("--compile needs --warmup ≥ 1 (the first decode step runs uncompiled)", 2)
    start_command(store, verbose, model)
    with user_errors():  # before Prefect starts
        from lrkv_tasks.recipes.preflight import bench_contexts, check_bench_models

        context_list = bench_contexts(model, context_list, warmup + steps)
        check_bench_models(model, compressed or [], key_list, context_list[-1], warmup + steps)
    use_device(device)
    with prefect_api() as supervise:
        from lrkv_flows.bench import bench_flow

        with supervise, rich_progress(), user_errors():
            result = bench_flow(
                model, ratio_list, bit_list, compressed, context_list, batch, steps, warmup, dtype,
                TrackingRecipe(experiment=experiment), store, static, compile_steps, key_list,
            )  # fmt: skip
    console.print(result["markdown"])
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({k: v for k, v in result.items() if k != "markdown"}, indent=2))
        console.print(f"wrote {json_out}")
    run = result["mlflow"]
    console.print(f"MLflow run {run['run_id']} at {run['tracking_uri']}")
