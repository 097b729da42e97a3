"""Training rows for LoRA recovery, from the same dataset specs as calibration, and the order of their use.

Three kinds of source, each becoming (N, T) ``input_ids`` and ``labels`` (−100 where a position is not
scored; the model's own shift makes position t predict t + 1):

- text (``text:``, ``hf:`` with a ``text`` column, ``builtin:``): the token stream cut into consecutive
  non-overlapping windows of T tokens, each starting with the tokens the tokenizer puts before a text (BOS
  where it adds one) (a slice ``[A%:B%]`` cuts the stream first, so two slices never
  share a token), every token scored;
- pre-tokenized rows (``parquet:`` with ``input_ids``, optionally ``labels`` of the same length): each row
  truncated to T and right-padded, padding unscored;
- instruction data (``parquet:`` or ``hf:`` rows with ``instruction``, ``output`` and optionally ``input``):
  each row written with the Alpaca prompt template, only the response (and EOS) scored.

The order is a function of the step alone (:meth:`TrainingData.rows_for_step`): epoch e uses the
permutation drawn from ``seed`` and e, so a resumed run draws exactly the rows the interrupted one would have.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.datasets import (
    check_dataset,
    consecutive_windows,
    load_token_rows,
    parse_dataset_spec,
    resolve_spec,
    text_prefix,
    token_sequences,
)
from ..data.refs import DatasetSpec

IGNORE = -100  # labels that are not scored (PyTorch's cross-entropy ignore_index)
INSTRUCTION_COLUMNS = ("instruction", "output")
PROMPT = (
    "Below is an instruction that describes a task{with_input}. "
    "Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
)


@dataclass(frozen=True)
class TrainingData:
    """(N, T) ``input_ids`` and ``labels`` (−100: not scored), and the source they came from."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    source: str

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.shape != self.labels.shape or len(self.input_ids) == 0:
            raise ValueError(
                f"training data must be non-empty (N, T) ids and labels, got {tuple(self.input_ids.shape)} "
                f"and {tuple(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows_for_step(self, step: int, rows_per_step: int, seed: int) -> torch.Tensor:
        """Indices (rows_per_step,) of the rows optimizer step ``step`` (0-based) trains on.

        Row k of the whole run (k = step · rows_per_step + i) is row ``perm_e[k mod N]`` with e = k div N
        and ``perm_e`` the permutation seeded by (seed, e): every epoch visits every row once.
        """
        n = len(self)
        out = []
        for k in range(step * rows_per_step, (step + 1) * rows_per_step):
            epoch, i = divmod(k, n)
            out.append(_permutation(n, seed, epoch)[i])
        return torch.stack(out)


@functools.lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)
    return torch.randperm(n, generator=gen)


def training_data(spec: str | DatasetSpec, tokenizer: Any | None, *, seq_len: int) -> TrainingData:
    """The rows of a source for training on windows/rows of ``seq_len`` tokens (see the module docstring)."""
    resolved = resolve_spec(spec)
    columns = _row_columns(resolved)
    if columns is not None and set(INSTRUCTION_COLUMNS) <= set(columns):
        if tokenizer is None:
            raise ValueError(f"instruction data {spec} needs the model's tokenizer")
        return _instruction_rows(resolved, tokenizer, seq_len, str(spec))
    if resolved.is_tokenized:
        return _token_rows(resolved, tokenizer, seq_len, "labels" in (columns or ()), str(spec))
    stream = token_sequences(resolved, tokenizer)[0]  # (N_tokens,)
    ids = consecutive_windows(stream, seq_len, text_prefix(tokenizer))  # (N, T)
    if ids.shape[0] == 0:
        raise ValueError(f"too little data: {spec} has {stream.numel()} tokens, fewer than seq_len={seq_len}")
    return TrainingData(ids, ids.clone(), str(spec))


def _row_columns(spec: DatasetSpec) -> list[str] | None:
    """Column names of a row source (Parquet file or hub dataset), None for a text file."""
    if spec.kind == "parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(Path(spec.name).expanduser()).names
    if spec.kind == "hf":
        return list(_hub_rows(spec).column_names)
    return None


