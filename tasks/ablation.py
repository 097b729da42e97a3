"""The ablation summary: one table (CSV + Markdown), a perplexity-vs-ratio plot, one MLflow run."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from prefect import task

from .recipes.convert_recipe import method_label
from .results import ConvertResult
from .store.artifact_store import LocalStore, is_s3

COLUMNS = [
    "decomposition",
    "group_size",
    "allocator",
    "ratio",
    "achieved_ratio",
    "prefill_ppl",
    "prefill_rise",
    "decode_ppl",
    "decode_rise",
    "kl",
    "top1_agreement",
    "kv_bytes_ratio",
    "error",
]


def ablation_row(compression: Any, result: ConvertResult | None, error: str | None = None) -> dict:
    """One table row from a grid point's compression section and its convert-flow result (or the error
    that stopped it)."""
    row = {
        "decomposition": method_label(compression.decomposition),
        "group_size": compression.group_size,
        "allocator": method_label(compression.allocator),
        "ratio": compression.ratio,
    }
    if result is None:
        return row | {"error": error}
    base, comp = result.eval.base, result.eval.compressed
    row["group_size"] = result.recipe.compression.group_size  # "auto" resolved
    return row | {
        "achieved_ratio": result.plan.meta["achieved_ratio"],
        "prefill_ppl": comp.prefill_ppl,
        "prefill_rise": comp.prefill_ppl - base.prefill_ppl,
        "decode_ppl": comp.decode_ppl,
        "decode_rise": comp.decode_ppl - base.decode_ppl,
        "kl": comp.kl_to_base,
        "top1_agreement": comp.top1_agreement,
        "kv_bytes_ratio": result.eval.kv_bytes_ratio,
        "base_prefill_ppl": base.prefill_ppl,
        "base_decode_ppl": base.decode_ppl,
    }


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v))


def to_markdown(rows: list[dict], base: dict) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    lines = ["| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    ok = [r for r in rows if r.get("error") is None]
    if not ok:
        return head + "\n".join(lines) + "\n\nNo row succeeded: each row's error is in its last column.\n"
    note = f"\nOriginal model: prefill PPL {base['prefill_ppl']:.4f}, decode PPL {base['decode_ppl']:.4f}.\n"
    for ratio in sorted({r["ratio"] for r in ok}, reverse=True):
        best = min((r for r in ok if r["ratio"] == ratio), key=lambda r: r["prefill_ppl"])
        note += (
            f"Best at ratio {ratio} (lowest prefill PPL): "
            + ", ".join(
                f"{k}={_fmt(best[k])}"
                for k in ("decomposition", "group_size", "allocator", "prefill_ppl", "kl")
            )
            + "\n"
        )
    return head + "\n".join(lines) + "\n" + note


def plot_ppl_vs_ratio(rows: list[dict], base_ppl: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("error") is None:
            label = f"{r['decomposition']} g{r['group_size']} {r['allocator']}"
            series.setdefault(label, []).append((r["achieved_ratio"], r["prefill_ppl"]))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.axhline(base_ppl, color="black", linestyle="--", linewidth=1, label="original")
    ax.set_xlabel("kept KV width (achieved ratio)")
    ax.set_ylabel("prefill perplexity")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table_csv(rows: list[dict], columns: list[str]) -> str:
    """``rows`` as CSV text with these columns (other keys left out)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def summary_dir(store: str | None, out_dir: str | None, default: str) -> Path:
    """Where a summary's tables go: ``out_dir``, else ``default`` under the local store (an S3 store: under
    ``$LRKV_HOME``); created."""
    local_root = LocalStore(None if store is None or is_s3(store) else store).path
    target = Path(out_dir) if out_dir else local_root / default
    target.mkdir(parents=True, exist_ok=True)
    return target


def log_summary(recipe: dict, run_name: str, kind: str, **logged) -> dict:
    """One complete MLflow run of a summary over conversions of ``recipe["base"]["model"]``: the recipe as
    params with lrkv's versions, tagged ``lrkv.kind``; ``logged``: the metrics, artifacts, tables and figures
    of :func:`lrkv_tasks.tracking.mlflow_runs.log_conversion`."""
    from .recipes.convert_recipe import flatten
    from .tracking.mlflow_runs import log_conversion, versions

    tracking, model = recipe["base"]["tracking"], recipe["base"]["model"]
    return log_conversion(
        tracking_uri=tracking["mlflow_uri"],
        experiment=tracking["experiment"],
        run_name=f"{run_name}-{Path(model).name}",
        params={f"recipe.{k}": v for k, v in flatten(recipe).items()}
        | {f"version.{k}": v for k, v in versions().items()},
        tags={"lrkv.kind": kind, "lrkv.model": model},
        **logged,
    )


@task(name="summarize_ablation")
def summarize_ablation(rows: list[dict], recipe: dict, store: str, out_dir: str | None) -> dict:
    """Write the ablation table and plot, and log them to MLflow in one run."""
    ok = [r for r in rows if r.get("error") is None]
    base = {"prefill_ppl": ok[0]["base_prefill_ppl"], "decode_ppl": ok[0]["base_decode_ppl"]} if ok else {}
    target = summary_dir(store, out_dir, "ablations")
    files = {"ablation.csv": table_csv(rows, COLUMNS), "ablation.md": to_markdown(rows, base)}
    for name, text in files.items():
        (target / name).write_text(text)
    if ok:
        plot_ppl_vs_ratio(rows, base["prefill_ppl"], target / "ablation_ppl_vs_ratio.png")
    run = log_summary(
        recipe,
        "ablate",
        "ablation",
        metrics={"rows": len(rows), "failed_rows": len(rows) - len(ok)},
        json_artifacts={"ablation_rows.json": {"rows": rows}},
        file_artifacts={p.name: str(p) for p in sorted(target.iterdir()) if p.name.startswith("ablation")},
    )
    return {
        "dir": str(target),
        "mlflow": run,
        "markdown": files["ablation.md"],
        "failed_rows": len(rows) - len(ok),
    }
