"""The ``lrkv`` command's entry point: the CLI, with Ctrl-C handled while its modules load.

Loading the CLI imports torch, transformers and Prefect, which takes seconds; a SIGINT in that time would
otherwise end in a KeyboardInterrupt traceback from deep inside an import. Here it ends the command with one
line and exit code 130, as an interrupt does once the command runs.
"""

from __future__ import annotations

import signal
import sys


def _interrupted_while_loading(signum, frame) -> None:
    print("interrupted (SIGINT) while lrkv was starting", file=sys.stderr)
    raise SystemExit(130)


def main() -> None:
    previous = signal.signal(signal.SIGINT, _interrupted_while_loading)
    try:
        from lrkv_core.system.memory import limit_malloc_arenas

        from .cli import app
    finally:
        signal.signal(signal.SIGINT, previous)
    limit_malloc_arenas()  # before the flows' task threads start (and inherited by the workers it starts)
    app()


if __name__ == "__main__":
    main()
