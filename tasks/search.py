"""The search for the smallest KV cache within a quality budget: its rows and its summary (a table, the
Pareto front's plot, an MLflow run and a Prefect markdown artifact). The search itself is
:mod:`lrkv_core.conversion.search`, its recipe :mod:`lrkv_tasks.recipes.search_recipe`; the flow that converts
its candidates is :mod:`lrkv_flows.search`."""

from __future__ import annotations

import math
from typing import Any

from prefect import task

from lrkv_core.conversion.search import Budget, Point, SearchResult

from .ablation import ablation_row, log_summary, summary_dir, table_csv
from .results import ConvertResult


def search_row(arm: str, compression: Any, result: ConvertResult | None, error: str | None = None) -> dict:
    """An ablation row (:func:`lrkv_tasks.ablation.ablation_row`) with the arm, the measured KV bytes/token
    and the relative perplexity rise the budget reads."""
    row = ablation_row(compression, result, error) | {"arm": arm}
    if result is None:
        return row
    base, comp = result.eval.base, result.eval.compressed
    return row | {
        "kv_bytes_per_token": comp.kv_bytes_per_token,
        "base_kv_bytes_per_token": base.kv_bytes_per_token,
        "ppl_rise_rel": comp.prefill_ppl / base.prefill_ppl - 1,
    }


def to_point(row: dict) -> Point:
    if row.get("error") is not None:
        return Point(row["arm"], row["ratio"], 0.0, math.inf, None, row["error"])
    return Point(row["arm"], row["ratio"], row["kv_bytes_per_token"], row["ppl_rise_rel"], row["kl"])


COLUMNS = ["arm", "ratio", "achieved_ratio", "kv_bytes_per_token", "ppl_rise_rel", "kl", "prefill_ppl",
           "decode_ppl", "within_budget", "on_front", "error"]  # fmt: skip


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))


def search_markdown(model: str, rows: list[dict], budget: Budget, best: dict | None, cost: dict) -> str:
    """The search as markdown: budget, winner, Pareto front, every point, cost."""
    kl = f", KL ≤ {budget.max_kl}" if budget.max_kl is not None else ""
    lines = [
        f"# lrkv search: `{model}`",
        "",
        f"Budget: prefill PPL rise ≤ {budget.max_ppl_rise:.2%}{kl}.",
        "",
    ]
    if best is None:
        lines.append("**No candidate within the budget.**")
    else:
        lines.append(
            f"Smallest within budget: **{best['arm']} at ratio {best['ratio']}**, "
            f"{best['kv_bytes_per_token']:.1f} KV bytes/token "
            f"(original {best['base_kv_bytes_per_token']:.1f}), "
            f"PPL rise {best['ppl_rise_rel']:+.2%}, KL {best['kl']:.4g}."
        )
    head = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["", "## Pareto front (KV bytes/token vs PPL rise)", "", *head]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |" for r in rows if r.get("on_front")]
    lines += ["", "## Every candidate, in the order measured", "", *head]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    lines += ["", "## Cost", "", "| measure | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in cost.items()]
    return "\n".join(lines) + "\n"


@task(name="summarize_search")
def summarize_search(
    rows: list[dict], result: SearchResult, best: dict | None, cost: dict, recipe: dict, out_dir: str | None
) -> dict:
    """Write the search's table, markdown and Pareto plot, log them to MLflow in one run and publish the
    markdown as the flow run's Prefect artifact."""
    from prefect.artifacts import create_markdown_artifact

    from .tracking.plots import plot_pareto_front

    front = {(p.arm, p.ratio) for p in result.front}
    rows = [
        r | {"within_budget": result.budget.admits(to_point(r)), "on_front": (r["arm"], r["ratio"]) in front}
        for r in rows
    ]
    target = summary_dir(recipe["base"]["store"], out_dir, "searches")
    markdown = search_markdown(recipe["base"]["model"], rows, result.budget, best, cost)
    (target / "search.csv").write_text(table_csv(rows, COLUMNS))
    (target / "search.md").write_text(markdown)
    figures = {}
    if any(r.get("error") is None for r in rows):
        plot_pareto_front(rows, result.budget.max_ppl_rise, best, target / "search_pareto.png")
        figures = {"search_pareto.png": str(target / "search_pareto.png")}
    table = {c: [r.get(c) for r in rows] for c in COLUMNS}
    metrics = {k: float(v) for k, v in cost.items()}
    if best is not None:
        metrics |= {"best_kv_bytes_per_token": best["kv_bytes_per_token"], "best_ratio": best["ratio"]}
    run = log_summary(
        recipe,
        "search",
        "search",
        metrics=metrics,
        json_artifacts={"search_rows.json": {"rows": rows}},
        file_artifacts={"search.csv": str(target / "search.csv"), "search.md": str(target / "search.md")},
        tables={
            "search_points.json": table,
            "pareto_front.json": {c: [r.get(c) for r in rows if r["on_front"]] for c in COLUMNS},
        },
        figures=figures,
    )
    create_markdown_artifact(
        markdown, key="lrkv-search", description=f"lrkv search of {recipe['base']['model']}"
    )
    return {"dir": str(target), "mlflow": run, "markdown": markdown, "rows": rows}
