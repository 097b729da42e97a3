"""One module per command of the ``lrkv`` command line; :mod:`lrkv_flows.cli` assembles them."""
