"""The LoRA recovery task of the convert flow: train on the compressed model, merge, store the result.

One core call (:func:`lrkv_core.lora.recover_dir`). The task's cache key is the run's identity
(:func:`lrkv_tasks.keys.lora_run_id`: the compressed model's fingerprint, the options, the data files, the
code version), so a re-run with the same inputs is served from the store; the run's checkpoints go to a
directory named by the same identity, so a run killed mid-training resumes from its last checkpoint when the
flow runs again. They are removed once the task has stored its result.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from prefect import task

from lrkv_core.lora import recover_dir
from lrkv_core.system.paths import lrkv_home

from .convert import CACHED, _local, _stored
from .device import model_pass, task_device
from .keys import lora_key, lora_run_id
from .progress import run_logger, step
from .records import checked
from .store.artifacts import ArtifactRef, is_s3
from .tracking.plots import plot_loss_curve

CHECKPOINTS = "lora-checkpoints"


def checkpoint_dir(store: str, run_id: str) -> Path:
    """Where a LoRA run keeps its checkpoints: inside a local store, else under ``$LRKV_HOME`` (training
    reads and writes them locally; with an S3 store a killed run resumes on the same machine)."""
    root = lrkv_home() if is_s3(store) else Path(store)
    return root / CHECKPOINTS / run_id


@task(name="lora_recover", cache_key_fn=checked(lora_key), **CACHED)
def lora_recover(
    built: ArtifactRef, lora: dict, dtype: str, store: str, original: ArtifactRef | None = None
) -> ArtifactRef:
    """Recover a compressed model with LoRA (resuming from a checkpoint) and store the merged model.

    ``lora`` is the recipe's ``lora`` section with its datasets resolved
    (:mod:`lrkv_tasks.recipes.preflight`); ``original`` is the model it was compressed from, which the
    ``distill`` objective fits.
    """
    params = {"built": built, "lora": lora, "dtype": dtype, "store": store, "original": original}
    ckpt = checkpoint_dir(store, lora_run_id(params))
    dataset, eval_dataset = lora["dataset"], lora["eval_dataset"]
    options = {k: v for k, v in lora.items() if k not in ("dataset", "eval_dataset")}
    summary: dict = {}
    logger = run_logger()

    def report(record: dict) -> None:  # held-out losses reach the Prefect run's log as they are measured
        if "eval_loss" in record:
            logger.info("LoRA step %d/%d: train loss %.4f, held-out loss %.4f", record["step"],
                        options["steps"], record["loss"], record["eval_loss"])  # fmt: skip

    def train(out: str) -> dict:
        teacher = _local(original) if original and options.get("objective") == "distill" else None
        with model_pass(), step("LoRA recovery") as advance:
            summary.update(
                recover_dir(
                    _local(built),
                    out,
                    options,
                    dataset=dataset,
                    eval_dataset=eval_dataset,
                    checkpoint_dir=ckpt,
                    dtype=dtype,
                    device=task_device(),
                    progress=advance,
                    on_step=report,
                    teacher_dir=teacher,
                )
            )
        if summary["resumed_from"] is not None:
            logger.info("LoRA recovery resumed from its checkpoint at step %d", summary["resumed_from"])
        return {k: v for k, v in summary.items() if k not in ("history", "evals")}

    model = _stored(store, "model", "models", "", train)
    history = {"history": summary["history"], "evals": summary["evals"]}

    def write_history(out: str) -> dict:
        Path(out).write_text(json.dumps(history))
        return {}

    def draw(out: str) -> dict:
        plot_loss_curve(history["history"], history["evals"], out)
        return {"model": model.sha256}

    history_ref = _stored(store, "lora-history", "lora", ".json", write_history)
    curve = _stored(store, "figure", "lora", ".png", draw)
    shutil.rmtree(ckpt, ignore_errors=True)  # the result is stored: nothing left to resume
    meta = model.meta | {"source": built.sha256, "history": history_ref.uri, "loss_curve": curve.uri}
    return model.model_copy(update={"meta": meta})
