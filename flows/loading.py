"""Ctrl-C while the ``lrkv`` command loads its modules: one line and exit code 130, not a traceback.

Loading a command imports torch, transformers, Prefect or MLflow, which takes seconds; a SIGINT in that time
would otherwise end in a KeyboardInterrupt traceback from deep inside an import. Inside :func:`loading` it
ends the command as an interrupt does once the command runs.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def _interrupted_while_loading(signum, frame) -> None:
    print("interrupted (SIGINT) while lrkv was starting", file=sys.stderr)
    raise SystemExit(130)


@contextmanager
def loading() -> Iterator[None]:
    """Inside: modules load; a SIGINT is one line and exit code 130."""
    previous = signal.signal(signal.SIGINT, _interrupted_while_loading)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
