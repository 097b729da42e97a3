"""``lrkv search``: the cheapest recipe within a quality budget, searched by the search flow."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml

from lrkv_core.allocation import ALLOCATORS
from lrkv_tasks.recipes.search_recipe import SearchRecipe

from ..options import (
    csv_list,
    flag_overrides,
    list_option,
    parse_set,
    path_option,
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
    choices,
    dask_block,
    fraction,
    prefect_api,
    set_option,
    start_command,
    use_device,
    user_errors,
)

# the base recipe's keys offered as flags (name, type, help and default from the recipe's schema)
SEARCH_FLAGS = (
    RecipeFlag("calibration.n_samples"),
    SEQ_LEN_FLAG,
    RecipeFlag("tracking.mlflow_uri"),
)


@recipe_flags(SearchRecipe, SEARCH_FLAGS, prefix="base.", after="allocators")
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
    allocators: Annotated[Optional[str], typer.Option(help=f"comma list of {choices(ALLOCATORS)}")] = None,
    out: Annotated[Optional[Path], path_option("--out", "export the model found here", "DIR")] = None,
    out_dir: Annotated[
        Optional[Path], path_option("--out-dir", "write search.csv/.md and the Pareto plot here", "DIR")
    ] = None,
    store: Annotated[
        Optional[str],
        typer.Option(help="artifact store root", parser=store_root, metavar="DIR|s3://BUCKET/PREFIX"),
    ] = None,
    set_: set_option("base.eval.max_windows=8") = None,
    device: DeviceOption = None,
    dask: DaskOption = None,
    verbose: VerboseOption = False,
    recipe_flags: dict | None = None,
) -> None:
    """Find the smallest KV cache within a quality budget (bisection on the width ratio per cache storage and
    allocator), then convert, export and register it; logs the Pareto front to MLflow."""
    from lrkv_tasks.recipes.convert_recipe import apply_overrides, read_yaml

    try:
        rise = None if max_ppl_rise is None else fraction(max_ppl_rise)
    except ValueError:
        raise fail(f"invalid option: --max-ppl-rise takes 1% or 0.01, got {max_ppl_rise!r}", 2) from None
    try:
        caches = csv_list(bits, lambda b: "dense" if b == "dense" else {"name": "quantized", "bits": int(b)})
    except ValueError:
        raise fail(f"invalid option: --bits takes e.g. 3,4,dense, got {bits!r}", 2) from None
    flags = {
        "base.model": model,
        "base.calibration.dataset": dataset,
        "base.eval.dataset": eval_dataset,
        "base.out": str(out) if out else None,
        "base.store": store,
        "search.max_ppl_rise": rise,
        "search.max_kl": max_kl,
        "search.ratios": list_option(ratios, float, "--ratios"),
        "search.caches": caches,
        "search.allocators": csv_list(allocators),
    }
    overrides = flag_overrides(flags, "base.eval.dataset") | (recipe_flags or {}) | parse_set(set_ or [])
    try:
        rec = SearchRecipe.model_validate(apply_overrides(read_yaml(recipe), overrides))
    except (ValueError, OSError, yaml.YAMLError) as e:
        raise fail(f"invalid recipe: {recipe_error(e)}", 2) from None
    start_command(rec.base.store, verbose, rec.base.model)
    with user_errors():
        from lrkv_tasks.recipes.preflight import prepare

        prepare(rec.base)  # before Prefect starts (the flow prepares it again)
    use_device(device)
    cluster = dask_block(dask, rec.base.store)  # checked before any API server starts
    with prefect_api() as supervise, cluster:
        from lrkv_flows.search import search_flow

        with user_errors(), supervise, rich_progress():
            result = search_flow(rec, str(out_dir) if out_dir else None)
    console.print(result["summary"]["markdown"], markup=False, highlight=False, soft_wrap=True)
    print_summary(result["winner"])
