"""Datasets: token streams, calibration windows (Parquet) and evaluation windows.

A dataset is named by a spec string, parsed and resolved by :mod:`lrkv_core.data.refs`:

- ``hf:NAME[:CONFIG[:SPLIT]]``  a hub dataset with a ``text`` column (split "train" by default);
- ``text:PATH``                 a local text file, read whole (newlines kept), tokenized as one stream;
- ``parquet:PATH``              pre-tokenized rows: an ``input_ids`` list-of-int column (BOS-started samples);
- ``SCHEME:REST``               a plugin scheme, e.g. ``builtin:NAME:SPLIT`` from lrkv_demo (a text source).

Any of them may end in a percent slice, ``text:X[:90%]`` / ``text:X[90%:]`` (:mod:`lrkv_core.data.slices`): a
text source is cut on its token stream (so two parts never share a token), a Parquet source on its rows in
file order. Held-out evaluation data and early checks live in :mod:`lrkv_core.data.heldout`.

Text sources become one long token stream; Parquet sources stay one sequence per row, because such rows
start at BOS and must be scored from position 0. A window cut from a text stream starts with the tokens
the model's tokenizer puts before every text (:func:`text_prefix`: BOS for Llama 3 or Gemma tokenizers,
nothing for GPT-2-style ones), then continues with the stream, so a model sees its windows as it sees
its prompts. All loading goes through the ``datasets`` library.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from lrkv_core.data.heldout import check_dataset, heldout, utf8_problem
from lrkv_core.data.refs import SPEC_FORMS, DatasetSpec, parse_dataset_spec, resolve_spec
from lrkv_core.system.files import make_readable
from lrkv_core.system.fingerprint import hash_bytes, hash_json


def load_dataset(*args: Any, **kwargs: Any) -> Any:
    """``datasets.load_dataset``, imported when first read (importing lrkv_core, as the kernels and a model's
    decode do, needs no ``datasets``)."""
    from datasets import load_dataset as load

    return load(*args, **kwargs)


__all__ = [
    "SPEC_FORMS",
    "DatasetSpec",
    "calibration_windows",
    "check_dataset",
    "consecutive_windows",
    "eval_windows",
    "extract_calibration",
    "heldout",
    "load_text",
    "load_token_rows",
    "parse_dataset_spec",
    "read_token_rows",
    "resolve_spec",
    "strided_windows",
    "text_prefix",
    "token_sequences",
    "window_prefix",
    "write_token_rows",
]


def _local_file(path: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"dataset file not found: {p}")
    return p


def load_text(spec: str | DatasetSpec) -> str:
    """The whole text of a text source (text, hf or a plugin scheme resolving to one), exactly as stored.

    Hub rows are joined as they are (wikitext rows already end in a newline).

    Raises
    ------
    ValueError
        A sliced spec (slices cut tokens, see :func:`token_sequences`), a pre-tokenized source, or a text
        file that is not UTF-8 (one line naming the file and the first bad byte).
    """
    spec = resolve_spec(spec)
    if spec.part is not None:
        raise ValueError(f"{spec}: a slice cuts the token stream; read it with token_sequences")
    if spec.kind == "text":
        path = _local_file(spec.name)
        problem = utf8_problem(path)  # else the datasets library fails mid-read with a traceback
        if problem is not None:
            raise ValueError(f"{spec}: {problem}")
        ds = load_dataset("text", data_files=str(path), sample_by="document", split="train")
        return "".join(ds["text"])
    if spec.kind == "hf":
        try:
            ds = load_dataset(spec.name, spec.config, split=spec.split)
        except ConnectionError as err:
            raise ConnectionError(
                f"{err}: {spec} is read from the Hugging Face Hub; without network, give a local dataset "
                "(text:PATH or parquet:PATH, e.g. --dataset text:train.txt)"
            ) from None
        if "text" not in ds.column_names:
            raise ValueError(f"hub dataset {spec} has no 'text' column (columns: {ds.column_names})")
        return "".join(ds["text"])
    raise ValueError(f"{spec} is a pre-tokenized source, not text")


def load_token_rows(spec: str | DatasetSpec) -> list[torch.Tensor]:
    """Rows of a ``parquet:`` source (its slice of rows, in file order), one (T_i,) LongTensor per row."""
    spec = resolve_spec(spec)
    if spec.kind != "parquet":
        raise ValueError(f"{spec} is a text source, not pre-tokenized rows")
    ds = load_dataset("parquet", data_files=str(_local_file(spec.name)), split="train")
    if "input_ids" not in ds.column_names:
        raise ValueError(f"{spec} has no 'input_ids' column (columns: {ds.column_names})")
    if spec.part is not None:
        begin, end = spec.part.bounds(len(ds))
        if begin >= end:
            raise ValueError(f"{spec} selects no rows: the file has {len(ds)}")
        ds = ds.select(range(begin, end))
    return [torch.tensor(row, dtype=torch.long) for row in ds["input_ids"]]


def token_sequences(spec: str | DatasetSpec, tokenizer: Any | None) -> list[torch.Tensor]:
    """Token sequences of a source: one (N_tokens,) stream for text, one (T_i,) tensor per Parquet row.

    Text is tokenized whole with ``add_special_tokens=False`` (no BOS/EOS inserted); a slice then cuts
    that stream, so ``X[:p%]`` and ``X[p%:]`` together are exactly the stream of ``X``.

    Raises
    ------
    ValueError
        A text source with ``tokenizer=None``, or a slice that selects nothing.
    """
    spec = resolve_spec(spec)
    if spec.is_tokenized:
        return load_token_rows(spec)
    if tokenizer is None:
        raise ValueError(
            f"cannot tokenize {spec}: this model has no tokenizer; use a parquet: dataset of input_ids"
        )
    ids = tokenizer(load_text(spec.whole), add_special_tokens=False, verbose=False)["input_ids"]
    stream = torch.tensor(ids, dtype=torch.long)  # (N_tokens,)
    if spec.part is not None:
        begin, end = spec.part.bounds(stream.numel())
        if begin >= end:
            raise ValueError(f"{spec} selects no tokens: the source has {stream.numel()}")
        stream = stream[begin:end]
    return [stream]


def text_prefix(tokenizer: Any | None) -> list[int]:
    """The ids ``tokenizer`` puts before any text by itself (``add_special_tokens=True``): ``[BOS]`` for
    Llama 3 or Gemma tokenizers; ``[]`` for tokenizers that add nothing (GPT-2 style), and for ``None``."""
    if tokenizer is None:
        return []
    probe = "a"
    plain = list(tokenizer(probe, add_special_tokens=False, verbose=False)["input_ids"])
    full = list(tokenizer(probe, add_special_tokens=True, verbose=False)["input_ids"])
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return full[:k]
    return []


def window_prefix(spec: str | DatasetSpec, tokenizer: Any | None) -> list[int]:
    """The ids every window of ``spec`` starts with: :func:`text_prefix` for a text source, ``[]`` for
    pre-tokenized rows (they carry their own BOS at position 0)."""
    return [] if resolve_spec(spec).is_tokenized else text_prefix(tokenizer)


def _body_length(length: int, prefix: Sequence[int]) -> int:
    """Stream tokens in a ``length``-token window that starts with ``prefix``; ``ValueError`` if none fit."""
    if length <= len(prefix):
        raise ValueError(
            f"a {length}-token window leaves no room for text after {len(prefix)} leading token(s)"
        )
    return length - len(prefix)


def consecutive_windows(seq: torch.Tensor, length: int, prefix: Sequence[int] = ()) -> torch.Tensor:
    """(N, length) non-overlapping windows from the start of ``seq`` (the short tail dropped): each one
    ``prefix`` (e.g. :func:`window_prefix`) then ``length - len(prefix)`` consecutive tokens of ``seq``."""
    return strided_windows(seq, length, _body_length(length, prefix), prefix)


def strided_windows(seq: torch.Tensor, length: int, stride: int, prefix: Sequence[int] = ()) -> torch.Tensor:
    """(N, length) windows of ``seq`` starting every ``stride`` tokens (overlapping where ``stride`` is
    shorter than a window), each ``prefix`` then ``length - len(prefix)`` consecutive tokens of ``seq``; the
    tail that does not fill a window is dropped."""
    body = _body_length(length, prefix)
    if stride < 1:
        raise ValueError(f"stride must be at least 1 token, got {stride}")
    head = torch.tensor(list(prefix), dtype=seq.dtype)
    rows = [torch.cat([head, seq[a : a + body]]) for a in range(0, seq.numel() - body + 1, stride)]
    return torch.stack(rows) if rows else torch.empty(0, length, dtype=seq.dtype)


def _draw_windows(
    seqs: list[torch.Tensor],
    tokenized: bool,
    n_samples: int,
    seq_len: int,
    rng: np.random.Generator,
    prefix: Sequence[int] = (),
) -> np.ndarray:
    """(n_samples, seq_len) int64: random distinct start offsets in a stream (each window ``prefix`` then
    ``seq_len - len(prefix)`` stream tokens), or random rows' prefixes."""
    if tokenized:
        eligible = [i for i, s in enumerate(seqs) if s.numel() >= seq_len]
        if len(eligible) < n_samples:
            raise ValueError(
                f"too little data: {len(seqs)} rows, {len(eligible)} of them with >= {seq_len} tokens; "
                f"n_samples={n_samples} needs {n_samples} such rows"
            )
        picks = rng.choice(len(eligible), size=n_samples, replace=False)
        return np.stack([seqs[eligible[i]][:seq_len].numpy() for i in picks])
    body = _body_length(seq_len, prefix)
    stream = seqs[0].numpy()
    n_starts = stream.shape[0] - body + 1
    if n_starts < n_samples:
        raise ValueError(
            f"too little data: the token stream has {stream.shape[0]} tokens; "
            f"n_samples={n_samples} distinct windows of seq_len={seq_len} need at least "
            f"{body + n_samples - 1}"
        )
    starts = rng.choice(n_starts, size=n_samples, replace=False)
    rows = np.stack([np.concatenate([prefix, stream[s : s + body]]) for s in starts])
    return rows.astype(stream.dtype, copy=False)


