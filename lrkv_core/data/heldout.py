"""Held-out evaluation data for a calibration source, and cheap checks of a dataset before work starts.

The default evaluation data is a held-out part of the calibration source, never another model's data:
the source's test or validation split when it has one, else the part of it that calibration does not
see (``text:X`` calibrates on ``text:X[:90%]`` and is evaluated on ``text:X[90%:]``). :func:`heldout`
returns both specs and a line naming what was chosen, for the output to report.

:func:`check_dataset` fails fast, before any model is loaded, built or downloaded, on what can be seen
without tokenizing the data: missing files, a text file that is not UTF-8, a text source for a model
without a tokenizer, a Parquet file without ``input_ids``, a malformed or empty slice. :func:`overlap` says
whether evaluation data shares any of the calibration data (the same source and intersecting slices),
which makes its measurements flattering.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lrkv_core.data.refs import CORE_KINDS, DatasetSpec, dataset_scheme, parse_dataset_spec
from lrkv_core.data.slices import PercentSlice

logger = logging.getLogger(__name__)

HELDOUT_PERCENT = 10  # held out of a source that has no test or validation split
EVAL_SPLITS = ("test", "validation")  # in order of preference
SplitNames = Callable[[str, "str | None"], Sequence[str]]


def hub_split_names(name: str, config: str | None) -> list[str]:
    """Split names of a hub dataset (``datasets.get_dataset_split_names``: needs the network)."""
    from datasets import get_dataset_split_names

    return list(get_dataset_split_names(name, config))


def heldout(
    spec: str | DatasetSpec, *, split_names: SplitNames = hub_split_names
) -> tuple[DatasetSpec, DatasetSpec, str]:
    """Calibration and held-out evaluation specs for a calibration source.

    Rules:

    - ``text:X`` / ``parquet:X``: ``X[:90%]`` and ``X[90%:]`` (tokens of a text stream, rows of a file);
    - a spec already sliced: it is kept, and the held-out part is the rest of the source after it
      (``X[:80%]`` -> ``X[80%:]``), or before it when it runs to the end (``X[30%:]`` -> ``X[:30%]``);
    - ``hf:N:C:S``: unchanged; evaluation on the ``test`` split, else ``validation`` (never ``S``
      itself); with neither, ``S[:90%]`` and ``S[90%:]``. When the split names cannot be looked up,
      ``test`` is assumed (``validation`` when ``S`` is ``test``) and the description says so;
    - a plugin scheme: its ``heldout`` hook (``builtin:NAME:train`` -> ``builtin:NAME:valid``), else
      slices as above.

    Parameters
    ----------
    spec : str or DatasetSpec
        The calibration source.
    split_names : callable
        ``split_names(name, config) -> names`` of a hub dataset; tests inject one to stay offline.

    Returns
    -------
    tuple
        ``(calibration, evaluation, description)``; the description is one line, e.g. "the last 10% of
        corpus.txt's tokens (not used for calibration)".
    """
    spec = parse_dataset_spec(spec)
    if spec.kind == "hf":
        return _heldout_hub(spec, split_names)
    if spec.kind not in CORE_KINDS:
        hook = dataset_scheme(spec.kind).heldout
        found = hook(spec.name) if hook is not None else None
        if found is not None:
            rest, description = found
            return spec, parse_dataset_spec(f"{spec.kind}:{rest}"), description
    return _heldout_slice(spec)


def _heldout_slice(spec: DatasetSpec) -> tuple[DatasetSpec, DatasetSpec, str]:
    """Split one source: calibration keeps its slice (or the first 90%), evaluation gets the rest."""
    part = spec.part
    if part is None:
        calib, held = PercentSlice(0, 100 - HELDOUT_PERCENT), PercentSlice(100 - HELDOUT_PERCENT, 100)
    elif part.stop < 100:
        calib, held = part, PercentSlice(part.stop, 100)
    else:  # [A%:] with A > 0 ([:] parses to no slice)
        calib, held = part, PercentSlice(0, part.start)
    unit = {"text": "tokens", "hf": "tokens", "parquet": "rows"}.get(spec.kind, "")
    source = spec.name if spec.kind in ("text", "parquet") else str(spec.whole)
    description = f"{held.describe(unit, source)} (not used for calibration)"
    return replace(spec, part=calib), replace(spec, part=held), description


def _heldout_hub(spec: DatasetSpec, split_names: SplitNames) -> tuple[DatasetSpec, DatasetSpec, str]:
    dataset = f"hf:{spec.name}" + (f":{spec.config}" if spec.config else "")
    try:
        names = list(split_names(spec.name, spec.config))
    except Exception as err:
        # best effort: offline, rate-limited or unknown to the hub all mean "cannot tell", whatever the
        # exception type the hub client of the day raises; the description says the split was assumed
        guess = EVAL_SPLITS[0] if spec.split != EVAL_SPLITS[0] else EVAL_SPLITS[1]
        logger.info("split names of %s unavailable (%s); assuming %r", dataset, err, guess)
        why = f"assumed: its split names could not be looked up ({type(err).__name__})"
        return spec, replace(spec, split=guess, part=None), f"the {guess} split of {dataset} ({why})"
    for candidate in EVAL_SPLITS:
        if candidate in names and candidate != spec.split:
            words = f"the {candidate} split of {dataset} (calibration uses {spec.split})"
            return spec, replace(spec, split=candidate, part=None), words
    return _heldout_slice(spec)


def _source(spec: DatasetSpec) -> tuple:
    """What identifies a source regardless of its slice: a local file by its resolved path."""
    if spec.kind in ("text", "parquet"):
        return spec.kind, str(Path(spec.name).expanduser().resolve())
    return spec.kind, spec.name, spec.config, spec.split


def overlap(calibration: str | DatasetSpec, evaluation: str | DatasetSpec) -> str | None:
    """One line saying how ``evaluation`` overlaps ``calibration`` (the same source and intersecting
    slices, e.g. ``text:a.txt`` and ``text:a.txt[90%:]``), or None when they share nothing.

    Both slices cut the same token stream (or rows) with the same rounding, so slices that only touch, such
    as ``[:90%]`` and ``[90%:]``, are disjoint. Sources are compared by name (a file by its resolved path);
    a plugin scheme is not resolved, so two names of the same data are not recognised as one.
    """
    cal, ev = parse_dataset_spec(calibration), parse_dataset_spec(evaluation)
    if _source(cal) != _source(ev):
        return None
    a, b = cal.part or PercentSlice(), ev.part or PercentSlice()
    lo, hi = max(a.start, b.start), min(a.stop, b.stop)
    if lo >= hi:
        return None
    shared = "all of the evaluation data" if (lo, hi) == (b.start, b.stop) else f"{hi - lo}% of the source"
    return f"the evaluation data {ev} overlaps the calibration data {cal} ({shared})"


def check_dataset(spec: str | DatasetSpec, *, has_tokenizer: bool, model: str | None = None) -> None:
    """Cheap checks of a dataset spec, before any expensive step; tokenizes nothing and uses no network.

    Checked: the spec and its slice parse; a ``text:``/``parquet:`` file exists; a ``text:`` file is UTF-8
    (decoded once, in chunks); a text source (``text:``, ``hf:``) has a tokenizer to read it; a Parquet
    file has an ``input_ids`` column (schema only) and its slice selects at least one row. ``hf:`` specs
    and plugin schemes are parsed only (a plugin's own ``check`` runs then); nothing is downloaded or built.

    Parameters
    ----------
    spec : str or DatasetSpec
        The dataset.
    has_tokenizer : bool
        Whether the model that will read it has a tokenizer.
    model : str, optional
        That model's reference, named in the error about a missing tokenizer.

    Raises
    ------
    ValueError
        A malformed spec or slice, an unknown scheme, a text source without a tokenizer, an empty or
        non-UTF-8 text file, a Parquet file that is unreadable, lacks ``input_ids`` or whose slice selects
        no row.
    FileNotFoundError
        A local file that does not exist.
    """
    spec = parse_dataset_spec(spec)
    if spec.kind == "parquet":
        _check_parquet(spec, _existing_file(spec))
        return
    if spec.kind == "text" and _existing_file(spec).stat().st_size == 0:
        raise ValueError(f"{spec}: the file {spec.name} is empty")
    if spec.kind in ("text", "hf") and not has_tokenizer:
        who = f"model {model}" if model else "the model"
        raise ValueError(
            f"cannot tokenize {spec}: {who} has no tokenizer; use a parquet: dataset of input_ids"
        )
    if spec.kind == "text":
        problem = utf8_problem(_existing_file(spec))
        if problem is not None:
            raise ValueError(f"{spec}: {problem}")


def utf8_problem(path: str | Path, chunk: int = 1 << 22) -> str | None:
    """One line naming the first byte of ``path`` that is not UTF-8 (None when all of it decodes)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # of the block in the file
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            pending = decoder.getstate()[0]  # the undecoded end of the previous block
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                byte = (pending + block)[err.start : err.start + 1].hex()
                at = offset - len(pending) + err.start
                return (
                    f"{path} is not UTF-8 text (byte 0x{byte} at offset {at}); "
                    "lrkv reads text files as UTF-8: convert it first, e.g. iconv -f latin1 -t utf-8"
                )
            if not block:
                return None
            offset += len(block)


def _existing_file(spec: DatasetSpec) -> Path:
    path = Path(spec.name).expanduser()
    if path.is_file():
        return path
    if path.exists():
        raise FileNotFoundError(f"dataset file {path} is not a file (from {spec})")
    hint = ""
    if spec.part is not None and Path(f"{path}{spec.part}").is_file():
        hint = f"; to name the file {path}{spec.part} itself, write {spec.kind}:{path}{spec.part}[:]"
    raise FileNotFoundError(f"dataset file not found: {path} (from {spec}){hint}")


def _check_parquet(spec: DatasetSpec, path: Path) -> None:
    try:
        schema = pq.read_schema(path)
        n_rows = pq.read_metadata(path).num_rows
    except pa.ArrowInvalid as err:
        raise ValueError(f"{spec}: {path} is not a readable Parquet file ({err})") from None
    if "input_ids" not in schema.names:
        raise ValueError(f"{spec} has no 'input_ids' column (columns: {schema.names})")
    begin, end = (spec.part or PercentSlice()).bounds(n_rows)
    if begin >= end:
        raise ValueError(f"{spec} selects no rows: the file has {n_rows}")
