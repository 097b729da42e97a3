"""lrkv_flows: Prefect flows that wire lrkv_tasks, and the ``lrkv`` command line."""
