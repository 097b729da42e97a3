"""The ``lrkv`` command's entry point: the CLI (:mod:`lrkv_flows.cli`), with Ctrl-C handled while it loads
(:mod:`lrkv_flows.loading`)."""

from __future__ import annotations

from .loading import loading


def main() -> None:
    with loading():
        from .cli import app
    app()


if __name__ == "__main__":
    main()
