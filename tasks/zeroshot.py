"""Zero-shot tasks through lm-eval's HFLM, on the deployed (compressed) model object.

Hub tasks (``hellaswag``, ``arc_easy``, ...) are for users with network access; a directory of local task
YAMLs (``include_path``) works offline, which is what the tests use.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import task

from lrkv_core.model.loading import load_model

from .convert import CACHED, TASK_KEY
from .device import model_pass, task_device
from .store.artifact_store import local_path
from .store.artifacts import ArtifactRef


def run_zeroshot(
    model_dir: str,
    tasks: list[str],
    *,
    include_path: str | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    dtype: str = "float32",
    device: str = "cpu",
    loglikelihoods: bool = False,
) -> dict[str, Any]:
    """Accuracy-style metrics of lm-eval tasks for one model directory (original or compressed).

    With ``loglikelihoods``, also each document's per-choice log-likelihoods (multiple-choice tasks).
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tokenizer = load_model(model_dir, dtype=dtype, device=device)
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer: lm-eval tasks need one")
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    manager = None
    if include_path:  # indexing lm-eval's thousands of built-in tasks is slow: skip it when all are local
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if not set(tasks) <= set(manager.all_tasks):
            manager = None
    manager = manager or TaskManager(include_path=include_path)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(model.device))
    out = simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=loglikelihoods
    )
    results = {
        name: {
            k.split(",")[0]: v
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and "stderr" not in k
        }
        for name, metrics in out["results"].items()
    }
    samples = {name: n.get("effective", n.get("original")) for name, n in out.get("n-samples", {}).items()}
    extra = {}
    if loglikelihoods:
        extra["loglikelihoods"] = {
            name: [[float(r[0]) for r in doc["filtered_resps"]] for doc in docs]
            for name, docs in out["samples"].items()
        }
    protocol = {"measure": "lm-eval zero-shot", "tasks": tasks, "include_path": include_path, "limit": limit}
    return extra | {"results": results, "protocol": protocol | {"samples": samples}}


@task(name="zeroshot", cache_key_fn=TASK_KEY, **CACHED)
def zeroshot(model: ArtifactRef, eval_cfg: dict, dtype: str, label: str, store: str | None = None) -> dict:
    """lm-eval zero-shot tasks of one model."""
    with model_pass():
        return run_zeroshot(
            str(local_path(model.uri)),
            eval_cfg["zeroshot_tasks"],
            include_path=eval_cfg["zeroshot_include"],
            limit=eval_cfg["zeroshot_limit"],
            batch_size=eval_cfg["batch_size"],
            dtype=dtype,
            device=task_device(),
        )
