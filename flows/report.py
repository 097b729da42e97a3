"""What the ``lrkv`` commands show: rich progress bars for long steps, and the result tables."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console()


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


def print_summary(result: dict) -> None:
    steps = Table(title="tasks")
    for col in ("task", "state", "seconds", "peak RSS GiB"):
        steps.add_column(col)
    for row in result["timings"]:
        seconds = "—" if row["seconds"] is None else f"{row['seconds']:.2f}"
        peak = row.get("peak_rss_bytes")
        peak = "—" if peak is None else f"{peak / 2**30:.2f}"
        steps.add_row(escape(row["task"]), row["state"], seconds, peak)
    console.print(steps)
    table = Table(title="result")
    table.add_column("metric")
    table.add_column("base", justify="right")
    table.add_column("compressed", justify="right")
    base, comp = result["eval"]["base"], result["eval"]["compressed"]
    if base and comp:
        for name, key in (
            ("prefill ppl", ("prefill", "ppl")),
            ("decode ppl", ("decode", "ppl")),
            ("KV bytes/token", ("kv", "kv_bytes_per_token")),
        ):
            table.add_row(name, f"{base[key[0]][key[1]]:.4f}", f"{comp[key[0]][key[1]]:.4f}")
        before = result["eval"].get("before_lora")
        if before:  # the compressed column is the recovered model
            for name in ("prefill", "decode"):
                table.add_row(f"{name} ppl before LoRA", "", f"{before[name]['ppl']:.4f}")
        if "kl" in comp:
            table.add_row("KL(base ‖ compressed) nats/token", "0", f"{comp['kl']['kl']:.5f}")
            table.add_row("top-1 agreement", "1", f"{comp['kl']['top1_agreement']:.4f}")
        for task_name, metrics in comp.get("zeroshot", {}).get("results", {}).items():
            for metric, value in metrics.items():
                base_value = base["zeroshot"]["results"][task_name][metric]
                table.add_row(f"{task_name} {metric}", f"{base_value:.4f}", f"{value:.4f}")
        ratio = comp["kv"]["kv_bytes_per_token"] / base["kv"]["kv_bytes_per_token"]
        table.add_row("KV bytes ratio (measured)", "1", f"{ratio:.4f}")
        table.add_row("KV compression (measured)", "1×", f"{1 / ratio:.2f}×")
    plan = result["plan"].meta
    table.add_row(
        "KV width ratio target / achieved", f"{plan['target_ratio']}", f"{plan['achieved_ratio']:.4f}"
    )
    lora = result.get("lora")
    if lora is not None:
        m = lora.meta
        table.add_row(
            "LoRA steps (this run) / seconds", "", f"{m['steps']} ({m['steps_run']}) / {m['seconds']:.1f}"
        )
        if m.get("eval_loss_before") is not None:
            table.add_row("LoRA held-out loss before → after", "", f"{m['eval_loss_before']:.4f} → "
                          f"{m['eval_loss_after']:.4f}")  # fmt: skip
    console.print(table)
    long = (comp or {}).get("long")
    if long is not None:
        from lrkv_core.longcontext import LongContextResult

        text = LongContextResult.from_dict(long).markdown()
        console.print(f"long-context suite\n\n{text}\n", markup=False, highlight=False)
    console.print(f"compressed model: {result['compressed'].uri}", soft_wrap=True)
    if result["exported"]:
        console.print(f"exported to: {result['exported'].uri}", soft_wrap=True)
    run = result["mlflow"]
    console.print(
        f"MLflow run {run['run_id']} (experiment {run['experiment_id']}) at {run['tracking_uri']}",
        soft_wrap=True,
    )
    reg = result.get("registered")
    if reg:
        gate = "passed" if reg["gate"]["passed"] else "not passed"
        console.print(
            f"registered {reg['name']} v{reg['version']} as {', '.join(reg['aliases'])} "
            f"(quality gate {gate}: {escape(reg['gate']['reason'])}); pull it with "
            f"lrkv pull {reg['name']}@{reg['aliases'][-1]} --out DIR",
            soft_wrap=True,
        )


def print_eval(model_dir: str, res: dict) -> None:
    table = Table(title=f"eval {model_dir}")
    for col in ("measure", "nll", "ppl", "tokens"):
        table.add_column(col)
    for name in ("prefill", "decode"):
        r = res[name]
        table.add_row(name, f"{r['nll']:.4f}", f"{r['ppl']:.4f}", str(r["tokens"]))
    console.print(table)
    kv = res["kv"]
    console.print(
        f"KV bytes/token (measured, {kv['cache_class']}): {kv['kv_bytes_per_token']:.1f}; the original "
        f"model's cache: {kv['dense_kv_bytes_per_token']:.1f}; compression {kv['kv_compression_ratio']:.2f}×"
    )
    if "kl" in res:
        kl = res["kl"]
        console.print(
            f"KL(base ‖ model): {kl['kl']:.5f} nats/token; top-1 agreement {kl['top1_agreement']:.4f}"
        )
    for task_name, metrics in res.get("zeroshot", {}).get("results", {}).items():
        console.print(f"{task_name}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