def write_token_rows(rows: np.ndarray, out_path: str | Path) -> Path:
    """Write (N, T) token ids as a Parquet ``input_ids`` list<int32> column, atomically.

    The table goes to a temporary file beside ``out_path`` and is moved into place with ``os.replace``,
    so a reader never sees a partial file and an error leaves nothing behind.
    """
    if rows.size and (rows.min() < 0 or rows.max() >= 2**31):
        raise ValueError("token ids must fit in int32")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    n, t = rows.shape
    offsets = pa.array(np.arange(0, n * t + 1, t, dtype=np.int32))  # (N + 1,) row boundaries
    column = pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1).astype(np.int32)))  # list<int32>
    table = pa.table({"input_ids": column})
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        make_readable(tmp)  # mkstemp's file is private
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def extract_calibration(
    spec: str | DatasetSpec,
    tokenizer: Any | None,
    *,
    n_samples: int,
    seq_len: int,
    seed: int,
    out_path: str | Path,
) -> dict[str, Any]:
    """Draw ``n_samples`` windows of ``seq_len`` tokens and write them to a Parquet file.

    Text streams give windows at distinct random start offsets, each after the tokenizer's leading tokens
    (:func:`text_prefix`, e.g. BOS); Parquet sources give the first
    ``seq_len`` tokens of randomly chosen rows (without replacement; shorter rows are skipped), so every
    window keeps the row's position 0 (BOS). Draws use ``numpy.random.default_rng(seed)``. A sliced spec
    (``text:X[:90%]``) draws only inside its slice, so no window reaches into the rest of the source.

    Returns
    -------
    dict
        ``path``, ``fingerprint`` (sha256 of the token content, n_samples, seq_len and seed),
        ``n_samples``, ``seq_len``, ``seed``, ``source`` (canonical spec string) and ``tokens``.

    Raises
    ------
    ValueError
        Too little data (the message gives what there is and what is needed).
    """
    spec = parse_dataset_spec(spec)
    rows = calibration_windows(spec, tokenizer, n_samples=n_samples, seq_len=seq_len, seed=seed).numpy()
    path = write_token_rows(rows, out_path)  # rows: (n_samples, seq_len)
    params = {"n_samples": n_samples, "seq_len": seq_len, "seed": seed}
    fingerprint = hash_bytes(rows.astype("<i4").tobytes(), hash_json(params).encode())
    return {"path": str(path), "fingerprint": fingerprint, **params, "source": str(spec), "tokens": rows.size}


