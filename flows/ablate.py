"""The ablation flow: the convert flow over a grid, then one summary table, plot and MLflow run."""

from __future__ import annotations

from prefect import flow

from lrkv_tasks.ablation import ablation_row, summarize_ablation
from lrkv_tasks.recipes.convert_recipe import AblateRecipe
from lrkv_tasks.store.artifact_store import open_store

from .convert import convert_flow
from .runner import ConfiguredTaskRunner


@flow(name="lrkv-ablate", task_runner=ConfiguredTaskRunner())
def ablate_flow(recipe: AblateRecipe, out_dir: str | None = None) -> dict:
    """Convert and evaluate one model for every grid point; calibration, stats and factors are shared."""
    rows = []
    for comp in recipe.grid():
        no_registry = recipe.base.registry.model_copy(
            update={"enabled": False}
        )  # grid points are not releases
        point = recipe.base.model_copy(update={"compression": comp, "out": None, "registry": no_registry})
        try:
            result = convert_flow(point)
        except ValueError as e:  # e.g. a ratio that rounds to rank 0 for this group size
            rows.append(ablation_row(comp, None, str(e)))
            continue
        rows.append(ablation_row(comp, result))
    store = open_store(recipe.base.store).root
    summary = summarize_ablation(rows, recipe.model_dump(mode="json"), store, out_dir)
    return {"rows": rows, **summary}
