"""LoRA recovery training: PEFT adapters on a compressed model's latent projections.

Each optimizer step trains on ``batch_size · grad_accum`` rows (:meth:`TrainingData.rows_for_step`), its loss
the mean over every scored token of those rows (micro-batches are weighted by their token counts, so
accumulation equals one big batch) of the next-token NLL, or, with the ``distill`` objective, of the KL
divergence from a teacher's (the original model's) next-token distribution to the model's. AdamW, gradient
clipping, a warm-up then cosine/linear/constant learning rate. A held-out loss (the NLL) is measured before
the first step, every ``eval_every`` steps and after the last. With a checkpoint directory the run saves
every ``checkpoint_every`` steps and after the last, and a restarted run resumes from the newest checkpoint
(:mod:`lrkv_core.lora.checkpoint`).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import TrainState, load_latest, save_checkpoint
from .config import RecoveryConfig
from .data import IGNORE, TrainingData
from .targets import target_modules

Progress = Callable[[int, int], None] | None
OnStep = Callable[[dict[str, float]], None] | None


@dataclass
class TrainResult:
    """The PEFT model after training (adapters not merged) and how the run went."""

    model: nn.Module
    state: TrainState
    steps_run: int  # optimizer steps this call computed (the rest came from a checkpoint)


def attach_lora(model: nn.Module, config: RecoveryConfig) -> nn.Module:
    """``model`` with PEFT LoRA adapters on the configured projections (initialised from ``config.seed``).

    The adapters' B factors start at zero, so the returned model computes exactly what ``model`` did.
    """
    from peft import LoraConfig, get_peft_model

    targets = sorted(target_modules(model, config.targets))
    peft_config = LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,  # exact module names from the model's structure
        bias="none",
    )
    torch.manual_seed(config.seed)
    with (
        warnings.catch_warnings()
    ):  # PEFT probes a deprecated transformers attribute (is_gradient_checkpointing)
        warnings.filterwarnings("ignore", category=FutureWarning)
        return get_peft_model(model, peft_config)


def schedule(config: RecoveryConfig) -> Callable[[int], float]:
    """Learning-rate multiplier at step n (0-based): linear warm-up, then the configured decay to 0."""

    def factor(n: int) -> float:
        if n < config.warmup_steps:
            return (n + 1) / config.warmup_steps
        if config.scheduler == "constant":
            return 1.0
        progress = (n - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        if config.scheduler == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _nll_sum(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL of the scored targets: ids, labels (B, T) → scalar (float32)."""
    logits = model(input_ids=ids, use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE, reduction="sum"
    )


