"""The ``lrkv`` command line, assembled from one module per command (:mod:`lrkv_flows.commands`):
``convert`` (the Prefect flow), ``ablate``, ``search``, ``bench``, ``eval`` (direct), and the operations
``pull``, ``deploy``, ``up``, ``down`` and ``runs`` (:mod:`lrkv_flows.commands.operations`)."""

from __future__ import annotations

import typer

from .commands.ablate import ablate
from .commands.bench import bench
from .commands.convert import convert
from .commands.evaluate import eval_cmd
from .commands.operations import register_operations
from .commands.search import search

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Low-rank KV-cache compression (Palu and friends)."
)
for command in (convert, ablate, search, bench):
    app.command()(command)
app.command("eval")(eval_cmd)
register_operations(app)  # pull, deploy, up, down, runs

if __name__ == "__main__":
    app()
