"""The ``lrkv`` command's entry point: the CLI (:mod:`lrkv_flows.cli`), with Ctrl-C handled while it loads
(:mod:`lrkv_flows.loading`) and a quick exit (:mod:`lrkv_flows.exiting`)."""

from __future__ import annotations

from .exiting import freeze_at_exit
from .loading import loading


def main() -> None:
    freeze_at_exit()
    with loading():
        from .cli import app
    app()


if __name__ == "__main__":
    main()
