"""Dask for the flows' tasks, chosen by configuration: the ``LRKV_DASK`` value and the CLI's ``--dask``.

``LRKV_DASK`` (read when each flow run starts, so it reaches subflows, deployments' runs and the Dask
workers themselves; :mod:`lrkv_flows.runner`) selects where the tasks of every lrkv flow run:

- unset: Prefect's thread pool in the flow's process (the default);
- ``local`` or ``local:N``: a ``LocalCluster`` of N single-threaded worker processes on this machine (N
  defaults to the CPU count, at most 4), torch in each on every core (:func:`worker_environment`);
- ``tcp://HOST:PORT`` (or ``tls://``): the scheduler of a running cluster (``dask scheduler`` and
  ``dask worker``; infra/docker-compose.yml). Its workers need lrkv installed and the same artifact store:
  a directory they all see, or ``s3://`` with the endpoint and credentials in their environment.

Tasks pass references to artifacts in the store, never tensors, so any task can run on any worker, and
cached results do not depend on where they ran: a conversion started on threads resumes on a cluster and
the other way round. The CLI's ``--dask`` goes through :func:`dask_cluster`, which starts one local
cluster for the whole command (every grid point of an ablation shares it), or first checks that the
scheduler answers. This module does not import Prefect (the CLI parses ``--dask`` before Prefect starts).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ENV = "LRKV_DASK"
FORMS = "local, local:N (N worker processes) or tcp://HOST:PORT (a running scheduler)"
MAX_LOCAL_WORKERS = 4
EXITING = "lrkv_flows.exiting"  # preloaded by local workers: a quick exit
_ADDRESS = re.compile(r"(tcp|tls)://[^\s/]+:\d+")


@dataclass(frozen=True)
class DaskSpec:
    """A parsed ``LRKV_DASK`` value: a local cluster of ``workers`` processes, or a scheduler ``address``
    (both once the CLI has started a local cluster)."""

    address: str | None = None
    workers: int | None = None

    def describe(self) -> str:
        if self.workers is None:
            return f"the Dask scheduler at {self.address}"
        at = f" at {self.address}" if self.address else ""
        processes = "process" if self.workers == 1 else "processes"
        return f"a local Dask cluster of {self.workers} worker {processes}{at}"


def parse_dask(value: str) -> DaskSpec:
    """``local`` | ``local:N`` | ``tcp://HOST:PORT`` | ``tls://HOST:PORT``; a ValueError names the forms."""
    value = value.strip()
    if _ADDRESS.fullmatch(value):
        return DaskSpec(address=value)
    name, _, count = value.partition(":")
    if name == "local":
        if not count:
            return DaskSpec(workers=min(os.cpu_count() or 1, MAX_LOCAL_WORKERS))
        if count.isdigit() and int(count) > 0:
            return DaskSpec(workers=int(count))
    raise ValueError(f"--dask / {ENV} takes {FORMS}, got {value!r}")


def local_cluster_kwargs(workers: int) -> dict:
    """A ``LocalCluster`` on loopback of ``workers`` single-threaded processes (their environment: below)."""
    return {
        "n_workers": workers,
        "threads_per_worker": 1,
        "processes": True,
        "host": "127.0.0.1",
        "dashboard_address": "127.0.0.1:0",  # a free port: two clusters on one host never collide
    }


def worker_environment() -> None:
    """Set the environment Dask's nannies give the worker processes they start (``pre-spawn-environ``).

    It must be set there, not as the cluster's ``env``: a nanny applies it to its own process before it
    spawns a worker, and the worker imports the parent's main module (torch with it) before its ``env``
    applies, so torch reads these at import. Measured on SmolLM2-135M, 2 cores:

    - torch threads: every core. Dask's default of 1 left torch on one core, and the convert flow's Gram
      pass took 53 s in a worker against 28 s on threads; each worker gets the whole machine because the
      flow's heavy steps run one at a time (only the per-layer decompositions run side by side).
    - no ``MALLOC_TRIM_THRESHOLD_``: setting it at all turns off glibc's adaptive mmap threshold, so torch's
      large temporary tensors are mapped and unmapped at every allocation; a forward pass took 12.8–13.4 s
      in such a worker against 9.1–9.9 s in a plain process (12.1 s in a plain process given the variable).
    - no progress bars from transformers: workers have no terminal; the CLI shows its own.

    Each worker also preloads :mod:`lrkv_flows.exiting`, so that it exits within the 4 s its nanny waits.
    """
    import dask

    threads = os.cpu_count() or 1
    env = dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"), threads)
    env |= {"MALLOC_TRIM_THRESHOLD_": None, "HF_HUB_DISABLE_PROGRESS_BARS": 1}
    dask.config.set({f"distributed.nanny.pre-spawn-environ.{name}": value for name, value in env.items()})
    preload = list(dask.config.get("distributed.worker.preload"))
    if EXITING not in preload:
        dask.config.set({"distributed.worker.preload": [*preload, EXITING]})


@contextmanager
def dask_cluster(value: str | None) -> Iterator[DaskSpec | None]:
    """The CLI's ``--dask``: set ``LRKV_DASK`` for the block, after starting the local cluster it names
    (closed at the end) or checking that its scheduler answers (an OSError naming it if not). Yields the
    spec with the scheduler's address; None (threads, nothing set) without a value."""
    if not value:
        yield None
        return
    spec = parse_dask(value)
    from distributed import Client, LocalCluster

    previous = os.environ.get(ENV)
    cluster = None
    try:
        if spec.address:
            try:
                Client(spec.address, timeout="10s").close()
            except OSError as err:  # distributed: "Timed out trying to connect to ..."
                raise OSError(f"no Dask scheduler answers at {spec.address} ({err})") from None
        else:
            worker_environment()
            cluster = LocalCluster(**local_cluster_kwargs(spec.workers))
            spec = DaskSpec(address=cluster.scheduler_address, workers=spec.workers)
        os.environ[ENV] = spec.address
        yield spec
    finally:
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
        if cluster is not None:
            cluster.close()
