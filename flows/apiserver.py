"""The Prefect API the CLI talks to: a running server when there is one, else one it starts and owns.

Prefect's own ephemeral API is a uvicorn subprocess in the CLI's process group: a Ctrl-C in the terminal
kills it along with the CLI (the flow then spends a minute retrying a dead API), and a SIGKILL of the CLI
leaves it running. The server here is started by the CLI itself instead:

- in its own session, so a terminal's Ctrl-C reaches only the CLI, which stops the server after it has
  recorded the interruption;
- with a pipe on its stdin that only the CLI holds: when the CLI exits in any way, SIGKILL included, the
  pipe closes and the server exits (:func:`main`'s watchdog thread), so no server outlives its CLI.

Which API is used (:func:`connect`): ``$PREFECT_API_URL`` when set; else the server ``lrkv up`` started, if
it answers (its URL is in ``$LRKV_HOME/services.json``); else an owned server as above. Run as
``python -m lrkv_flows.apiserver PORT`` it is that server.

Servers of one home share its Prefect database. An owned server starts under the home's set-up lock
(:func:`lrkv_core.system.paths.setup_lock`), so processes started together wait for each other's start-up
instead of migrating one database at once; a database that does not exist yet is first migrated by a separate
process (``python -m lrkv_flows.apiserver --migrate``) into a temporary file beside it and renamed into place
when complete (:func:`prepare_database`), so an interrupted first start leaves no half-migrated database.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import unquote

# lrkv_core's paths are imported where used: importing lrkv_core imports torch and transformers (seconds),
# which the server and migration processes this module runs as never need

SERVICES = "services.json"  # written by `lrkv up`: {"prefect_api": ..., "mlflow": ..., "pids": [...]}


def database_url() -> str:
    """The Prefect database lrkv's servers share (``$LRKV_HOME/prefect.db``), so ``lrkv up``'s UI shows the
    runs made before it started; ``$PREFECT_API_DATABASE_CONNECTION_URL`` overrides it."""
    from lrkv_core.system.paths import writable_home

    return f"sqlite+aiosqlite:///{writable_home() / 'prefect.db'}"


def _sqlite_file(url: str) -> Path | None:
    """The file of a ``sqlite+aiosqlite:///PATH`` URL; None for other databases and in-memory SQLite."""
    scheme, sep, rest = url.partition(":///")
    if not sep or scheme not in ("sqlite", "sqlite+aiosqlite"):
        return None
    path = unquote(rest.split("?", 1)[0])
    return Path(path) if path and path != ":memory:" else None


