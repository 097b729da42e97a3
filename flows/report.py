"""What the ``lrkv`` commands show: rich progress bars for long steps, and the result tables."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from lrkv_core.evaluation.metrics import EvalResult
    from lrkv_tasks.results import ConvertResult

console = Console(emoji=False)  # names and paths as they are: `…-v1:train:` is not rich's :train: emoji


def print_table(table: Table) -> None:
    """A table on the terminal's width; where the output is not a terminal (a pipe, a log file), at the
    table's own width, so that no cell is cut to fit 80 columns."""
    if console.is_terminal:
        console.print(table)
        return
    from rich.measure import Measurement

    before = console.width
    needed = Measurement.get(console, console.options.update(width=10_000), table).maximum
    console.width = max(needed, before)  # print() clamps its width to the console's
    try:
        console.print(table)
    finally:
        console.width = before


def fail(message: str, code: int = 1):
    """Print one error line and return the ``typer.Exit`` to raise (no traceback)."""
    import typer

    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    return typer.Exit(code)


def recipe_error(err: Exception) -> str:
    """One line for a bad recipe: each pydantic error as ``field: message (got value)``, else the error."""
    from pydantic import ValidationError

    if not isinstance(err, ValidationError):
        return str(err).splitlines()[0] if str(err) else repr(err)
    parts = []
    for e in err.errors(include_url=False):
        where = ".".join(str(p) for p in e["loc"]) or "recipe"
        message = e["msg"].replace("Value error, ", "")
        got = "" if e["type"] in ("extra_forbidden", "value_error") else f" (got {e['input']!r})"
        parts.append(f"{where}: {message}{got}")
    return "; ".join(parts)


@contextmanager
def rich_progress() -> Iterator[None]:
    """Show every ``lrkv_tasks.progress.step`` of the block as a rich progress bar on a terminal, and as
    timestamped lines when the output is not one (a bar would only be drawn when the command ends)."""
    from lrkv_tasks.progress import set_reporter

    if not console.is_terminal:
        with progress_lines():
            yield
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:

        @contextmanager
        def factory(description: str):
            tid = progress.add_task(description, total=None)

            def advance(done: int, total: int) -> None:
                progress.update(tid, completed=done, total=total)

            yield advance

        set_reporter(factory)
        try:
            yield
        finally:
            set_reporter(None)


class _ConsoleLines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        console.print(f"{stamp} {escape(record.getMessage())}", soft_wrap=True, highlight=False)


@contextmanager
def progress_lines() -> Iterator[None]:
    """Print the ``lrkv`` logger's progress lines (:mod:`lrkv_tasks.progress`) as they come, one per line."""
    logger = logging.getLogger("lrkv")
    handler, level, propagate = _ConsoleLines(logging.INFO), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # printed here once, not again by a root handler
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def print_summary(result: ConvertResult) -> None:
    from lrkv_tasks.summary import long_markdown, measure_rows, registration_line, task_rows

    steps = Table(title="tasks")
    for col in ("task", "state", "seconds", "peak RSS GiB"):
        steps.add_column(col)
    for task, *cells in task_rows(result):
        steps.add_row(escape(task), *cells)
    console.print(steps)
    table = Table(title="result")
    table.add_column("metric")
    table.add_column("base", justify="right")
    table.add_column("compressed", justify="right")
    for row in measure_rows(result):
        table.add_row(*row)
    console.print(table)
    long = long_markdown(result)
    if long is not None:
        console.print(f"long-context suite\n\n{long}\n", markup=False, highlight=False)
    console.print(f"compressed model: {result.compressed.uri}", soft_wrap=True)
    if result.exported:
        console.print(f"exported to: {result.exported.uri}", soft_wrap=True)
    run = result.mlflow
    console.print(
        f"MLflow run {run['run_id']} (experiment {run['experiment_id']}) at {run['tracking_uri']}",
        soft_wrap=True,
    )
    reg = result.registered
    if reg:
        console.print(
            f"registered {escape(registration_line(reg))}; pull it with "
            f"lrkv pull {reg['name']}@{reg['aliases'][-1]} --out DIR",
            soft_wrap=True,
        )


def print_eval(model_dir: str, res: EvalResult) -> None:
    table = Table(title=f"eval {model_dir}")
    for col in ("measure", "nll", "ppl", "tokens"):
        table.add_column(col)
    for name, r in (("prefill", res.prefill), ("decode", res.decode)):
        table.add_row(name, f"{r['nll']:.4f}", f"{r['ppl']:.4f}", str(r["tokens"]))
    console.print(table)
    kv = res.kv
    console.print(
        f"KV bytes/token (measured, {kv['cache_class']}): {kv['kv_bytes_per_token']:.1f}; the original "
        f"model's cache: {kv['dense_kv_bytes_per_token']:.1f}; compression {kv['kv_compression_ratio']:.2f}×"
    )
    if res.decode_kv_bytes_per_token is not None:
        d = res.decode
        held = d["protocol"]["tokens_held"] // d["windows"]
        console.print(
            f"KV bytes/token after the decode ({held} tokens a window): "
            f"{d['kv_bytes_per_token']:.1f}; the original model's cache: {d['dense_kv_bytes_per_token']:.1f}"
        )
    if res.kl is not None:
        console.print(
            f"KL(base ‖ model): {res.kl_to_base:.5f} nats/token; top-1 agreement {res.top1_agreement:.4f}"
        )
    for task_name, metrics in res.zeroshot_scores().items():
        console.print(f"{task_name}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