def calibration_windows(
    spec: str | DatasetSpec, tokenizer: Any | None, *, n_samples: int, seq_len: int, seed: int
) -> torch.Tensor:
    """The (n_samples, seq_len) windows :func:`extract_calibration` draws and writes, in memory."""
    if n_samples < 1 or seq_len < 1:
        raise ValueError(f"n_samples and seq_len must be >= 1, got {n_samples}, {seq_len}")
    spec = parse_dataset_spec(spec)
    seqs = token_sequences(spec, tokenizer)
    prefix = window_prefix(spec, tokenizer)
    rows = _draw_windows(seqs, spec.is_tokenized, n_samples, seq_len, np.random.default_rng(seed), prefix)
    return torch.from_numpy(rows.astype(np.int64))


def read_token_rows(path: str | Path) -> torch.Tensor:
    """Read a file written by :func:`extract_calibration` back as a (N, T) LongTensor."""
    table = pq.read_table(_local_file(str(path)), columns=["input_ids"])
    column = table.column("input_ids").combine_chunks()
    lengths = set(pc.list_value_length(column).to_pylist())
    if len(lengths) > 1:
        raise ValueError(f"{path}: rows have different lengths {sorted(lengths)}")
    values = column.flatten().to_numpy().astype(np.int64)  # (N * T,)
    return torch.from_numpy(values).view(len(column), -1)


def eval_windows(
    spec: str | DatasetSpec, tokenizer: Any | None, *, seq_len: int, max_windows: int | None = None
) -> torch.Tensor:
    """Non-overlapping evaluation windows, (N, seq_len) LongTensor.

    A text stream (or its slice) is cut into consecutive pieces of ``seq_len - len(prefix)`` tokens from its
    start, each after the tokenizer's leading tokens (:func:`text_prefix`, e.g. BOS); each Parquet row (of
    the slice, if any) is cut into windows starting at its position 0. Short tails are dropped;
    ``max_windows`` keeps the first N windows.
    """
    spec = parse_dataset_spec(spec)
    seqs = token_sequences(spec, tokenizer)
    prefix = window_prefix(spec, tokenizer)
    out = torch.cat([consecutive_windows(seq, seq_len, prefix) for seq in seqs])  # (N, T)
    if out.shape[0] == 0:
        longest = max(s.numel() for s in seqs)
        raise ValueError(f"too little data: {spec} has no {seq_len}-token sequence (longest: {longest})")
    return out if max_windows is None else out[:max_windows]
