"""``lrkv ablate``: a grid of conversions from one base recipe, ranked in one table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml

from lrkv_core.allocation import ALLOCATORS
from lrkv_core.decompositions import DECOMPOSITIONS

from ..options import (
    csv_list,
    flag_overrides,
    list_option,
    parse_group_size,
    parse_set,
    path_option,
)
from ..report import console, fail, recipe_error, rich_progress
from .common import (
    DaskOption,
    DatasetOption,
    DeviceOption,
    EvalDatasetOption,
    ModelOption,
    VerboseOption,
    choices,
    dask_block,
    prefect_api,
    set_option,
    start_command,
    use_device,
    user_errors,
)


def ablate(
    recipe: Annotated[
        Optional[Path], path_option("--recipe", "YAML ablation recipe: base (convert recipe) + grid", "FILE")
    ] = None,
    model: ModelOption = None,
    dataset: DatasetOption = None,
    eval_dataset: EvalDatasetOption = None,
    decompositions: Annotated[
        Optional[str], typer.Option(help=f"comma list of {choices(DECOMPOSITIONS)}")
    ] = None,
    group_sizes: Annotated[Optional[str], typer.Option(help="comma list, e.g. 1,2,auto")] = None,
    allocators: Annotated[Optional[str], typer.Option(help=f"comma list of {choices(ALLOCATORS)}")] = None,
    ratios: Annotated[Optional[str], typer.Option(help="comma list, e.g. 0.7,0.5,0.3")] = None,
    out_dir: Annotated[
        Optional[Path], path_option("--out-dir", "write ablation.csv/.md/.png here", "DIR")
    ] = None,
    set_: set_option("base.eval.max_windows=8") = None,
    device: DeviceOption = None,
    dask: DaskOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Run a grid of conversions on one model and write a comparison table, a plot and an MLflow run."""
    from lrkv_tasks.recipes.convert_recipe import AblateRecipe, apply_overrides, read_yaml

    flags = {
        "base.model": model,
        "base.calibration.dataset": dataset,
        "base.eval.dataset": eval_dataset,
        "decompositions": csv_list(decompositions),
        "group_sizes": list_option(
            group_sizes, lambda v: parse_group_size(v, "--group-sizes"), "--group-sizes"
        ),
        "allocators": csv_list(allocators),
        "ratios": list_option(ratios, float, "--ratios"),
    }
    overrides = flag_overrides(flags, "base.eval.dataset") | parse_set(set_ or [])
    try:
        rec = AblateRecipe.model_validate(apply_overrides(read_yaml(recipe), overrides))
    except (ValueError, OSError, yaml.YAMLError) as e:
        raise fail(f"invalid recipe: {recipe_error(e)}", 2) from None
    start_command(rec.base.store, verbose, rec.base.model)
    with user_errors():
        from lrkv_tasks.recipes.preflight import check_ablation

        check_ablation(rec)  # before Prefect starts
    use_device(device)
    cluster = dask_block(dask, rec.base.store)  # checked before any API server starts
    with prefect_api() as supervise, cluster:
        from lrkv_flows.ablate import ablate_flow

        with user_errors(), supervise, rich_progress():
            result = ablate_flow(rec, str(out_dir) if out_dir else None)
    console.print(result["markdown"], markup=False, highlight=False, soft_wrap=True)
    run = result["mlflow"]
    console.print(f"wrote {result['dir']}; MLflow run {run['run_id']} at {run['tracking_uri']}")
    if result["failed_rows"] == len(result["rows"]):
        raise fail(f"no conversion of the grid succeeded ({len(result['rows'])} failed; errors above)")