def _kl_sum(model: nn.Module, teacher: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed KL(teacher ‖ model) of the next-token distributions at the positions whose next token is
    scored: ids, labels (B, T) → scalar (float32); no gradient reaches the teacher."""
    scored = labels[:, 1:] != IGNORE  # (B, T-1)
    with torch.no_grad():
        target = F.log_softmax(teacher(input_ids=ids, use_cache=False).logits[:, :-1][scored].float(), -1)
    log_q = F.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1][scored].float(), -1)
    return F.kl_div(log_q, target, log_target=True, reduction="sum")


@torch.no_grad()
def heldout_loss(model: nn.Module, data: TrainingData, *, rows: int, batch_size: int) -> float:
    """Mean next-token NLL on the first ``rows`` rows of ``data`` (eval mode, no gradient)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    ids, labels = data.input_ids[:rows], data.labels[:rows]
    for start in range(0, len(ids), batch_size):
        b_ids, b_labels = ids[start : start + batch_size].to(device), labels[start : start + batch_size]
        total += _nll_sum(model, b_ids, b_labels.to(device)).item()
        tokens += int((b_labels[:, 1:] != IGNORE).sum())
    model.train(was_training)
    return total / max(tokens, 1)


def train_lora(model: nn.Module, data: TrainingData, config: RecoveryConfig, **kwargs) -> TrainResult:
    """Train LoRA adapters on ``model`` (a compressed model, changed in place) and return the PEFT model:
    :func:`attach_lora` then :func:`fit_lora` (keyword arguments go to it)."""
    return fit_lora(attach_lora(model, config), data, config, **kwargs)


def fit_lora(
    peft_model: nn.Module,
    data: TrainingData,
    config: RecoveryConfig,
    *,
    eval_data: TrainingData | None = None,
    checkpoint_dir: str | Path | None = None,
    fingerprint: str = "",
    progress: Progress = None,
    on_step: OnStep = None,
    teacher: nn.Module | None = None,
) -> TrainResult:
    """Train the trainable parameters of ``peft_model`` (its adapters) with ``config``'s optimisation.

    Parameters
    ----------
    peft_model : a model whose trainable parameters are its adapters (:func:`attach_lora`, or any PEFT
        model, e.g. adapters on an uncompressed model for comparison).
    data, eval_data : training rows and held-out rows (:func:`lrkv_core.lora.data.training_data`).
    checkpoint_dir : where checkpoints go and a restart resumes from (None: no checkpoints).
    fingerprint : identity of the run (model, data, options) that a checkpoint must carry to be resumed.
    progress : ``progress(step, steps)`` after every step (and once on start with the resumed step).
    on_step : ``on_step({"step", "loss", "lr"[, "eval_loss"]})`` after every step, once its checkpoint (if
        any) is written.
    teacher : the model whose predictions the ``distill`` objective fits (the original; required then, on
        the same device, used in eval mode). The held-out loss stays the NLL of the held-out text.
    """
    if (config.objective == "distill") != (teacher is not None):
        raise ValueError("the distill objective takes a teacher model, and only it does")
    if teacher is not None:
        teacher.eval()
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(config))
    state = TrainState()
    if checkpoint_dir is not None:
        restored = load_latest(checkpoint_dir, peft_model, optimizer, scheduler, fingerprint)
        if restored is not None:
            state = restored
            state.resumed_from = state.step

    def evaluate() -> float | None:
        if eval_data is None or config.eval_every == 0 or config.eval_rows == 0:
            return None
        loss = heldout_loss(peft_model, eval_data, rows=config.eval_rows, batch_size=config.batch_size)
        state.evals.append({"step": state.step, "eval_loss": loss})
        return loss

    if state.step == 0:
        evaluate()
    if progress is not None:
        progress(state.step, config.steps)
    device = next(peft_model.parameters()).device
    first = state.step
    peft_model.train()
    while state.step < config.steps:
        started = time.perf_counter()
        rows = data.rows_for_step(state.step, config.rows_per_step, config.seed)
        ids, labels = data.input_ids[rows], data.labels[rows]  # (batch·accum, T)
        n_tokens = int((labels[:, 1:] != IGNORE).sum())
        lr = optimizer.param_groups[0]["lr"]
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for chunk in range(0, len(rows), config.batch_size):
            part = slice(chunk, chunk + config.batch_size)
            b_ids, b_labels = ids[part].to(device), labels[part].to(device)
            if teacher is None:
                micro = _nll_sum(peft_model, b_ids, b_labels) / max(n_tokens, 1)
            else:
                micro = _kl_sum(peft_model, teacher, b_ids, b_labels) / max(n_tokens, 1)
            micro.backward()
            loss += micro.item()
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        state.step += 1
        state.rows_seen += len(rows)
        state.seconds += time.perf_counter() - started
        record = {"step": state.step, "loss": loss, "lr": lr}
        state.history.append(dict(record))
        if (config.eval_every and state.step % config.eval_every == 0) or state.step == config.steps:
            eval_loss = evaluate()
            if eval_loss is not None:
                record["eval_loss"] = eval_loss
        last = state.step == config.steps
        if checkpoint_dir is not None and (
            last or (config.checkpoint_every and state.step % config.checkpoint_every == 0)
        ):
            save_checkpoint(checkpoint_dir, peft_model, optimizer, scheduler, state, fingerprint)
        if progress is not None:
            progress(state.step, config.steps)
        if on_step is not None:
            on_step(record)
    peft_model.eval()
    return TrainResult(peft_model, state, state.step - first)
