"""LoRA recovery on a real pretrained model (shakespeare-llama at ratio 0.3): the merged model equals the
PEFT model, keeps its KV bytes, and a short recovery lowers the loss on text it never trained on."""

from __future__ import annotations

import pytest
import torch

from lrkv_core.conversion.convert import CompressionConfig, convert
from lrkv_core.data.datasets import eval_windows, extract_calibration, read_token_rows
from lrkv_core.evaluation import metrics
from lrkv_core.lora import RecoveryConfig, heldout_loss, merge_lora, train_lora, training_data
from lrkv_core.model.loading import load_model
from tests.support.inputs import max_diff
from tests.support.models import SHARED

MODEL = SHARED / "models" / "shakespeare-llama"
TRAIN = SHARED / "data" / "shakespeare" / "train.txt"
VALID = SHARED / "data" / "shakespeare" / "valid.txt"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not (MODEL.is_dir() and TRAIN.is_file() and VALID.is_file()):
        pytest.skip(f"shared assets not found at {SHARED}")
    model, tokenizer = load_model(MODEL)
    calib = tmp_path_factory.mktemp("lora") / "calib.parquet"
    extract_calibration(f"text:{TRAIN}", tokenizer, n_samples=32, seq_len=128, seed=0, out_path=calib)
    model = convert(model, read_token_rows(calib), CompressionConfig(ratio=0.3, allocator="uniform"))
    return model, tokenizer


def test_recovery_on_shakespeare_is_exact_to_merge_and_lowers_the_held_out_loss(setup):
    model, tokenizer = setup
    data = training_data(f"text:{TRAIN}[:50%]", tokenizer, seq_len=128)
    valid = training_data(f"text:{VALID}", tokenizer, seq_len=128)
    windows = eval_windows(f"text:{VALID}", tokenizer, seq_len=128, max_windows=4)  # (4, 128)
    kv_before = metrics.kv_bytes_per_token(model, windows)["kv_bytes_per_token"]
    config = RecoveryConfig(steps=40, lr=1e-3, batch_size=4, seq_len=128, eval_every=0)
    before = heldout_loss(model, valid, rows=16, batch_size=8)
    trained = train_lora(model, data, config)
    with torch.no_grad():
        peft_logits = trained.model(windows).logits
    merged = merge_lora(trained.model)
    with torch.no_grad():
        merged_logits = merged(windows).logits
    assert max_diff(merged_logits, peft_logits) <= 1e-4  # acceptance: merge exactness
    assert metrics.kv_bytes_per_token(merged, windows)["kv_bytes_per_token"] == kv_before
    after = heldout_loss(merged, valid, rows=16, batch_size=8)
    assert after < before - 0.005, (before, after)  # measured: 3.0861 → 3.0761