def _hub_rows(spec: DatasetSpec):
    from datasets import load_dataset

    return load_dataset(spec.name, spec.config, split=spec.split)


def _rows(spec: DatasetSpec) -> list[dict]:
    """The rows of a Parquet file or hub dataset, restricted to the spec's slice of rows."""
    from datasets import load_dataset

    if spec.kind == "parquet":
        ds = load_dataset("parquet", data_files=str(Path(spec.name).expanduser()), split="train")
    else:
        ds = _hub_rows(spec)
    if spec.part is not None:
        begin, end = spec.part.bounds(len(ds))
        ds = ds.select(range(begin, end))
    if len(ds) == 0:
        raise ValueError(f"{spec} selects no rows")
    return list(ds)


def _pad_id(tokenizer: Any | None) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if value is not None:
            return int(value)
    return 0


def _stack(pairs: list[tuple[list[int], list[int]]], seq_len: int, pad: int, source: str) -> TrainingData:
    """Rows truncated to ``seq_len`` and right-padded (padding unscored); rows with nothing scored dropped."""
    ids = torch.full((len(pairs), seq_len), pad, dtype=torch.long)
    labels = torch.full((len(pairs), seq_len), IGNORE, dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(pairs):
        n = min(len(row_ids), seq_len)
        ids[i, :n] = torch.tensor(row_ids[:n])
        labels[i, :n] = torch.tensor(row_labels[:n])
    keep = (labels[:, 1:] != IGNORE).any(dim=1)  # a row must have a target after position 0
    if not keep.any():
        raise ValueError(f"{source}: no row has a scored token within seq_len={seq_len}")
    return TrainingData(ids[keep], labels[keep], source)


def _token_rows(
    spec: DatasetSpec, tokenizer: Any, seq_len: int, has_labels: bool, source: str
) -> TrainingData:
    if not has_labels:
        rows = [r.tolist() for r in load_token_rows(spec)]
        return _stack([(r, r) for r in rows], seq_len, _pad_id(tokenizer), source)
    pairs = []
    for row in _rows(spec):
        if len(row["labels"]) != len(row["input_ids"]):
            raise ValueError(f"{source}: a row's labels and input_ids differ in length")
        pairs.append((list(row["input_ids"]), list(row["labels"])))
    return _stack(pairs, seq_len, _pad_id(tokenizer), source)


def instruction_prompt(instruction: str, context: str = "") -> str:
    """The Alpaca prompt of one instruction (and its optional input), ending where the response begins."""
    prompt = PROMPT.format(with_input=", paired with an input" if context else "", instruction=instruction)
    if context:
        prompt += f"### Input:\n{context}\n\n"
    return prompt + "### Response:\n"


def _instruction_rows(spec: DatasetSpec, tokenizer: Any, seq_len: int, source: str) -> TrainingData:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pairs = []
    for row in _rows(spec):
        prompt = bos + tokenizer(instruction_prompt(row["instruction"], row.get("input") or ""),
                                 add_special_tokens=False)["input_ids"]  # fmt: skip
        answer = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + eos
        pairs.append((prompt + answer, [IGNORE] * len(prompt) + answer))
    return _stack(pairs, seq_len, _pad_id(tokenizer), source)


def check_training_dataset(spec: str | DatasetSpec, *, has_tokenizer: bool) -> None:
    """Cheap checks before any work: the file exists, a Parquet file has ``input_ids`` or instruction
    columns, text has a tokenizer. Reads no data beyond a Parquet schema; uses no network."""
    spec = parse_dataset_spec(spec)
    if spec.kind == "parquet" and Path(spec.name).expanduser().is_file():
        columns = _row_columns(spec) or []
        if set(INSTRUCTION_COLUMNS) <= set(columns):
            if not has_tokenizer:
                raise ValueError(f"instruction data {spec} needs a model with a tokenizer")
            return
    check_dataset(spec, has_tokenizer=has_tokenizer)
