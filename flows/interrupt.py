"""Stopping a CLI run: Ctrl-C / SIGTERM end it within seconds, recorded, with no process left behind.

:func:`supervised` wraps a flow call. On SIGINT or SIGTERM it marks the MLflow runs this process has open
KILLED, marks the Prefect flow runs it started CANCELLED, stops the API server it owns, prints
"interrupted" and exits 130 (SIGINT) or 143 (SIGTERM) at once: worker threads busy in a torch call are
not waited for (their results were never recorded, so a re-run computes them again). A second signal
during that clean-up exits immediately. If the owned API server dies while the flow runs, the run is
failed the same way (exit 1) instead of going on to export and register results the orchestrator never
recorded.

Prefect's flow engine swaps SIGTERM for its own handler while a flow runs: it raises in the main thread and
then waits for the running tasks to end (minutes inside a long torch call) before passing the signal on.
That bridge lets a Prefect worker cancel a flow-run process it started; a CLI run has no such worker, so
while it is supervised the engine leaves SIGTERM to the handler here (``timeout`` and ``kill`` stop it as
Ctrl-C does).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

from .apiserver import OwnedServer

FLOW_RUNS: set[str] = set()  # Prefect flow runs started by this process and not yet finished


def _short_http_timeouts() -> None:
    """Clean-up calls must not wait on MLflow's default retries (minutes when a server is gone)."""
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "5"
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "1"


def _cancel_flow_runs(reason: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        for run_id in list(FLOW_RUNS):
            client.set_flow_run_state(run_id, Cancelled(message=reason), force=True)


def _clean_up(server: OwnedServer | None, status: str, reason: str, say: Callable[[str], None]) -> None:
    from lrkv_tasks.tracking.mlflow_runs import close_open_runs

    _short_http_timeouts()
    steps = [("MLflow", lambda: close_open_runs(status)), ("Prefect", lambda: _cancel_flow_runs(reason))]
    for what, step in steps:
        try:
            step()
        except Exception as err:  # best effort while exiting: say what could not be recorded, then go on
            first = str(err).splitlines()[0] if str(err) else repr(err)
            say(f"could not record the interruption in {what}: {first}")
    if server is not None:
        server.stop(drain=False)  # exiting now: what was not sent yet is dropped


class ApiServerGone(RuntimeError):
    """The Prefect API went away while the flow ran: its results must not be published."""


def require_api() -> None:
    """Raise :class:`ApiServerGone` unless the Prefect API answers.

    The watchdog polls the owned server once a second; a flow with little work left can reach its
    publishing steps (closing the MLflow run FINISHED, registering, exporting) inside that second, so the
    flow asks here first and fails instead of publishing what the orchestrator never recorded.
    """
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        err = client.api_healthcheck()
    if err is not None:
        gone = type(err).__name__
        raise ApiServerGone(f"the Prefect API server exited unexpectedly ({gone}); nothing was published")


@contextmanager
def _engine_keeps_our_sigterm() -> Iterator[None]:
    """Inside: flow runs leave SIGTERM to the handler of :func:`supervised` (see the module docstring)."""
    from prefect import flow_engine

    bridge = flow_engine.capture_sigterm
    flow_engine.capture_sigterm = nullcontext
    try:
        yield
    finally:
        flow_engine.capture_sigterm = bridge


@contextmanager
def supervised(server: OwnedServer | None, say: Callable[[str], None]) -> Iterator[None]:
    """Run the block with SIGINT/SIGTERM handlers and an API watchdog (see the module docstring)."""
    exiting = threading.Event()

    def finish(code: int, status: str, message: str) -> None:
        if exiting.is_set():
            os._exit(code)  # a second signal: no more clean-up
        exiting.set()
        started = time.monotonic()
        say(message)
        _clean_up(server, status, message, say)
        say(f"stopped in {time.monotonic() - started:.1f}s")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def on_signal(signum, frame) -> None:
        name = signal.Signals(signum).name
        finish(128 + signum, "KILLED", f"interrupted ({name}): the run is marked KILLED; re-run to resume")

    def watch_server() -> None:
        while not exiting.is_set():
            if server is not None and not server.alive():
                finish(
                    1, "FAILED", "error: the Prefect API server exited unexpectedly; the run is marked FAILED"
                )  # noqa: E501
            time.sleep(1.0)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    if server is not None:
        threading.Thread(target=watch_server, daemon=True, name="api-watchdog").start()
    try:
        with _engine_keeps_our_sigterm():
            yield
    finally:
        exiting.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
