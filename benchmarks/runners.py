"""The convert flow on threads against the same flow on local Dask clusters: wall time, ratio, same results.

Each runner converts the model from scratch (a fresh artifact store and MLflow database, so nothing is
cached) under one Prefect API server; the script prints each run's wall time and its ratio to the threads
run, the seconds the per-layer decompositions took in all, the statistics' passes (each statistic is split
into one shard per worker: its longest shard plus the merge, summed over statistics; the threads run
collects each in one pass) and the compressed model's prefill perplexity (the same on every runner, up to
the rounding of the shards' sums). A local cluster's time includes starting its worker processes.

    python benchmarks/runners.py --model ../shared/models/shakespeare-llama \\
        --dataset text:../shared/data/shakespeare/train.txt --dask local:1,local:2,local:4 \\
        [--allocator uniform]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from lrkv_flows.apiserver import connect
from lrkv_flows.cluster import dask_cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", required=True, help="calibration data (the last 10%% is evaluated)")
    parser.add_argument("--dask", default="local:2", help="comma list of --dask values to compare")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--allocator", default="uniform")
    parser.add_argument("--n-samples", type=int, default=64)
    parser.add_argument("--max-windows", type=int, default=16)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lrkv-runners-"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
    os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(work / "prefect-results")
    server = connect()  # before Prefect is imported: this process's own API unless one is configured
    try:
        from lrkv_flows.convert import convert_flow
        from lrkv_tasks.recipes.convert_recipe import load_recipe

        rows = []
        for runner in ["threads", *args.dask.split(",")]:
            home = work / runner.replace(":", "-")
            recipe = load_recipe(
                None,
                {
                    "model": args.model,
                    "calibration": {"dataset": args.dataset, "n_samples": args.n_samples},
                    "compression": {"ratio": args.ratio, "allocator": args.allocator},
                    "eval": {"max_windows": args.max_windows, "decode_windows": 1},
                    "tracking": {"mlflow_uri": f"sqlite:///{home / 'mlflow.db'}", "experiment": "runners"},
                    "registry": {"enabled": False},
                    "store": str(home / "store"),
                },
            )
            start = time.perf_counter()
            with dask_cluster(None if runner == "threads" else runner):
                result = convert_flow(recipe)
            wall = time.perf_counter() - start
            seconds = {row["task"]: row["seconds"] or 0.0 for row in result.timings}
            decompose = sum(s for task, s in seconds.items() if task.startswith("decompose_layer"))
            ppl = result.eval.compressed.prefill_ppl
            shards = result.recipe.calibration.shards
            rows.append((runner, shards, wall, decompose, statistic_passes(seconds), ppl))
            slowest = sorted(seconds.items(), key=lambda item: -item[1])[:6]
            print(f"{runner}: {wall:.1f} s; slowest tasks: " + ", ".join(f"{t} {s:.1f}" for t, s in slowest))
    finally:
        if server is not None:
            server.stop()
    base = rows[0][2]
    print(f"\n{args.model}, ratio {args.ratio}, {args.allocator}, {args.n_samples} calibration windows")
    header = (
        "runner",
        "shards",
        "wall s",
        "÷ threads",
        "decompose s (sum)",
        "statistics s",
        "÷ threads",
        "ppl",
    )
    print("{:<10} {:>6} {:>8} {:>10} {:>18} {:>12} {:>10} {:>10}".format(*header))
    stats_base = rows[0][4]
    for runner, shards, wall, decompose, stats, ppl in rows:
        print(
            f"{runner:<10} {shards:>6} {wall:>8.1f} {wall / base:>10.2f} {decompose:>18.1f} {stats:>12.1f} "
            f"{stats / stats_base:>10.2f} {ppl:>10.4f}"
        )


def statistic_passes(seconds: dict[str, float]) -> float:
    """Seconds of the statistics' passes as if one ran after another, each as long as its longest shard
    plus its merge (task labels ``collect_statistic[NAME]``, ``collect_statistic[NAME/i]``,
    ``merge_statistic[NAME]``)."""
    longest: dict[str, float] = {}
    for task, s in seconds.items():
        if task.startswith(("collect_statistic[", "merge_statistic[")):
            name = task.split("[", 1)[1].rstrip("]").split("/")[0]
            if task.startswith("merge"):
                longest[name + "+merge"] = s
            else:
                longest[name] = max(longest.get(name, 0.0), s)
    return sum(longest.values())


if __name__ == "__main__":
    main()
