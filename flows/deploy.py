"""Deployments on a Prefect server: convert, evaluate, and a nightly conversion of a list of models.

:func:`deploy` registers, on a process work pool (created if missing):

- ``lrkv-convert/convert``: the convert flow; its parameter is a whole recipe, pre-filled with the given
  one, so the UI's Run button (or ``prefect deployment run``) converts with it or an edited copy;
- ``lrkv-evaluate/evaluate``: the evaluate flow;
- ``lrkv-bench/bench``: the bench flow (:mod:`lrkv_flows.bench`: serving speed of the recipe's model and its
  data-free compressed versions, measured where the run's worker is), pre-filled with the recipe's model,
  ratio, tracking and store;
- ``lrkv-nightly/nightly``: :func:`nightly_flow` on a cron schedule (default 02:00 UTC), converting every
  model of its ``models`` parameter with the same recipe; given a search recipe instead,
  ``lrkv-nightly-search/nightly-search``: :func:`nightly_search_flow`, a search (:mod:`lrkv_flows.search`)
  per model, each registering the smallest cache within its budget.

A worker started with ``prefect worker start --pool POOL --type process`` (``lrkv up`` starts one) runs
them; entrypoints are module paths (``lrkv_flows.convert.convert_flow``), so the worker needs lrkv
installed, not a copy of the source.
"""

from __future__ import annotations

import os

from prefect import flow
from prefect.deployments.runner import EntrypointType

from lrkv_core.model.loading import parse_device
from lrkv_tasks.device import ENV as DEVICE_ENV
from lrkv_tasks.recipes.convert_recipe import ConvertRecipe, EvalRecipe
from lrkv_tasks.recipes.search_recipe import SearchRecipe

from .bench import bench_flow
from .cluster import ENV as DASK_ENV
from .cluster import parse_dask
from .convert import convert_flow
from .evaluate import evaluate_flow
from .runner import ConfiguredTaskRunner
from .search import search_flow

DEFAULT_POOL = "lrkv"
DEFAULT_CRON = "0 2 * * *"


def work_pool() -> str:
    return os.environ.get("LRKV_WORK_POOL", DEFAULT_POOL)


def _each_model(models: list[str], run, what: str) -> dict:
    """``run(model)`` for each model; one model's failure does not stop the others, and the flow fails at
    the end naming every model that failed."""
    results, failures = {}, {}
    for model in models:
        try:
            result = run(model)
        except Exception as err:  # reported below, after the other models
            failures[model] = f"{type(err).__name__}: {err}"
            print(f"{model}: failed ({failures[model]})")
            continue
        results[model] = {"mlflow": result.mlflow, "registered": result.registered}
        print(f"{model}: done, MLflow run {result.mlflow['run_id']}")
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(models)} nightly {what} failed: {failures}")
    return results


@flow(name="lrkv-nightly", log_prints=True, task_runner=ConfiguredTaskRunner())
def nightly_flow(models: list[str], recipe: ConvertRecipe) -> dict:
    """Convert each model with the recipe (one convert subflow each); fail at the end if any failed."""
    return _each_model(
        models, lambda model: convert_flow(recipe.model_copy(update={"model": model})), "conversions"
    )


@flow(name="lrkv-nightly-search", log_prints=True, task_runner=ConfiguredTaskRunner())
def nightly_search_flow(models: list[str], recipe: SearchRecipe) -> dict:
    """Search each model for its smallest cache within the budget, registering the winner (one search
    subflow each); fail at the end if any failed."""

    def search(model: str) -> dict:
        base = recipe.base.model_copy(update={"model": model})
        return search_flow(recipe.model_copy(update={"base": base}))["winner"]

    return _each_model(models, search, "searches")


def ensure_work_pool(name: str) -> None:
    """Create the process work pool ``name`` unless it exists."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))


def deploy(
    recipe: ConvertRecipe,
    nightly_models: list[str],
    cron: str = DEFAULT_CRON,
    pool: str | None = None,
    eval_recipe: EvalRecipe | None = None,
    dask: str | None = None,
    device: str | None = None,
    search: SearchRecipe | None = None,
) -> dict[str, str]:
    """Register the four deployments (see the module docstring); returns deployment name -> id.

    ``search``: the nightly deployment searches each model with this recipe (its ``base.model`` replaced)
    instead of converting it with ``recipe``.

    ``dask`` (``local[:N]`` or ``tcp://HOST:PORT``, :mod:`lrkv_flows.cluster`) becomes the runs' ``LRKV_DASK``
    (a job variable), so their tasks run on Dask; ``local`` starts a cluster on the worker's host per run.
    ``device`` becomes the runs' ``LRKV_DEVICE`` the same way (:mod:`lrkv_tasks.device`)."""
    pool = pool or work_pool()
    ensure_work_pool(pool)
    common = {"entrypoint_type": EntrypointType.MODULE_PATH}
    env = {}
    if dask:
        parse_dask(dask)
        env[DASK_ENV] = dask
    if device:
        parse_device(device, here=False)  # its availability is checked where the run starts
        env[DEVICE_ENV] = device
    if env:
        common["job_variables"] = {"env": env}
    recipe_json = recipe.model_dump(mode="json")
    deployments = {
        "lrkv-convert/convert": convert_flow.to_deployment(
            "convert", parameters={"recipe": recipe_json}, tags=["lrkv"], **common
        ),
        "lrkv-evaluate/evaluate": evaluate_flow.to_deployment(
            "evaluate",
            parameters={"model": recipe.model, "eval": (eval_recipe or recipe.eval).model_dump(mode="json")},
            tags=["lrkv"],
            **common,
        ),
        "lrkv-bench/bench": bench_flow.to_deployment(
            "bench",
            parameters={
                "model": recipe.model,
                "ratios": [recipe.compression.ratio],
                "tracking": recipe.tracking.model_dump(mode="json"),
                "store": recipe.store,
            },
            tags=["lrkv", "bench"],
            **common,
        ),
    }
    if search is None:
        deployments["lrkv-nightly/nightly"] = nightly_flow.to_deployment(
            "nightly",
            cron=cron,
            parameters={"models": nightly_models, "recipe": recipe_json},
            tags=["lrkv", "nightly"],
            **common,
        )
    else:
        deployments["lrkv-nightly-search/nightly-search"] = nightly_search_flow.to_deployment(
            "nightly-search",
            cron=cron,
            parameters={"models": nightly_models, "recipe": search.model_dump(mode="json")},
            tags=["lrkv", "nightly", "search"],
            **common,
        )
    return {name: str(d.apply(work_pool_name=pool)) for name, d in deployments.items()}
