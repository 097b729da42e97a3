"""Figures for run artifacts. Matplotlib lives here, never in lrkv_core.

Figures are drawn on an explicit Agg canvas (no pyplot, no global backend switch), so importing this module
changes nothing and plotting works without a display.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lrkv_core.allocation import RankPlan
from lrkv_core.evaluation.longcontext import LongContextResult

from ..recipes.convert_recipe import method_label


def rank_matrix(plan: RankPlan) -> tuple[np.ndarray, list[str]]:
    """(L, 2·G) ranks, columns K groups then V groups, and the column labels."""
    n_groups = len(plan.ranks["k"][0])
    rows = [list(rk) + list(rv) for rk, rv in zip(plan.ranks["k"], plan.ranks["v"], strict=True)]
    labels = [
        f"{kind.upper()}{g}" if n_groups > 1 else kind.upper() for kind in "kv" for g in range(n_groups)
    ]
    return np.asarray(rows, dtype=float), labels


def plot_rank_heatmap(plan: RankPlan, path: str | Path, *, annotate: bool | None = None) -> Path:
    """Heatmap of a rank plan, layers × (K groups | V groups), like Palu's Fig. 8; writes a PNG.

    Cells are coloured by kept fraction of the group width (0..1, shared scale across plans) and labelled
    with the rank when the grid is small enough to read (``annotate=None``: up to 40 × 16 cells).
    """
    ranks, labels = rank_matrix(plan)
    n_layers, n_cols = ranks.shape
    annotate = n_layers <= 40 and n_cols <= 16 if annotate is None else annotate
    fig = Figure(figsize=(min(2.0 + 0.55 * n_cols, 14.0), min(1.6 + 0.28 * n_layers, 18.0)), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(ranks / plan.group_width, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    n_groups = n_cols // 2
    ax.axvline(n_groups - 0.5, color="white", linewidth=2)  # K | V
    ax.set_xticks(range(n_cols), labels, fontsize=8)
    step = max(1, n_layers // 20)
    ax.set_yticks(range(0, n_layers, step), [str(i) for i in range(0, n_layers, step)], fontsize=8)
    ax.set_xlabel("K groups | V groups")
    ax.set_ylabel("layer")
    if annotate:
        for (i, j), r in np.ndenumerate(ranks):
            colour = "black" if r / plan.group_width > 0.6 else "white"
            ax.text(j, i, f"{int(r)}", ha="center", va="center", fontsize=7, color=colour)
    ax.set_title(
        f"{method_label(plan.allocator)} ranks "
        f"(group width {plan.group_width}, multiple {plan.rank_multiple})\n"
        f"target {plan.target_ratio:.3f}, achieved {plan.achieved_ratio:.4f}",
        fontsize=9,
    )
    fig.colorbar(image, ax=ax, label="kept fraction of group width", fraction=0.05, pad=0.03)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out


def plot_loss_curve(history: list[dict], evals: list[dict], path: str | Path) -> Path:
    """LoRA recovery's loss per step (and its running mean) with the held-out losses; writes a PNG."""
    fig = Figure(figsize=(6.4, 3.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = np.array([h["step"] for h in history], dtype=float)
    loss = np.array([h["loss"] for h in history], dtype=float)
    ax.plot(steps, loss, color="tab:blue", alpha=0.35, linewidth=0.8, label="train loss (per step)")
    window = max(1, len(loss) // 20)
    if len(loss) >= window > 1:
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1 :], smooth, color="tab:blue", label=f"train loss (mean of {window})")
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], "o-", color="tab:orange",
                label="held-out loss")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("next-token NLL (nats)")
    ax.set_title("LoRA recovery", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out


def plot_pareto_front(rows: list[dict], max_ppl_rise: float, best: dict | None, path: str | Path) -> Path:
    """A search's candidates, KV bytes/token against prefill PPL rise (%), one colour per arm, with the
    Pareto front, the budget and the smallest candidate within it; writes a PNG."""
    fig = Figure(figsize=(7.2, 4.4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ok = [r for r in rows if r.get("error") is None]
    for arm in dict.fromkeys(r["arm"] for r in ok):
        pts = sorted((r["kv_bytes_per_token"], 100 * r["ppl_rise_rel"]) for r in ok if r["arm"] == arm)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", alpha=0.7, label=arm)
    front = sorted((r["kv_bytes_per_token"], 100 * r["ppl_rise_rel"]) for r in ok if r.get("on_front"))
    if front:
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="black", linewidth=1,
                label="Pareto front")  # fmt: skip
    ax.axhline(100 * max_ppl_rise, color="tab:red", linestyle="--", linewidth=1, label="budget")
    if best is not None:
        ax.plot([best["kv_bytes_per_token"]], [100 * best["ppl_rise_rel"]], "*", markersize=14,
                color="gold", markeredgecolor="black", label="smallest within budget")  # fmt: skip
    ax.set_xlabel("measured KV bytes per token")
    ax.set_ylabel("prefill PPL rise over the original (%)")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out


def plot_long_context(result: LongContextResult, path: str | Path) -> Path:
    """The long-context suite in one PNG: continuation perplexity per context length (the model and the
    original), then one depth × length heatmap of exact-match accuracy per retrieval task."""
    tasks = [t for t in result.protocol.tasks if any(r.task == t for r in result.retrieval)]
    n = 1 + len(tasks)
    fig = Figure(figsize=(4.2 * n, 3.6), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, n, 1)
    contexts = [c.context_len for c in result.continuation]
    ax.plot(contexts, [c.ppl for c in result.continuation], "o-", label="model")
    if any(c.base_ppl is not None for c in result.continuation):
        ax.plot(contexts, [c.base_ppl for c in result.continuation], "s--", label="original")
    if contexts:
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.set_xlabel("context tokens")
    ax.set_ylabel(f"perplexity of the next {result.protocol.continuation} tokens")
    ax.legend(fontsize=8)
    for i, task in enumerate(tasks, start=2):
        grid = result.grid(task)  # {depth: {length: accuracy}}
        depths = list(grid)
        lengths = sorted({int(n) for row in grid.values() for n in row})
        values = np.array([[grid[d].get(str(n), np.nan) for n in lengths] for d in depths], dtype=float)
        hx = fig.add_subplot(1, n, i)
        image = hx.imshow(values, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        hx.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=8)
        hx.set_yticks(range(len(depths)), depths, fontsize=8)
        hx.set_xlabel("prompt tokens")
        hx.set_ylabel("needle depth")
        hx.set_title(f"{task}: exact match", fontsize=9)
        for (r, c), v in np.ndenumerate(values):
            if not np.isnan(v):
                hx.text(
                    c,
                    r,
                    f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if v < 0.6 else "black",
                )
        fig.colorbar(image, ax=hx, fraction=0.05, pad=0.03)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out
