"""``python -m lrkv_flows``: the ``lrkv`` command."""

from .main import main

main()
