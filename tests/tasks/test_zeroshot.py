"""lm-eval zero-shot tasks through HFLM on a compressed model, with a local task definition and data."""

import json
import random

import pytest
import torch

from lrkv_core import load_model, save_compressed
from lrkv_core.data.datasets import parse_dataset_spec, token_sequences
from lrkv_tasks.zeroshot import run_zeroshot
from tests.support.models import SHARED

TASK = """task: shakespeare_next_line
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}\\n"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _local_task(root, text: str, n_docs: int):
    """Which of 4 lines follows 3 lines of the play (3 distractors drawn far from the true line)."""
    lines = [line for line in text.split("\n") if len(line.split()) >= 4]
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as f:
        for i in range(0, 8 * n_docs, 8):
            true = lines[i + 3]
            choices = [true] + rng.sample([x for j, x in enumerate(lines) if abs(j - i - 3) > 20], 3)
            rng.shuffle(choices)
            doc = {"context": "\n".join(lines[i : i + 3]), "choices": choices, "label": choices.index(true)}
            f.write(json.dumps(doc) + "\n")
    (root / "task.yaml").write_text(TASK.format(data=root / "data.jsonl"))
    return str(root)


@pytest.mark.usefixtures("one_thread")
def test_full_rank_compressed_model_scores_like_the_original(tmp_path, compress):
    model_dir = SHARED / "models" / "shakespeare-llama"
    if not model_dir.is_dir():
        pytest.skip(f"shared assets not found at {SHARED}")
    base, tok = load_model(model_dir)
    valid = (SHARED / "data" / "shakespeare" / "valid.txt").read_text()
    include = _local_task(tmp_path, valid, n_docs=24)
    train = parse_dataset_spec(f"text:{SHARED / 'data' / 'shakespeare' / 'train.txt'}")
    stream = token_sequences(train, tok)[0]
    rows = stream[: 8 * 256].view(8, 256)
    full, _ = compress(base, 2, ratio=1.0, rows=rows, rank_multiple=8)
    save_compressed(full, tmp_path / "full", tokenizer=tok)
    task = ["shakespeare_next_line"]
    res_full = run_zeroshot(str(tmp_path / "full"), task, include_path=include, loglikelihoods=True)
    res_base = run_zeroshot(str(model_dir), task, include_path=include, loglikelihoods=True)
    assert res_base["protocol"]["samples"]["shakespeare_next_line"] == 24
    ll_base = torch.tensor(res_base["loglikelihoods"]["shakespeare_next_line"])  # (docs, choices)
    ll_full = torch.tensor(res_full["loglikelihoods"]["shakespeare_next_line"])
    assert ll_base.shape == (24, 4) and bool((ll_base < 0).all())
    # full rank: the compressed model scores every choice as the original does, so it picks the same ones
    torch.testing.assert_close(ll_full, ll_base, rtol=0, atol=1e-3)
    acc = res_base["results"]["shakespeare_next_line"]["acc"]
    assert res_full["results"]["shakespeare_next_line"]["acc"] == acc
    assert acc == float((ll_base.argmax(1) == torch.tensor(_labels(tmp_path))).double().mean())


def _labels(root) -> list[int]:
    return [json.loads(line)["label"] for line in open(root / "data.jsonl")]
