"""The task runner of every lrkv flow: threads, or Dask as ``LRKV_DASK`` says (:mod:`lrkv_flows.cluster`)."""

from __future__ import annotations

import os

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from .cluster import ENV, local_cluster_kwargs, parse_dask, worker_environment


def configured_task_runner() -> TaskRunner:
    """The task runner ``LRKV_DASK`` selects now: a thread pool when unset, else a ``DaskTaskRunner``."""
    value = os.environ.get(ENV)
    if not value:
        return ThreadPoolTaskRunner()
    from prefect_dask import DaskTaskRunner

    spec = parse_dask(value)
    if spec.address:
        return DaskTaskRunner(address=spec.address)
    worker_environment()
    return DaskTaskRunner(cluster_kwargs=local_cluster_kwargs(spec.workers))


class ConfiguredTaskRunner(ThreadPoolTaskRunner):
    """Prefect starts each flow run on ``flow.task_runner.duplicate()``; this one's duplicate is
    :func:`configured_task_runner`, so the runner is chosen per flow run, from the environment at that time,
    not once when the flow is imported."""

    def duplicate(self) -> TaskRunner:
        return configured_task_runner()


def worker_count() -> int:
    """Workers of the running flow's task runner: those of its Dask cluster, else 1 (threads share one
    process, so splitting a whole-model pass among them gains nothing)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    runner = ctx.task_runner if ctx is not None else None
    if runner is None or not hasattr(runner, "client"):
        return 1
    return max(1, len(runner.client.scheduler_info().get("workers", {})))
