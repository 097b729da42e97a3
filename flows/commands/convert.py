"""``lrkv convert``: a recipe (or flags) through the conversion flow, with its summary printed."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml
from rich.markup import escape

from lrkv_tasks.recipes.convert_recipe import ConvertRecipe

from ..options import (
    flag_overrides,
    parse_group_size,
    parse_set,
    path_option,
    quantized_cache,
    store_root,
)
from ..recipe_flags import RecipeFlag, recipe_flags
from ..report import console, fail, print_summary, recipe_error, rich_progress
from .common import (
    SEQ_LEN_FLAG,
    DaskOption,
    DatasetOption,
    DeviceOption,
    EvalDatasetOption,
    ModelOption,
    VerboseOption,
    cache_option,
    dask_block,
    prefect_api,
    set_option,
    start_command,
    use_device,
    user_errors,
)

# the recipe keys offered as flags (name, type, help and default from the recipe's schema)
CONVERT_FLAGS = (
    RecipeFlag("compression.ratio"),
    RecipeFlag("compression.group_size", parse=parse_group_size, metavar="N|auto"),
    RecipeFlag("compression.decomposition"),
    RecipeFlag("compression.allocator"),
    RecipeFlag("compression.rank_multiple"),
    RecipeFlag("compression.refine.steps", name="refine-steps"),
    RecipeFlag("compression.rotation.name", name="rotation"),
    RecipeFlag("calibration.n_samples"),
    SEQ_LEN_FLAG,
    RecipeFlag("calibration.precision", name="calibration-precision"),
    RecipeFlag("tracking.mlflow_uri"),
)


@recipe_flags(ConvertRecipe, CONVERT_FLAGS, after="eval_dataset")
def convert(
    recipe: Annotated[
        Optional[Path], path_option("--recipe", "YAML recipe (strict: unknown keys fail)", "FILE")
    ] = None,
    model: ModelOption = None,
    dataset: DatasetOption = None,
    eval_dataset: EvalDatasetOption = None,
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
    cache: cache_option("the compressed model's cache storage (instead of --bits)", "dense latents") = None,
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
    lora: Annotated[
        Optional[bool],
        typer.Option(
            "--lora/--no-lora",
            help="LoRA recovery after compression, merged so the cache keeps its size (the recipe's lora: "
            "section, else its defaults: r′ 32, α 32, lr 2e-4, cosine, 200 steps on the calibration data)",
        ),
    ] = None,
    lora_steps: Annotated[Optional[int], typer.Option(help="LoRA optimizer steps (implies --lora)")] = None,
    set_: set_option("eval.max_windows=8") = None,
    device: DeviceOption = None,
    dask: DaskOption = None,
    verbose: VerboseOption = False,
    recipe_flags: dict | None = None,
) -> None:
    """Convert a model to a latent KV cache, evaluate it and log the run to MLflow."""
    from lrkv_tasks.recipes.convert_recipe import load_recipe, read_yaml, recipe_yaml

    flags = {
        "model": model,
        "calibration.dataset": dataset,
        "compression.cache": quantized_cache(bits, quant_group_size, residual_length, cache),
        "out": str(out) if out else None,
        "store": store,
        "eval.dataset": eval_dataset,
    }
    overrides = flag_overrides(flags, "eval.dataset") | (recipe_flags or {})
    overrides.update(parse_set(set_ or []))
    try:
        overrides = lora_overrides(lora, lora_steps, read_yaml(recipe)) | overrides
        rec = load_recipe(recipe, overrides)
    except (ValueError, OSError, yaml.YAMLError) as e:  # pydantic (a ValueError), file and YAML errors
        raise fail(f"invalid recipe: {recipe_error(e)}", 2) from None
    start_command(rec.store, verbose, rec.model)
    with user_errors():
        from lrkv_tasks.recipes.preflight import prepare

        prepared = prepare(rec)  # everything cheap is checked before Prefect starts
    console.print("[bold]recipe[/bold]\n" + escape(recipe_yaml(prepared.recipe)), soft_wrap=True)
    for note in prepared.notes:  # a warning among them says so itself
        warning = note.startswith("warning: ")
        label, text = (
            ("[yellow]warning:[/yellow]", note.removeprefix("warning: "))
            if warning
            else ("[cyan]note:[/cyan]", note)
        )
        console.print(f"{label} {escape(text)}", soft_wrap=True)
    use_device(device)
    cluster = dask_block(dask, prepared.recipe.store)  # checked before any API server starts
    with prefect_api() as supervise, cluster:
        from lrkv_flows.convert import convert_flow  # imports Prefect: after the cheap checks

        with user_errors(), supervise, rich_progress():
            result = convert_flow(prepared.recipe)
    print_summary(result)


def lora_overrides(lora: bool | None, steps: int | None, recipe: dict) -> dict:
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
