"""What a flow run shows in the Prefect UI: a markdown artifact with its results and its MLflow run."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact

from lrkv_core.longcontext import LongContextResult


def mlflow_link(run: dict) -> str:
    """The run's page in the MLflow UI when the tracking URI is a server, else where the run is stored."""
    uri, exp, rid = run["tracking_uri"], run["experiment_id"], run["run_id"]
    if uri.startswith(("http://", "https://")):
        return f"[{rid}]({uri.rstrip('/')}/#/experiments/{exp}/runs/{rid})"
    return f"`{rid}` (experiment {exp}, {uri})"


def summary_markdown(result: dict) -> str:
    """The convert flow's result as markdown: the measures, the plan, the registration, the task table."""
    lines = ["# lrkv conversion", "", f"Model: `{result['recipe'].model}`", ""]
    base, comp = result["eval"]["base"], result["eval"]["compressed"]
    plan = result["plan"].meta
    lines += ["| measure | base | compressed |", "|---|---|---|"]
    if base and comp:
        for name, a, b in (("prefill PPL", "prefill", "ppl"), ("decode PPL", "decode", "ppl")):
            lines.append(f"| {name} | {base[a][b]:.4f} | {comp[a][b]:.4f} |")
        before = result["eval"].get("before_lora")
        if before:
            for name in ("prefill", "decode"):
                lines.append(f"| {name} PPL before LoRA | | {before[name]['ppl']:.4f} |")
        kv = "kv_bytes_per_token"
        lines.append(f"| KV bytes/token | {base['kv'][kv]:.1f} | {comp['kv'][kv]:.1f} |")
    lines.append(f"| KV width ratio (target {plan['target_ratio']}) | 1 | {plan['achieved_ratio']:.4f} |")
    lora = result.get("lora")
    if lora is not None:
        lines.append(
            f"| LoRA recovery steps / seconds | | {lora.meta['steps']} / {lora.meta['seconds']:.1f} |"
        )
    long = (comp or {}).get("long")
    if long is not None:
        lines += ["", "## Long-context suite", "", LongContextResult.from_dict(long).markdown()]
    lines += ["", f"MLflow run: {mlflow_link(result['mlflow'])}"]
    reg = result.get("registered")
    if reg:
        gate = "passed" if reg["gate"]["passed"] else "not passed"
        lines.append(
            f"Registered: `{reg['name']}` v{reg['version']} ({', '.join(reg['aliases'])}); "
            f"quality gate {gate}: {reg['gate']['reason']}"
        )
    lines += ["", "| task | state | seconds | peak RSS GiB |", "|---|---|---|---|"]
    for row in result["timings"]:
        seconds = "—" if row["seconds"] is None else f"{row['seconds']:.2f}"
        peak = row.get("peak_rss_bytes")
        peak = "—" if peak is None else f"{peak / 2**30:.2f}"
        lines.append(f"| {row['task']} | {row['state']} | {seconds} | {peak} |")
    return "\n".join(lines) + "\n"


def publish_summary(result: dict) -> None:
    """Attach the summary to the current flow run as a Prefect markdown artifact (key ``lrkv-convert``)."""
    create_markdown_artifact(
        summary_markdown(result),
        key="lrkv-convert",
        description=f"lrkv conversion of {result['recipe'].model}",
    )
