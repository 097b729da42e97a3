"""The ``lrkv`` commands for day-to-day operation: pull, deploy, up, down, runs list/show/compare."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from ..options import dask_option, device_name_option, path_option
from ..report import console, fail, print_table

MlflowUriOption = Annotated[
    Optional[str], typer.Option(help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else local SQLite)")
]
ExperimentOption = Annotated[str, typer.Option(help="MLflow experiment")]
runs_app = typer.Typer(no_args_is_help=True, help="Inspect conversions logged to MLflow.")


def _mlflow_errors():
    from mlflow.exceptions import MlflowException

    return (ValueError, OSError, KeyError, MlflowException)


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else repr(err)


def require_home() -> None:
    """Fail with one line and the usage-error exit code (2) unless ``$LRKV_HOME`` can be written."""
    from lrkv_core.system.paths import HomeNotWritableError, writable_home

    try:
        writable_home()
    except HomeNotWritableError as e:
        raise fail(str(e), 2) from None


def _require_home_for(mlflow_uri: str | None) -> None:
    """The runs commands read the local SQLite database, in the home, unless an MLflow URI is given."""
    if not (mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")):
        require_home()


def pull(
    ref: Annotated[
        str, typer.Argument(help="registered model: NAME@ALIAS (lrkv-llama@champion) or NAME/VERSION")
    ],
    out: Annotated[Path, path_option("--out", "write the compressed model directory here", "DIR")],
    mlflow_uri: MlflowUriOption = None,
) -> None:
    """Download a registered lrkv model from the MLflow registry; it loads with lrkv_core.load_compressed."""
    from lrkv_tasks.convert import copy_model_dir
    from lrkv_tasks.tracking.remote_refs import registered_version, resolve_registered_model

    if mlflow_uri:
        os.environ["MLFLOW_TRACKING_URI"] = mlflow_uri
    require_home()  # the download cache is there
    try:
        version = registered_version(ref)
        copy_model_dir(resolve_registered_model(ref), out)
    except _mlflow_errors() as e:
        raise fail(_first_line(e)) from None
    console.print(f"pulled {version.name} v{version.version} ({ref}) to {out}", soft_wrap=True)


def deploy(
    recipe: Annotated[
        Optional[Path], path_option("--recipe", "YAML recipe the deployments default to", "FILE")
    ] = None,
    nightly: Annotated[
        Optional[str], typer.Option(help="comma list of models the nightly deployment converts")
    ] = None,
    cron: Annotated[str, typer.Option(help="the nightly schedule (cron, UTC)")] = "0 2 * * *",
    search: Annotated[
        Optional[Path],
        path_option(
            "--search",
            "YAML search recipe (base + search): the nightly deployment searches each model for its smallest "
            "cache within the budget instead of converting it with --recipe",
            "FILE",
        ),
    ] = None,
    pool: Annotated[
        Optional[str], typer.Option(help="process work pool (default $LRKV_WORK_POOL or lrkv)")
    ] = None,
    dask: Annotated[
        Optional[str],
        typer.Option(
            parser=dask_option,
            metavar="local[:N]|tcp://HOST:PORT",
            help="the runs' tasks on Dask (their LRKV_DASK): local[:N] starts N worker processes on the "
            "worker's host per run; tcp://HOST:PORT uses a running scheduler; default: threads",
        ),
    ] = None,
    device: Annotated[
        Optional[str],
        typer.Option(
            parser=device_name_option,
            metavar="cpu|cuda|cuda:N|auto",
            help="where the runs' models compute (their LRKV_DEVICE), checked on the worker when a run "
            "starts; default cpu",
        ),
    ] = None,
) -> None:
    """Register the convert, evaluate, bench and nightly deployments on the Prefect server (the one `lrkv up`
    started, or $PREFECT_API_URL)."""
    from lrkv_tasks.recipes.convert_recipe import load_recipe, read_yaml
    from lrkv_tasks.recipes.search_recipe import SearchRecipe

    from ..apiserver import running_services

    api_from_env = bool(os.environ.get("PREFECT_API_URL"))
    if not api_from_env:
        services = running_services()
        if not services:
            raise fail("no Prefect server: run `lrkv up` or set PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = services["prefect_api"]
    try:
        rec = load_recipe(recipe)
        searched = SearchRecipe.model_validate(read_yaml(search)) if search else None
        default_model = searched.base.model if searched else rec.model
        models = [m.strip() for m in (nightly or default_model).split(",") if m.strip()]
        from ..deploy import deploy as register

        ids = register(rec, models, cron=cron, pool=pool, dask=dask, device=device, search=searched)
    except (ValueError, OSError) as e:
        raise fail(_first_line(e)) from None
    for name, dep_id in ids.items():
        console.print(f"deployment {name} ({dep_id})")
    what = "search" if searched else "nightly"
    console.print(f"{what}: {', '.join(models)} at '{cron}' (UTC)")
    if dask:
        console.print(f"their tasks run on Dask ({dask})")
    if device:
        console.print(f"their models compute on {device}")
    # Prefect's own CLI finds `lrkv up`'s server only through the variable
    api = "" if api_from_env else f"PREFECT_API_URL={os.environ['PREFECT_API_URL']} "
    console.print(
        f"run one now: {api}prefect deployment run lrkv-convert/convert (or lrkv-bench/bench; or the UI's "
        "Run button)",
        soft_wrap=True,
    )


def up() -> None:
    """Start a local Prefect server, a process worker and an MLflow server (until `lrkv down`)."""
    from ..services import up as start

    require_home()
    try:
        services = start()
    except (RuntimeError, OSError) as e:
        raise fail(_first_line(e)) from None
    console.print(f"Prefect UI {services['prefect_ui']}  (API {services['prefect_api']})")
    console.print(
        f"MLflow {services['mlflow']}  (export MLFLOW_TRACKING_URI={services['mlflow']} to log there)"
    )
    console.print(
        f"worker on pool {services['work_pool']}; `lrkv convert` now uses this server; `lrkv down` stops all"
    )


def down() -> None:
    """Stop what `lrkv up` started."""
    from ..services import down as stop

    stopped = stop()
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


def _fmt(value) -> str:
    if value is None:
        return "—"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


@runs_app.command("list")
def runs_list(
    experiment: ExperimentOption = "lrkv", mlflow_uri: MlflowUriOption = None, limit: int = 20
) -> None:
    """The newest runs: id, status, model and summary metrics."""
    from lrkv_tasks.tracking.run_history import SUMMARY_METRICS, list_runs

    _require_home_for(mlflow_uri)
    try:
        rows = list_runs(mlflow_uri, experiment, limit)
    except _mlflow_errors() as e:
        raise fail(_first_line(e)) from None
    table = Table(title=f"runs of {experiment}")
    for col in ("run", "name", "status", "started (UTC)"):
        table.add_column(col, no_wrap=True)
    for col in SUMMARY_METRICS.values():
        table.add_column(col, justify="right")
    for r in rows:
        started = datetime.fromtimestamp(r["start_time"] / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M")
        table.add_row(
            r["run_id"], escape(r["name"] or ""), r["status"], started, *(_fmt(r[k]) for k in SUMMARY_METRICS)
        )
    print_table(table)


def _tree(node: Tree, items: list[dict]) -> None:
    for item in items:
        label = f"{item['path'].rsplit('/', 1)[-1]}" + (f" ({item['size']} B)" if item["size"] else "")
        branch = node.add(escape(label))
        _tree(branch, item.get("children", []))


@runs_app.command("show")
def runs_show(
    run: Annotated[str, typer.Argument(help="MLflow run id")],
    mlflow_uri: MlflowUriOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON instead of tables")] = False,
) -> None:
    """One run: metrics, params and its artifact tree."""
    from lrkv_tasks.tracking.run_history import show_run

    _require_home_for(mlflow_uri)
    try:
        info = show_run(mlflow_uri, run)
    except _mlflow_errors() as e:
        raise fail(_first_line(e)) from None
    if json_out:
        console.print_json(json.dumps(info))
        return
    console.print(f"run {info['run_id']} ({escape(info['name'] or '')}): {info['status']}")
    for title, data in (("metrics", info["metrics"]), ("params", info["params"]), ("tags", info["tags"])):
        table = Table(title=title)
        table.add_column("key")
        table.add_column("value", overflow="fold")
        for k, v in data.items():
            table.add_row(escape(k), escape(_fmt(v)))
        console.print(table)
    tree = Tree("artifacts")
    _tree(tree, info["artifacts"])
    console.print(tree)


@runs_app.command("compare")
def runs_compare(
    a: Annotated[str, typer.Argument(help="first run id")],
    b: Annotated[str, typer.Argument(help="second run id")],
    mlflow_uri: MlflowUriOption = None,
) -> None:
    """Two runs side by side: every metric (with b − a) and the params that differ."""
    from lrkv_tasks.tracking.run_history import compare_runs

    _require_home_for(mlflow_uri)
    try:
        cmp = compare_runs(mlflow_uri, a, b)
    except _mlflow_errors() as e:
        raise fail(_first_line(e)) from None
    table = Table(title=f"metrics: a={a[:8]} b={b[:8]}")
    for col in ("metric", "a", "b", "b − a"):
        table.add_column(col, no_wrap=True)
    for m in cmp["metrics"]:
        table.add_row(escape(m["metric"]), _fmt(m["a"]), _fmt(m["b"]), _fmt(m["diff"]))
    print_table(table)
    params = Table(title="params that differ")
    for col in ("param", "a", "b"):
        params.add_column(col, overflow="fold")
    for p in cmp["params"]:
        params.add_row(escape(p["param"]), escape(_fmt(p["a"])), escape(_fmt(p["b"])))
    console.print(params)


def register_operations(app: typer.Typer) -> None:
    """Add these commands to the ``lrkv`` app."""
    for command in (pull, deploy, up, down):
        app.command()(command)
    app.add_typer(runs_app, name="runs")
