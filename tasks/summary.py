"""What a flow run shows in the Prefect UI: a markdown artifact with its results and its MLflow run."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_markdown_artifact

from lrkv_core.evaluation.longcontext import LongContextResult

from .results import ConvertResult


def mlflow_link(run: dict) -> str:
    """The run's page in the MLflow UI when the tracking URI is a server, else where the run is stored."""
    uri, exp, rid = run["tracking_uri"], run["experiment_id"], run["run_id"]
    if uri.startswith(("http://", "https://")):
        return f"[{rid}]({uri.rstrip('/')}/#/experiments/{exp}/runs/{rid})"
    return f"`{rid}` (experiment {exp}, {uri})"


def measure_rows(result: ConvertResult) -> list[tuple[str, str, str]]:
    """(measure, base, compressed) rows of a conversion, formatted: the table the CLI prints and the Prefect
    UI's summary shows."""
    ev, plan = result.eval, result.plan.meta
    base, comp, before = ev.base, ev.compressed, ev.before_lora
    rows = []
    if base and comp:
        rows.append(("prefill ppl", f"{base.prefill_ppl:.4f}", f"{comp.prefill_ppl:.4f}"))
        rows.append(("decode ppl", f"{base.decode_ppl:.4f}", f"{comp.decode_ppl:.4f}"))
        if before:  # the compressed column is the recovered model
            rows.append(("prefill ppl before LoRA", "", f"{before.prefill_ppl:.4f}"))
            rows.append(("decode ppl before LoRA", "", f"{before.decode_ppl:.4f}"))
        if comp.kl is not None:
            rows.append(("KL(base ‖ compressed) nats/token", "0", f"{comp.kl_to_base:.5f}"))
            rows.append(("top-1 agreement", "1", f"{comp.top1_agreement:.4f}"))
            if before and before.kl is not None:
                rows.append(("KL before LoRA", "", f"{before.kl_to_base:.5f}"))
                rows.append(("top-1 agreement before LoRA", "", f"{before.top1_agreement:.4f}"))
        base_scores = base.zeroshot_scores()
        for task, scores in comp.zeroshot_scores().items():
            for metric, value in scores.items():
                rows.append((f"{task} {metric}", f"{base_scores[task][metric]:.4f}", f"{value:.4f}"))
        rows.append(("KV bytes/token", f"{base.kv_bytes_per_token:.1f}", f"{comp.kv_bytes_per_token:.1f}"))
        if base.decode_kv_bytes_per_token is not None and comp.decode_kv_bytes_per_token is not None:
            after = f"{base.decode_kv_bytes_per_token:.1f}", f"{comp.decode_kv_bytes_per_token:.1f}"
            rows.append(("KV bytes/token after the decode", *after))
        ratio = ev.kv_bytes_ratio
        rows.append(("KV bytes ratio (measured)", "1", f"{ratio:.4f}"))
        rows.append(("KV compression (measured)", "1×", f"{1 / ratio:.2f}×"))
    rows.append((f"KV width ratio (target {plan['target_ratio']})", "1", f"{plan['achieved_ratio']:.4f}"))
    if result.lora is not None:
        m = result.lora.meta
        steps = f"{m['steps']} ({m['steps_run']}) / {m['seconds']:.1f}"
        rows.append(("LoRA steps (this run) / seconds", "", steps))
        if m.get("eval_loss_before") is not None:
            loss = f"{m['eval_loss_before']:.4f} → {m['eval_loss_after']:.4f}"
            rows.append(("LoRA held-out loss before → after", "", loss))
    return rows


def task_rows(result: ConvertResult) -> list[tuple[str, str, str, str]]:
    """(task, state, seconds, peak RSS GiB) of each task the conversion ran or read from the cache."""
    rows = []
    for row in result.timings:
        seconds = "—" if row["seconds"] is None else f"{row['seconds']:.2f}"
        peak = row.get("peak_rss_bytes")
        rows.append((row["task"], row["state"], seconds, "—" if peak is None else f"{peak / 2**30:.2f}"))
    return rows


def long_markdown(result: ConvertResult) -> str | None:
    """The compressed model's long-context suite as markdown tables, None when it did not run."""
    comp = result.eval.compressed
    if comp is None or comp.long is None:
        return None
    return LongContextResult.from_dict(comp.long).markdown()


def registration_line(reg: dict[str, Any]) -> str:
    """The registered model's name, version and aliases, and what the quality gate said."""
    gate = "passed" if reg["gate"]["passed"] else "not passed"
    return (
        f"{reg['name']} v{reg['version']} as {', '.join(reg['aliases'])} "
        f"(quality gate {gate}: {reg['gate']['reason']})"
    )


def summary_markdown(result: ConvertResult) -> str:
    """The convert flow's result as markdown: the measures, the plan, the registration, the task table."""
    lines = ["# lrkv conversion", "", f"Model: `{result.recipe.model}`", ""]
    lines += ["| measure | base | compressed |", "|---|---|---|"]
    lines += [f"| {name} | {base} | {comp} |" for name, base, comp in measure_rows(result)]
    long = long_markdown(result)
    if long is not None:
        lines += ["", "## Long-context suite", "", long]
    lines += ["", f"MLflow run: {mlflow_link(result.mlflow)}"]
    if result.registered:
        lines.append(f"Registered: {registration_line(result.registered)}")
    lines += ["", "| task | state | seconds | peak RSS GiB |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in task_rows(result)]
    return "\n".join(lines) + "\n"


def publish_summary(result: ConvertResult) -> None:
    """Attach the summary to the current flow run as a Prefect markdown artifact (key ``lrkv-convert``)."""
    create_markdown_artifact(
        summary_markdown(result),
        key="lrkv-convert",
        description=f"lrkv conversion of {result.recipe.model}",
    )
