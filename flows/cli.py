"""The ``lrkv`` command line, assembled from one module per command (:mod:`lrkv_flows.commands`):
``convert`` (the Prefect flow), ``ablate``, ``search``, ``bench``, ``eval`` (direct), and the operations
``pull``, ``deploy``, ``up``, ``down`` and ``runs`` (:mod:`lrkv_flows.commands.operations`).

A command's module is imported only when that command runs or shows its help: the modules import torch,
transformers, Prefect or MLflow, which takes seconds, while ``lrkv --help`` lists the commands from
:data:`COMMANDS` alone.
"""

from __future__ import annotations

import difflib
import importlib
import re
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from .loading import loading

# name: ("module:attr" under lrkv_flows.commands, a command function or Typer app; its line in `lrkv --help`)
COMMANDS = {
    "convert": ("convert:convert", "Convert a model to a latent KV cache, evaluate it and log it to MLflow."),
    "ablate": ("ablate:ablate", "Run a grid of conversions on one model: a table, a plot and an MLflow run."),
    "search": ("search:search", "Find the smallest KV cache within a quality budget, then convert it."),
    "bench": ("bench:bench", "Measure serving speed of a model and its compressed versions."),
    "eval": ("evaluate:eval_cmd", "Evaluate a model: prefill and decode PPL, measured KV bytes per token."),
    "pull": ("operations:pull", "Download a registered lrkv model from the MLflow registry."),
    "deploy": ("operations:deploy", "Register the convert, evaluate, bench and nightly deployments."),
    "up": ("operations:up", "Start a local Prefect server, a process worker and an MLflow server."),
    "down": ("operations:down", "Stop what `lrkv up` started."),
    "runs": ("operations:runs_app", "Inspect conversions logged to MLflow."),
}


def untyped_flags(command: TyperCommand | TyperGroup) -> TyperCommand | TyperGroup:
    """``command`` (and its subcommands) with its flags shown in the help without a type: typer writes
    ``<bool>`` beside ``--static`` or ``--help``, as if they took a value."""
    for param in command.params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    help_option = command.get_help_option

    def get_help_option(ctx: typer.Context):
        option = help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    command.get_help_option = get_help_option
    for sub in getattr(command, "commands", {}).values():
        untyped_flags(sub)
    return command


def load_command(name: str) -> TyperCommand | TyperGroup:
    """The click command ``name`` of :data:`COMMANDS`, its module imported (a SIGINT meanwhile: one line and
    exit code 130, :func:`lrkv_flows.loading.loading`)."""
    module, attr = COMMANDS[name][0].split(":")
    with loading():
        target = getattr(importlib.import_module(f"lrkv_flows.commands.{module}"), attr)
    if isinstance(target, typer.Typer):
        command = typer.main.get_group(target)
    else:
        app = typer.Typer(add_completion=False)
        app.command(name)(target)
        command = typer.main.get_command(app)
    command.name, command.short_help = name, COMMANDS[name][1]
    return untyped_flags(command)


class LazyCommands(TyperGroup):
    """The commands of :data:`COMMANDS`, each loaded (:func:`load_command`) the first time it is asked for;
    while the group's own help is written, each is a stand-in holding only its summary."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.listing = False
        untyped_flags(self)

    def list_commands(self, ctx: typer.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: typer.Context, cmd_name: str) -> TyperCommand | TyperGroup | None:
        if cmd_name not in COMMANDS:
            return None
        if self.listing and cmd_name not in self.commands:
            return TyperCommand(cmd_name, short_help=COMMANDS[cmd_name][1])
        if cmd_name not in self.commands:
            self.commands[cmd_name] = load_command(cmd_name)
        return self.commands[cmd_name]

    def resolve_command(self, ctx: typer.Context, args: list[str]):
        if args and args[0] not in COMMANDS and not args[0].startswith("-"):  # named among all, loaded or not
            matches = ", ".join(map(repr, difflib.get_close_matches(args[0], list(COMMANDS))))
            ctx.fail(f"No such command {args[0]!r}." + (f" Did you mean {matches}?" if matches else ""))
        return super().resolve_command(ctx, args)

    def format_help(self, ctx: typer.Context, formatter) -> None:
        self.listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self.listing = False


app = typer.Typer(
    cls=LazyCommands,
    add_completion=False,
    no_args_is_help=True,
    help="Low-rank KV-cache compression (Palu and friends).",
)


def version() -> str:
    """lrkv's version, read without importing lrkv (the installed distribution's, else the source's)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed
    from importlib.util import find_spec

    try:
        return installed("lrkv")
    except PackageNotFoundError:  # run from a source tree on PYTHONPATH
        source = Path(find_spec("lrkv_core").submodule_search_locations[0]) / "version.py"
        return re.search(r'__version__ = "([^"]+)"', source.read_text()).group(1)


def _print_version(value: bool) -> None:
    if value:
        print(f"lrkv {version()}")
        raise typer.Exit()


@app.callback()
def _start(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Show lrkv's version and exit."
        ),
    ] = False,
) -> None:
    """Before any command runs: glibc's malloc arenas capped, ahead of the flows' task threads (and inherited
    by the workers they start)."""
    with loading():
        from lrkv_core.system.memory import limit_malloc_arenas

    limit_malloc_arenas()


if __name__ == "__main__":
    from .exiting import freeze_at_exit

    freeze_at_exit()
    app()