def prepare_database(url: str, log_path: Path, timeout: float = 600.0) -> None:
    """Create the SQLite database ``url`` names at Prefect's newest schema unless it exists (else no-op).

    Call under the directory's set-up lock. Files a killed set-up left are removed; the migration runs in a
    child process (its output in ``log_path``) on a temporary file that is renamed onto the database's name
    only when complete. An interrupt kills the child and removes the temporary file.
    """
    path = _sqlite_file(url)
    if path is None or path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp*"):
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    env = {**os.environ, "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp}"}
    try:
        with open(log_path, "a") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lrkv_flows.apiserver", "--migrate"],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if code != 0:
            tail = log_path.read_text()[-1500:]
            raise RuntimeError(f"creating the Prefect database {path} failed (log {log_path}): {tail}")
        db = sqlite3.connect(tmp)
        try:  # one self-contained file (out of WAL mode) before the rename
            db.execute("PRAGMA journal_mode=DELETE")
        finally:
            db.close()
        os.replace(tmp, path)
    finally:
        for leftover in path.parent.glob(f"{tmp.name}*"):
            leftover.unlink(missing_ok=True)


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    """Whether a Prefect API answers its health check."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def running_services() -> dict:
    """What ``lrkv up`` recorded, if its Prefect API still answers ({} otherwise)."""
    from lrkv_core.system.paths import lrkv_home

    path = lrkv_home() / SERVICES
    if not path.is_file():
        return {}
    services = json.loads(path.read_text())
    return services if healthy(services.get("prefect_api", "")) else {}


class OwnedServer:
    """A Prefect API server process that lives exactly as long as this process (see the module docstring)."""

    # a busy machine (many lrkv commands starting at once on two cores) can take minutes to import the server
    def __init__(self, timeout: float = 600.0) -> None:
        from lrkv_core.system.paths import setup_lock, writable_home

        home = writable_home()
        log = home / "logs"
        log.mkdir(parents=True, exist_ok=True)
        self.log_path = log / f"prefect-api-{os.getpid()}.log"
        self.log_path.write_text("")
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1"}
        env.setdefault("PREFECT_API_DATABASE_CONNECTION_URL", database_url())
        env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # as `lrkv up`'s server: no telemetry
        with setup_lock(home):  # one server of this home starts (and migrates its database) at a time
            prepare_database(env["PREFECT_API_DATABASE_CONNECTION_URL"], self.log_path)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
            self.api_url = f"http://127.0.0.1:{self.port}/api"
            with open(self.log_path, "a") as log_file:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "lrkv_flows.apiserver", str(self.port)],
                    stdin=subprocess.PIPE,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            try:
                self._wait_healthy(timeout)
            except BaseException:  # not started, or interrupted while starting: no server is left behind
                self.stop(drain=False)
                raise

    def _wait_healthy(self, timeout: float) -> None:
        start = time.monotonic()
        deadline, note = start + timeout, start + 30
        while not healthy(self.api_url):
            if time.monotonic() > note:  # say why nothing happens yet, once
                print(f"waiting for the Prefect API server to start (log {self.log_path})", file=sys.stderr)
                note = float("inf")
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop(drain=False)
                tail = self.log_path.read_text()[-1500:]
                raise RuntimeError(f"the Prefect API server did not start (log {self.log_path}): {tail}")
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 5.0, drain: bool = True) -> None:
        """Terminate the server (SIGKILL if it has not exited within ``timeout`` seconds).

        With ``drain``, Prefect's background log and event senders of this process are drained first: left
        for interpreter exit, they would retry against the stopped server for over a minute.
        """
        if drain and self.proc.poll() is None:
            _drain_prefect_senders(timeout=10.0)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdin:
            self.proc.stdin.close()


def _drain_prefect_senders(timeout: float) -> None:
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        service.drain_all(timeout=timeout)


def connect() -> OwnedServer | None:
    """Point ``PREFECT_API_URL`` at a Prefect API (see the module docstring); returns the server this
    process started, if it had to start one. Call before Prefect is imported."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    services = running_services()
    if services:
        os.environ["PREFECT_API_URL"] = services["prefect_api"]
        return None
    server = OwnedServer()
    os.environ["PREFECT_API_URL"] = server.api_url
    return server


def _exit_with_parent() -> None:
    """Block until stdin closes (the parent exited, however it died), then end this process at once."""
    sys.stdin.buffer.read()
    os._exit(0)


def migrate() -> None:
    """Bring the database ``$PREFECT_API_DATABASE_CONNECTION_URL`` names to Prefect's newest schema."""
    import asyncio

    from prefect.server.database import provide_database_interface

    async def upgrade() -> None:
        db = provide_database_interface()
        await db.create_db()
        await (await db.engine()).dispose()

    asyncio.run(upgrade())


def main(port: int) -> None:
    """Serve Prefect's API on 127.0.0.1:``port`` until stopped or until the parent's pipe closes."""
    threading.Thread(target=_exit_with_parent, daemon=True, name="exit-with-parent").start()
    import uvicorn

    os.environ.setdefault("PREFECT__SERVER_FINAL", "1")
    uvicorn.run(
        "prefect.server.api.server:create_app",
        factory=True,
        host="127.0.0.1",
        port=port,
        log_level="error",
        lifespan="on",
    )


if __name__ == "__main__":
    if sys.argv[1] == "--migrate":
        migrate()
    else:
        main(int(sys.argv[1]))
