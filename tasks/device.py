"""The device the tasks compute on: ``LRKV_DEVICE`` (``cpu``, ``cuda``, ``cuda:N`` or ``auto``; default
``cpu``), which the CLI's ``--device`` and ``lrkv deploy --device`` set.

It is read when each task runs, never part of a task's cache key: a step computed on a GPU is the same step
on the CPU to float rounding, so a conversion started on one resumes on the other. Dask workers on other
hosts need it in their own environment (a local cluster inherits the command's).
"""

from __future__ import annotations

import os

from lrkv_core.models import parse_device

ENV = "LRKV_DEVICE"


def task_device() -> str:
    """``LRKV_DEVICE`` (default ``cpu``), checked: a clear error for a name torch does not know or a GPU it
    cannot see."""
    value = os.environ.get(ENV, "cpu")
    parse_device(value)
    return value
