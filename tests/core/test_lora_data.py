"""Training rows for LoRA recovery: text windows, pre-tokenized rows, instruction data, and their order."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from lrkv_core.data.datasets import token_sequences
from lrkv_core.lora import TrainingData, check_training_dataset, training_data
from lrkv_core.lora.data import IGNORE, instruction_prompt
from tests.support.models import SHARED, token_parquet, with_bos

TOKENIZER = SHARED / "models" / "shakespeare-llama"


@pytest.fixture(scope="module")
def tokenizer():
    if not TOKENIZER.is_dir():
        pytest.skip(f"shared assets not found at {SHARED}")
    return AutoTokenizer.from_pretrained(str(TOKENIZER))


def test_each_epoch_visits_every_row_once_in_a_seeded_order():
    data = TrainingData(torch.zeros(10, 4, dtype=torch.long), torch.zeros(10, 4, dtype=torch.long), "x")
    order = torch.cat([data.rows_for_step(s, 4, seed=1) for s in range(5)])  # 20 rows: two epochs
    assert sorted(order[:10].tolist()) == list(range(10)) and sorted(order[10:].tolist()) == list(range(10))
    assert not torch.equal(order[:10], order[10:])  # a new permutation per epoch
    assert torch.equal(data.rows_for_step(3, 4, seed=1), order[12:16])  # a function of the step alone
    assert not torch.equal(data.rows_for_step(0, 4, seed=2), order[:4])


def test_text_becomes_consecutive_windows_every_token_scored(tokenizer, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 40)
    stream = token_sequences(f"text:{path}", tokenizer)[0]
    data = training_data(f"text:{path}[:50%]", tokenizer, seq_len=16)
    half = stream[: stream.numel() // 2]
    assert data.input_ids.shape == (half.numel() // 16, 16)
    assert torch.equal(data.input_ids.flatten(), half[: data.input_ids.numel()])
    assert torch.equal(data.labels, data.input_ids)
    bos = with_bos(tokenizer)  # a tokenizer that adds BOS: every window starts with it, then 15 text tokens
    data = training_data(f"text:{path}[:50%]", bos, seq_len=16)
    assert (
        data.input_ids.shape == (half.numel() // 15, 16) and (data.input_ids[:, 0] == bos.bos_token_id).all()
    )
    assert torch.equal(data.input_ids[:, 1:].flatten(), half[: data.input_ids.shape[0] * 15])


def test_token_rows_are_truncated_padded_and_keep_their_labels(tmp_path):
    plain = training_data(f"parquet:{token_parquet(tmp_path / 'a.parquet', rows=3, seq_len=10)}", None,
                          seq_len=8)  # fmt: skip
    assert plain.input_ids.shape == (3, 8) and torch.equal(plain.labels, plain.input_ids)
    table = pa.table({"input_ids": [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], "labels": [[-100, -100, 7, 8],
                      [-100, 10, 11, 12, 13, 14]]})  # fmt: skip
    pq.write_table(table, tmp_path / "b.parquet")
    data = training_data(f"parquet:{tmp_path / 'b.parquet'}", None, seq_len=5)
    assert data.input_ids.tolist() == [[5, 6, 7, 8, 0], [9, 10, 11, 12, 13]]  # padded with id 0
    assert data.labels.tolist() == [[IGNORE, IGNORE, 7, 8, IGNORE], [IGNORE, 10, 11, 12, 13]]


def test_instruction_rows_score_only_the_response(tokenizer, tmp_path):
    rows = {"instruction": ["Name a play.", "Say hello."], "input": ["", "to Romeo"],
            "output": ["Hamlet", "Hello, Romeo."]}  # fmt: skip
    pq.write_table(pa.table(rows), tmp_path / "inst.parquet")
    check_training_dataset(f"parquet:{tmp_path / 'inst.parquet'}", has_tokenizer=True)
    data = training_data(f"parquet:{tmp_path / 'inst.parquet'}", tokenizer, seq_len=128)
    prompt = tokenizer(instruction_prompt("Say hello.", "to Romeo"), add_special_tokens=False)["input_ids"]
    answer = tokenizer("Hello, Romeo.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n_prompt = 1 + len(prompt)  # BOS + prompt
    assert data.input_ids[1, 0] == tokenizer.bos_token_id
    assert data.labels[1, :n_prompt].eq(IGNORE).all()
    assert data.labels[1, n_prompt : n_prompt + len(answer)].tolist() == answer
    assert data.labels[1, n_prompt + len(answer) :].eq(IGNORE).all()  # padding
    assert "### Input:\nto Romeo" in instruction_prompt("Say hello.", "to Romeo")
    assert "### Input" not in instruction_prompt("Name a play.")


def test_sources_are_checked_before_any_work(tmp_path):
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="no 'input_ids' column"):
        check_training_dataset(f"parquet:{tmp_path / 'bad.parquet'}", has_tokenizer=True)
    with pytest.raises(FileNotFoundError):
        check_training_dataset(f"text:{tmp_path / 'missing.txt'}", has_tokenizer=True)
    pq.write_table(pa.table({"instruction": ["a"], "output": ["b"]}), tmp_path / "inst.parquet")
    with pytest.raises(ValueError, match="needs a model with a tokenizer"):
        check_training_dataset(f"parquet:{tmp_path / 'inst.parquet'}", has_tokenizer=False)
    with pytest.raises(ValueError, match="no row has a scored token"):  # one token: nothing to predict
        training_data(f"parquet:{token_parquet(tmp_path / 'a.parquet', rows=2, seq_len=4)}", None, seq_len=1)
