"""Checkpoints and resume: a run stopped at any step continues from its newest checkpoint and ends with
exactly the weights and history of a run that was never stopped, each step computed once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lrkv_core.lora import CheckpointMismatch, RecoveryConfig, TrainingData, latest_checkpoint, train_lora
from tests.support.inputs import ids_for
from tests.support.models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS, EVERY = 9, 3
# dropout and accumulation on: resuming must restore the RNG and weigh micro-batches the same way
CONFIG = RecoveryConfig(
    steps=STEPS, r=4, alpha=8, dropout=0.1, lr=1e-2, batch_size=2, grad_accum=2, seq_len=16,
    warmup_steps=2, eval_every=4, eval_rows=4, checkpoint_every=EVERY, targets=("k_down", "v_down", "o_proj"),
)  # fmt: skip


class Stop(Exception):
    pass


def compressed_model():
    """The same compressed tiny Llama in every process (deterministic calibration and fusion)."""
    from lrkv_core.conversion.convert import CompressionConfig, convert

    rows = ids_for(8, 24, seed=123)
    return convert(tiny_model("llama"), rows, CompressionConfig(ratio=0.5, group_size=2, rank_multiple=2))


def data() -> TrainingData:
    ids = ids_for(10, 16, seed=5)  # 10 rows, 4 per step: epochs cross step boundaries
    return TrainingData(ids, ids.clone(), "random")


def _adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _run(ckpt=None, on_step=None):
    return train_lora(compressed_model(), data(), CONFIG, eval_data=data(), checkpoint_dir=ckpt,
                      fingerprint="run", on_step=on_step)  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run: adapters and history."""
    result = _run()
    return _adapters(result.model), result.state


def _assert_same_as(reference, result) -> None:
    weights, state = reference
    got = _adapters(result.model)
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[n], weights[n]) for n in weights)  # bit for bit
    assert result.state.history == state.history and result.state.evals == state.evals
    assert [h["step"] for h in result.state.history] == list(range(1, STEPS + 1))  # none lost or repeated
    assert result.state.rows_seen == STEPS * CONFIG.rows_per_step


@pytest.mark.parametrize("stop_at", [3, 5])  # right after a checkpoint; two steps past one
def test_a_run_stopped_by_an_exception_resumes_exactly(reference, tmp_path, stop_at):
    seen: list[int] = []

    def stop(record):
        seen.append(record["step"])
        if record["step"] == stop_at:
            raise Stop

    with pytest.raises(Stop):
        _run(tmp_path, stop)
    resumed_at = stop_at // EVERY * EVERY
    assert latest_checkpoint(tmp_path).name == f"step-{resumed_at:08d}"
    result = _run(tmp_path, lambda r: seen.append(r["step"]))
    assert result.state.resumed_from == resumed_at and result.steps_run == STEPS - resumed_at
    assert seen == list(range(1, stop_at + 1)) + list(range(resumed_at + 1, STEPS + 1))
    _assert_same_as(reference, result)


KILLED_RUN = """
import os, signal, sys
import torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
from tests.core import test_lora_resume as t

def on_step(record):
    with open({log!r}, "a") as f:
        f.write(f"{{record['step']}}\\n")
    if record["step"] == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception handler: a real kill

t._run({ckpt!r}, on_step)
"""


def test_a_killed_process_resumes_exactly_in_another(reference, tmp_path):
    """SIGKILL a training process at step 7 (one step past the checkpoint at 6); a new run resumes at 7."""
    log, ckpt = tmp_path / "steps.log", tmp_path / "ckpt"
    root = str(Path(__file__).resolve().parents[2])
    script = textwrap.dedent(KILLED_RUN.format(root=root, log=str(log), kill_at=7, ckpt=str(ckpt)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert log.read_text().split() == [str(s) for s in range(1, 8)]
    assert latest_checkpoint(ckpt).name == "step-00000006"
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # no half-written checkpoint left

    steps: list[int] = []
    result = _run(ckpt, lambda r: steps.append(r["step"]))
    assert steps == [7, 8, 9] and result.state.resumed_from == 6
    _assert_same_as(reference, result)


def test_a_finished_run_resumes_to_its_end_without_training(reference, tmp_path):
    _run(tmp_path)
    again = _run(tmp_path, lambda r: pytest.fail("a finished run trained again"))
    assert again.steps_run == 0
    _assert_same_as(reference, again)


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    _run(tmp_path)
    with pytest.raises(CheckpointMismatch, match="another LoRA run"):
        train_lora(compressed_model(), data(), CONFIG, checkpoint_dir=tmp_path, fingerprint="other")


def test_only_the_newest_complete_checkpoint_is_kept(tmp_path):
    (tmp_path / ".step-00000003.abandoned").mkdir()  # what a kill while writing leaves: never read
    _run(tmp_path)
    kept = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert kept == [f"step-{STEPS:08d}"]
    assert sorted(f.name for f in (tmp_path / kept[0]).iterdir()) == [
        "adapter.safetensors", "optimizer.safetensors", "state.json",
    ]  # fmt: skip
