"""LoRA recovery end to end: train adapters on a compressed model, merge them, save a compressed model.

:func:`recover` is the in-memory form (model in, merged model out); :func:`recover_dir` is the file-level
step behind the Prefect task (a compressed model directory in, another one out, with the run's history).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from ..format import LrkvFormat
from ..model.io import save_compressed
from ..model.loading import load_model
from ..system.fingerprint import hash_bytes, hash_dir, hash_json
from .config import RecoveryConfig
from .data import TrainingData, training_data
from .merge import merge_lora
from .train import OnStep, Progress, TrainResult, train_lora


def recover(
    model: nn.Module,
    data: TrainingData,
    config: RecoveryConfig | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, TrainResult]:
    """Train LoRA on ``model`` (changed in place) and merge it: ``(merged model, training result)``.

    Keyword arguments go to :func:`lrkv_core.lora.train.train_lora` (``eval_data``, ``checkpoint_dir``,
    ``fingerprint``, ``progress``, ``on_step``, ``teacher``).
    """
    trained = train_lora(model, data, config or RecoveryConfig(), **kwargs)
    return merge_lora(trained.model), trained


def data_fingerprint(data: TrainingData) -> str:
    """Content hash of training rows (ids and labels)."""
    return hash_bytes(data.input_ids.numpy().tobytes(), data.labels.numpy().tobytes())


def recover_dir(
    model_dir: str | Path,
    out_dir: str | Path,
    config: RecoveryConfig | Mapping[str, Any],
    *,
    dataset: str,
    eval_dataset: str | None = None,
    checkpoint_dir: str | Path | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    progress: Progress = None,
    on_step: OnStep = None,
    teacher_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Recover the compressed model at ``model_dir`` with LoRA on ``dataset`` and save it to ``out_dir``.

    ``teacher_dir`` is the original model, which the ``distill`` objective needs (and no other reads).

    A run killed part way resumes from ``checkpoint_dir`` when called again with the same model, data and
    options (the checkpoints carry a fingerprint of all three). Returns the run's summary: steps, the steps
    this call computed, the step it resumed from, seconds trained, the loss per step and the held-out losses.
    """
    if not isinstance(config, RecoveryConfig):
        config = RecoveryConfig.from_dict(dict(config))
    model, tokenizer = load_model(model_dir, dtype=dtype, device=device)
    fmt = LrkvFormat.of(model.config)  # a compressed model, or a clear error
    teacher = None
    if config.objective == "distill":
        if teacher_dir is None:
            raise ValueError("the LoRA objective 'distill' needs the original model (teacher_dir)")
        teacher, _ = load_model(teacher_dir, dtype=dtype, device=device)
    data = training_data(dataset, tokenizer, seq_len=config.seq_len)
    held = training_data(eval_dataset, tokenizer, seq_len=config.seq_len) if eval_dataset else None
    fingerprint = hash_json(
        {
            "model": hash_dir(model_dir),
            "teacher": hash_dir(teacher_dir) if teacher is not None else None,
            "lora": config.to_dict(),
            "data": data_fingerprint(data),
            "eval": data_fingerprint(held) if held is not None else None,
            "dtype": dtype,
        }
    )
    merged, trained = recover(
        model,
        data,
        config,
        eval_data=held,
        checkpoint_dir=checkpoint_dir,
        fingerprint=fingerprint,
        progress=progress,
        on_step=on_step,
        teacher=teacher,
    )
    state = trained.state
    summary = {
        "lora": config.to_dict(),
        "dataset": dataset,
        "eval_dataset": eval_dataset,
        "train_rows": len(data),
        "steps": state.step,
        "steps_run": trained.steps_run,
        "resumed_from": state.resumed_from,
        "rows_seen": state.rows_seen,
        "seconds": state.seconds,
        "final_loss": state.history[-1]["loss"] if state.history else None,
        "eval_loss_before": state.evals[0]["eval_loss"] if state.evals else None,
        "eval_loss_after": state.evals[-1]["eval_loss"] if state.evals else None,
        "trainable_params": sum(p.numel() for p in trained.model.parameters() if p.requires_grad),
    }
    card_path = Path(model_dir) / "README.md"
    card = card_path.read_text() if card_path.is_file() else ""
    save_compressed(merged, out_dir, tokenizer=tokenizer, card=card + lora_card(config, summary, fmt))
    return summary | {"history": state.history, "evals": state.evals}


def lora_card(config: RecoveryConfig, summary: Mapping[str, Any], fmt: LrkvFormat) -> str:
    """The model card's paragraph on the LoRA recovery that was merged into the weights."""
    losses = ""
    if summary.get("eval_loss_before") is not None:
        losses = (
            f" Held-out loss {summary['eval_loss_before']:.4f} before, {summary['eval_loss_after']:.4f} "
            f"after (on {summary['eval_dataset']})."
        )
    fits = "the original model's predictions" if config.objective == "distill" else "its next tokens"
    return (
        f"\n## LoRA recovery\n\nAfter compression, LoRA adapters (r′ = {config.r}, α = {config.alpha}) on "
        f"{', '.join(config.targets)} were trained for {summary['steps']} steps of "
        f"{config.rows_per_step} × {config.seq_len} tokens on `{summary['dataset']}` (fitting {fits}; "
        f"AdamW, lr {config.lr}, "
        f"{config.scheduler}) and merged into those projections: the latent widths, the cache storage "
        f"({fmt.cache['name']}) and the KV bytes per token are unchanged.{losses}\n"
    )
