"""Checkpoints of a LoRA recovery run, so an interrupted run resumes with no step lost or repeated.

A checkpoint after step n is a directory ``step-<n>`` holding

- ``adapter.safetensors``: the trainable (LoRA) parameters by name;
- ``optimizer.safetensors``: the optimizer's per-parameter state tensors (``<index>.<key>``) and the RNG
  states (``rng.cpu``, ``rng.cuda.<i>``) that dropout and anything random read;
- ``state.json``: the step, the rows consumed (the data position), the optimizer's parameter groups, the
  scheduler's state, the loss history, the seconds trained and the run's fingerprint.

No pickle anywhere. It is written into a temporary sibling and renamed into place when complete, so a run
killed while writing leaves the previous checkpoint as the latest; older ones are then removed.
:func:`load_latest` restores all of it into freshly built objects, after which step n + 1 computes
bit-for-bit what the uninterrupted run computed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..system.files import make_tree_readable

PREFIX = "step-"


@dataclass
class TrainState:
    """Where a run is: ``step`` steps done, ``rows_seen`` rows consumed, the history, seconds trained."""

    step: int = 0
    rows_seen: int = 0
    history: list[dict[str, float]] = field(default_factory=list)  # one {"step", "loss", "lr"} per step
    evals: list[dict[str, float]] = field(default_factory=list)  # {"step", "eval_loss"} per evaluation
    seconds: float = 0.0
    resumed_from: int | None = None  # the step the last restart resumed from (None: never resumed)


class CheckpointMismatch(ValueError):
    """A checkpoint directory written by a different run (model, data or options)."""


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainState,
    fingerprint: str,
) -> Path:
    """Write the checkpoint of ``state.step`` atomically; returns its directory. Keeps only the newest."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in _trainable(model).items()},
                  str(tmp / "adapter.safetensors"))  # fmt: skip
        opt = optimizer.state_dict()
        tensors = {f"{i}.{k}": v.detach().contiguous().cpu() for i, s in opt["state"].items()
                   for k, v in s.items() if torch.is_tensor(v)}  # fmt: skip
        scalars = {
            f"{i}.{k}": v for i, s in opt["state"].items() for k, v in s.items() if not torch.is_tensor(v)
        }
        tensors["rng.cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            for i, rng in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"rng.cuda.{i}"] = rng
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        meta = {
            "fingerprint": fingerprint,
            "train": asdict(state),
            "param_groups": opt["param_groups"],
            "optimizer_scalars": scalars,
            "scheduler": scheduler.state_dict(),
        }
        (tmp / "state.json").write_text(json.dumps(meta, indent=1))
        make_tree_readable(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in _checkpoints(root)[:-1]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (renamed into place), oldest first."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = _checkpoints(Path(directory))
    return found[-1] if found else None


def load_latest(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    fingerprint: str,
) -> TrainState | None:
    """Restore the newest checkpoint into ``model`` (its trainable parameters), the optimizer, the scheduler
    and the RNGs; returns its state, or None when there is none.

    Raises
    ------
    CheckpointMismatch
        The checkpoint was written by a run with another fingerprint (model, data or options).
    """
    path = latest_checkpoint(directory)
    if path is None:
        return None
    meta = json.loads((path / "state.json").read_text())
    if meta["fingerprint"] != fingerprint:
        raise CheckpointMismatch(
            f"{path} belongs to another LoRA run (fingerprint {meta['fingerprint'][:12]}…, this run "
            f"{fingerprint[:12]}…): remove it or use another checkpoint directory"
        )
    params = _trainable(model)
    saved = load_file(str(path / "adapter.safetensors"))
    if set(saved) != set(params):
        raise CheckpointMismatch(f"{path}: adapter tensors do not match the model's LoRA parameters")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])
    tensors = load_file(str(path / "optimizer.safetensors"))
    optimizer.load_state_dict(_optimizer_state(meta, tensors, params))
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    return TrainState(**meta["train"])


def _optimizer_state(meta: dict[str, Any], tensors: dict[str, torch.Tensor], params: dict) -> dict[str, Any]:
    device = next(iter(params.values())).device
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if not key.startswith("rng."):
            index, name = key.split(".", 1)
            state.setdefault(int(index), {})[name] = value.to(device) if name != "step" else value
    for key, value in meta["optimizer_scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}
