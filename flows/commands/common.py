"""What the commands share: their options, the Prefect API and Dask cluster they run under, progress."""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Annotated, Optional

import typer
from rich.markup import escape

from lrkv_core.cache import CACHE_STORAGES
from lrkv_tasks.device import ENV as DEVICE_ENV

from ..cluster import ENV as DASK_ENV
from ..options import cache_storage, dask_option, device_option
from ..recipe_flags import RecipeFlag
from ..report import console, fail, rich_progress
from .operations import require_home

# what a user error looks like: one line, no traceback (FileExistsError/FileNotFoundError are OSErrors)
USER_ERRORS = (ValueError, OSError, KeyError)


@contextmanager
def user_errors(describe=str):
    """Inside: an error of the user's (:data:`USER_ERRORS`: a bad value, a missing file) ends the command
    with one line, ``describe(error)``, instead of a traceback."""
    try:
        yield
    except USER_ERRORS as e:
        raise fail(describe(e)) from None


def choices(registry) -> str:
    return " | ".join(sorted(registry.names()))


DATASET_FORMS = (
    "hf:NAME[:CONFIG[:SPLIT]] | text:PATH | parquet:PATH | builtin:NAME:SPLIT, each optionally [A%:B%]"
)

# options shared by the commands
SEQ_LEN_FLAG = RecipeFlag(  # one window length for calibration and evaluation; decode after its first half
    "calibration.seq_len", also=("eval.seq_len",), derived=(("eval.decode_prefix", lambda n: n // 2),)
)
ModelOption = Annotated[Optional[str], typer.Option(help="hub id, local dir or builtin:NAME")]
DatasetOption = Annotated[
    Optional[str],
    typer.Option(help=f"calibration data: {DATASET_FORMS}; default: WikiText-2 (builtin models: their own)"),
]
EvalDatasetOption = Annotated[
    Optional[str],
    typer.Option(
        help="evaluation data (same forms); default: the held-out part of the calibration data; 'none' skips"
    ),
]
VerboseOption = Annotated[bool, typer.Option(help="show Prefect's logs")]
DeviceOption = Annotated[
    Optional[str],
    typer.Option(
        envvar=DEVICE_ENV,
        parser=device_option,
        metavar="cpu|cuda|cuda:N|auto",
        help="where models compute (statistics, refinement, evaluation, LoRA): auto takes the GPU when "
        "torch sees one; decompositions stay on the CPU in float64; default cpu",
    ),
]
DaskOption = Annotated[
    Optional[str],
    typer.Option(
        envvar=DASK_ENV,
        parser=dask_option,
        metavar="local[:N]|tcp://HOST:PORT",
        help="run the flow's tasks on Dask: local[:N] starts N worker processes here for this command "
        "(default N: the CPU count, at most 4); tcp://HOST:PORT uses a running scheduler, whose workers need "
        "lrkv and the same store (a shared directory or s3://); default: threads in this process",
    ),
]


def cache_option(what: str, default: str):
    return Annotated[
        Optional[str],
        typer.Option(
            help=f"{what}, by name or as a YAML mapping of its options, e.g. '{{name: gear, bits: 2}}' "
            f"({choices(CACHE_STORAGES)}); default: {default}",
            parser=cache_storage,
            metavar="NAME|{name: NAME, ...}",
        ),
    ]


def set_option(example: str):
    return Annotated[
        Optional[list[str]], typer.Option("--set", help=f"recipe override, e.g. --set {example}")
    ]


def configure_prefect(store: str | None, verbose: bool) -> None:
    """Settings Prefect reads at start-up; set before it is imported, and only where the user has not."""
    from lrkv_tasks.store.artifact_store import RESULTS, LocalStore, is_s3

    local = LocalStore(None if is_s3(store) else store).path  # tasks keep their results in the store itself
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(local / RESULTS))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not verbose:  # the CLI shows progress and reports failures itself; run logs still reach the API
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
        logging.getLogger("mlflow").setLevel(logging.WARNING)


def use_device(device: str | None) -> None:
    """``--device``: the tasks' ``LRKV_DEVICE`` for this command (set before a local Dask cluster starts, so
    its workers inherit it)."""
    if device:
        os.environ[DEVICE_ENV] = device
        console.print(f"models compute on {device}", soft_wrap=True)


@contextmanager
def prefect_api():
    """Connect to a Prefect API (a running server, else one this process owns: :mod:`lrkv_flows.apiserver`)
    and yield the context that runs a flow under signal handling (:mod:`lrkv_flows.interrupt`)."""
    from lrkv_flows.apiserver import connect
    from lrkv_flows.interrupt import supervised

    try:
        server = connect()
    except RuntimeError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:  # Ctrl-C while the API server starts: its set-up is left clean (apiserver.py)
        console.print("interrupted (SIGINT) while starting the Prefect API server")
        raise typer.Exit(130) from None
    try:
        yield supervised(server, lambda line: console.print(escape(line), soft_wrap=True))
    except KeyboardInterrupt:  # Ctrl-C outside the flow's own handlers (e.g. while its modules load)
        console.print("interrupted (SIGINT)")
        raise typer.Exit(130) from None
    finally:
        if server is not None:
            server.stop()


def dask_block(value: str | None, store: str | None) -> AbstractContextManager:
    """``--dask``: checked when called, before any API server starts; the returned context runs the flow's
    tasks on a Dask cluster (:mod:`lrkv_flows.cluster`). Enter it inside :func:`prefect_api`: a local
    cluster's workers send their task runs' states and logs to that API, so the cluster closes before the
    API stops."""
    from ..apiserver import running_services
    from ..cluster import parse_dask

    if value and parse_dask(value).address and not (os.environ.get("PREFECT_API_URL") or running_services()):
        raise fail(
            f"--dask {value} needs a Prefect server its workers can reach: run `lrkv up` or set "
            "PREFECT_API_URL (the API this command would start for itself is on 127.0.0.1 and ends with it)"
        )
    return _dask_cluster(value, store)


@contextmanager
def _dask_cluster(value: str | None, store: str | None):
    from lrkv_tasks.store.artifact_store import default_store_root, is_s3

    from ..cluster import dask_cluster

    with ExitStack() as stack:
        try:
            spec = stack.enter_context(dask_cluster(value))
        except OSError as e:
            raise fail(str(e)) from None
        if spec is not None:
            console.print(f"tasks run on {spec.describe()}", soft_wrap=True)
        if spec is not None and spec.workers is None and not is_s3(store):
            where = escape(store or str(default_store_root()))
            console.print(
                f"[cyan]note:[/cyan] the Dask workers read and write the artifact store {where}: on other "
                "hosts it must be a directory they share, or s3:// (--store)",
                soft_wrap=True,
            )
        yield spec


def build_builtin(model_ref: str) -> None:
    """A ``builtin:`` model is built here on first use (about two minutes), with a progress bar."""
    if not model_ref.startswith("builtin:"):
        return
    from lrkv_demo.builtin import ensure_builtin_model

    with rich_progress(), step(f"{model_ref} (built on first use)") as advance:
        name = model_ref.split(":", 1)[1]
        ensure_builtin_model(name, progress=lambda done, total, _loss: advance(done, total))


def start_command(store: str | None, verbose: bool, model: str) -> None:
    """What a command that runs a flow does before it: the home must be writable (Prefect's and MLflow's
    local databases, logs and caches live there), Prefect's settings, and a ``builtin:`` model built."""
    require_home()
    configure_prefect(store, verbose)
    with user_errors():
        build_builtin(model)


def step(description: str):
    """A progress step (:func:`lrkv_tasks.progress.step`), imported when a command runs."""
    from lrkv_tasks.progress import step as progress_step

    return progress_step(description)


def fraction(text: str) -> float:
    """``1%`` or ``0.01`` as 0.01."""
    return float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)
