"""The calibration-statistic interface, its registry, and one file format for all statistics.

A statistic is collected from the model over the calibration rows in one streaming pass and gives one value
per layer: a tensor (the Gram matrix) or a dict of tensors (the Fisher of k_proj and v_proj). Methods name
the statistics they read in ``needs``; only those are collected.

Every statistic is a map over shards of its rows and a reduce: ``accumulate`` gives additive sums and
counts over some rows, ``finish`` turns the sums over all rows into the values and metadata. So the rows can
be split into contiguous shards (:func:`shard_span`), each collected on its own (``collect_shard``, saved
with :func:`save_partial`), and the shards' sums added up (``merge``) give what one ``collect`` over all rows
gives, up to the rounding of the order of the additions. Means are divided once, by the total count, in
``finish``; anything random is seeded per row, so neither the shards nor the batch size change the draws.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from torch import nn

from ..model.adapters import get_adapter
from ..registry import Method, Registry
from ..system.files import save_tensors
from .precision import stack_precision

Progress = Callable[[int, int], None] | None
LayerValue = torch.Tensor | dict[str, torch.Tensor]
Counts = dict[str, int]


@dataclass(frozen=True)
class Partial:
    """A statistic's additive sums over one shard of its rows (what ``Statistic.merge`` adds up)."""

    statistic: dict[str, Any]  # the statistic's recipe form
    sums: list[LayerValue]  # per layer, laid out as the values; added element-wise across shards
    counts: Counts  # added across shards (rows, tokens, samples): what ``finish`` normalises by
    shard: tuple[int, int]  # (index, count)
    span: tuple[int, int]  # [start, stop) within the statistic's rows
    total: int  # the number of rows the statistic uses, all shards together
    unit: int  # rows that stay together in one shard (a per-batch Fisher's batch size)
    rows_sha256: str  # of all the statistic's rows (every shard's): shards of other rows do not merge


@dataclass(frozen=True)
class Statistic(Method, ABC):
    """A per-layer calibration statistic, collected in one pass over the calibration rows (or shard by
    shard, and merged).

    ``n_samples`` uses only the first n calibration rows (they are drawn at random, so these are a random
    subset): statistics can then use different amounts of calibration data (e.g. Palu whitens with 256
    windows and estimates the Fisher with 2048) from one calibration set of the largest size.
    """

    n_samples: int | None = None  # the first n calibration rows; None: all of them
    # n_samples is a cap: a calibration with fewer rows is used whole (else asking for more is an error)
    caps_rows: ClassVar[bool] = False
    # read the decomposition's factors (``collect(..., factors=...)``), so collected after decomposing
    uses_factors: ClassVar[bool] = False
    # its sums add up across shards of the rows (``collect_shard`` + ``merge``); one whose do not sets False
    shardable: ClassVar[bool] = True
    # how it shares one pass over the rows with other statistics (lrkv_core.statistics.joint): "forward"
    # (hooks on the forward pass), "gradient" (one loss of a shared gradient pass), None (passes of its own)
    joint: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        if self.n_samples is not None and self.n_samples < 1:
            raise ValueError(f"{self.name}: n_samples must be ≥ 1, got {self.n_samples}")

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The calibration rows this statistic uses; a clear error when it asks for more than there are
        (unless ``caps_rows``)."""
        if self.n_samples is not None and self.n_samples > rows.shape[0] and not self.caps_rows:
            raise ValueError(
                f"statistic {self.name} asks for {self.n_samples} calibration rows, the calibration has "
                f"{rows.shape[0]}: raise calibration.n_samples"
            )
        return rows[: self.used_rows(*rows.shape)]

    def used_rows(self, n_rows: int, seq_len: int | None = None) -> int:
        """How many of ``n_rows`` calibration rows of ``seq_len`` tokens this statistic reads (the first)."""
        return n_rows if self.n_samples is None else min(self.n_samples, n_rows)

    @abstractmethod
    def accumulate(
        self,
        model: nn.Module,
        rows: torch.Tensor,
        *,
        first_row: int,
        batch_size: int,
        progress: Progress,
        **extra: Any,
    ) -> tuple[list[LayerValue], Counts]:
        """Per-layer sums over ``rows`` (N, T) token ids that add up across shards (on the CPU), and the
        counts they are normalised by. ``first_row``: the index of ``rows[0]`` among the statistic's rows,
        which seeds anything drawn per row. ``extra``: ``factors=`` for a statistic with ``uses_factors``."""

    @abstractmethod
    def finish(self, sums: list[LayerValue], counts: Counts) -> tuple[list[LayerValue], dict[str, Any]]:
        """The per-layer values and metadata from the sums and counts over all the statistic's rows."""

    def observer(self, model: nn.Module, *, first_row: int, recording: list[bool]) -> Any:
        """This statistic's part of a joint pass over rows starting at ``first_row`` (a
        :class:`lrkv_core.statistics.joint.Observer`; its hooks count only while ``recording[0]``): for a
        statistic with ``joint`` set."""
        raise NotImplementedError(f"statistic {self.name} cannot share a pass")

    def unit(self, batch_size: int) -> int:
        """Rows a shard boundary may not split (1: any row boundary will do)."""
        return 1

    def max_shards(self, n_rows: int, batch_size: int, seq_len: int | None = None) -> int:
        """The most shards (none empty) this statistic's rows among ``n_rows`` calibration rows of
        ``seq_len`` tokens split into, collected in batches of ``batch_size``; 1 for a statistic that is not
        ``shardable``."""
        if not self.shardable:
            return 1
        return -(-self.used_rows(n_rows, seq_len) // self.unit(batch_size))

    def collect(
        self,
        model: nn.Module,
        rows: torch.Tensor,
        *,
        batch_size: int = 8,
        progress: Progress = None,
        **extra: Any,
    ) -> tuple[list[LayerValue], dict[str, Any]]:
        """Per-layer values for ``rows`` (N, T) token ids, and metadata (sample counts, ...).

        A statistic with ``uses_factors`` also takes ``factors=``, every layer's full-spectrum factors."""
        sums, counts = self.accumulate(
            model, self.rows(rows), first_row=0, batch_size=batch_size, progress=progress, **extra
        )
        return self.finish(sums, counts)

    def collect_shard(
        self,
        model: nn.Module,
        rows: torch.Tensor,
        *,
        shard: tuple[int, int],
        batch_size: int = 8,
        progress: Progress = None,
        **extra: Any,
    ) -> Partial:
        """The sums over shard ``(index, count)`` of the statistic's rows (:func:`shard_span`); ``rows`` are
        all the calibration rows, as ``collect`` takes them. Merging every shard's gives ``collect``'s."""
        if not self.shardable:
            raise ValueError(f"statistic {self.name} cannot be collected in shards: collect it in one pass")
        rows = self.rows(rows)
        unit = self.unit(batch_size)
        start, stop = shard_span(rows.shape[0], shard, unit)
        sums, counts = self.accumulate(
            model, rows[start:stop], first_row=start, batch_size=batch_size, progress=progress, **extra
        )
        digest = hashlib.sha256(rows.cpu().contiguous().numpy().tobytes()).hexdigest()
        return Partial(self.to_dict(), sums, counts, tuple(shard), (start, stop), rows.shape[0], unit, digest)

    def merge(self, parts: Sequence[Partial]) -> tuple[list[LayerValue], dict[str, Any]]:
        """The values and metadata of every shard's sums added up: those of ``collect`` over all the rows.

        Raises ``ValueError`` unless ``parts`` are this statistic's, one per shard of one split."""
        if not parts:
            raise ValueError(f"merge {self.name}: no shards given")
        first = parts[0]
        count = first.shard[1]
        for p in parts:
            if p.statistic != self.to_dict():
                raise ValueError(f"merge {self.to_dict()}: a shard holds {p.statistic}")
            if (p.shard[1], p.total, p.unit) != (count, first.total, first.unit):
                raise ValueError(
                    f"merge {self.name}: shards of different splits (shard {p.shard} of {p.total} rows in "
                    f"units of {p.unit}, shard {first.shard} of {first.total} rows in units of {first.unit})"
                )
            if p.span != shard_span(p.total, p.shard, p.unit):
                raise ValueError(f"merge {self.name}: shard {p.shard} spans rows {p.span}, not its own")
            if p.rows_sha256 != first.rows_sha256:
                raise ValueError(f"merge {self.name}: shards of different calibration rows")
        indices = sorted(p.shard[0] for p in parts)
        if indices != list(range(count)):
            raise ValueError(f"merge {self.name}: need each of the {count} shards once, got shards {indices}")
        parts = sorted(parts, key=lambda p: p.shard[0])
        total = (parts[0].sums, dict(parts[0].counts))
        for p in parts[1:]:
            if set(p.counts) != set(total[1]) or len(p.sums) != len(total[0]):
                raise ValueError(f"merge {self.name}: shards with different layers or counts")
            total = add_sums(total, (p.sums, p.counts))
        return self.finish(*total)


def add_sums(
    a: tuple[list[LayerValue], Counts], b: tuple[list[LayerValue], Counts]
) -> tuple[list[LayerValue], Counts]:
    """Two ``(sums, counts)`` of one statistic over disjoint rows added up: its sums over both."""

    def add(x: LayerValue, y: LayerValue) -> LayerValue:
        if isinstance(x, torch.Tensor):
            return x + y
        if set(x) != set(y):
            raise ValueError(f"sums hold different keys: {sorted(x)} and {sorted(y)}")
        return {k: x[k] + y[k] for k in x}

    return [add(x, y) for x, y in zip(a[0], b[0], strict=True)], {k: v + b[1][k] for k, v in a[1].items()}


def shard_span(n_rows: int, shard: tuple[int, int], unit: int = 1) -> tuple[int, int]:
    """Rows ``[start, stop)`` of shard ``(index, count)`` of ``n_rows``: contiguous, in order, never empty.

    The rows are cut into ⌈n_rows / unit⌉ units of ``unit`` rows (the last may be shorter); each shard takes
    ⌊units / count⌋ consecutive units and the first ``units mod count`` shards one more. Raises
    ``ValueError`` for an index outside ``0..count − 1`` or more shards than units."""
    index, count = shard
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard (index, count) needs 0 ≤ index < count, got {tuple(shard)}")
    units = -(-n_rows // unit)
    if count > units:
        what = f"{units} batches of {unit} rows" if unit > 1 else f"{n_rows} rows"
        raise ValueError(f"cannot cut {what} into {count} shards: a shard may not be empty")
    size, extra = divmod(units, count)
    first = index * size + min(index, extra)
    last = first + size + (index < extra)
    return first * unit, min(last * unit, n_rows)


STATISTICS: Registry[Statistic] = Registry("statistic", Statistic)


def forward_rows(
    model: nn.Module,
    rows: torch.Tensor,
    handles: list,
    *,
    batch_size: int,
    progress: Progress,
    after_batch: Callable[[], None] | None = None,
) -> None:
    """Run ``model``'s decoder stack (eval mode, no cache) over ``rows`` in batches for its hooks inside the
    layers to accumulate, calling ``after_batch`` after each, reporting progress; the hooks in ``handles``
    are removed and the train mode restored, even on error. The output projection is not run: no
    statistic reads the logits, whose full-vocabulary rows cost a fifth of a small model's forward pass
    and the largest tensor of the batch."""
    device = next(model.parameters()).device
    stack = get_adapter(model.config).base_model(model)
    was_training = model.training
    model.eval()
    try:
        n = rows.shape[0]
        for start in range(0, n, batch_size):
            with stack_precision(model):
                stack(input_ids=rows[start : start + batch_size].to(device), use_cache=False)
            if after_batch is not None:
                after_batch()
            if progress:
                progress(min(start + batch_size, n), n)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)


def _layer_tensors(values: list[LayerValue]) -> tuple[dict[str, torch.Tensor], list[str] | None]:
    """``{layer}`` for tensor values, ``{layer}.{key}`` for dict values; and the dict keys."""
    tensors, keys = {}, None
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            tensors[str(i)] = value.contiguous()
        else:
            keys = sorted(value)
            tensors.update({f"{i}.{k}": value[k].contiguous() for k in keys})
    return tensors, keys


def _save(statistic: dict[str, Any], values: list[LayerValue], path: str | Path, **rest: Any) -> None:
    tensors, keys = _layer_tensors(values)
    header = {"statistic": statistic, "layers": len(values), "keys": keys, **rest}
    save_tensors(tensors, str(path), metadata={"lrkv_statistic": json.dumps(header)})


def save_statistic(stat: Statistic, values: list[LayerValue], meta: dict[str, Any], path: str | Path) -> None:
    """Safetensors: ``{layer}`` for tensor values, ``{layer}.{key}`` for dict values; header as JSON."""
    _save(stat.to_dict(), values, path, meta=meta)


def save_partial(part: Partial, path: str | Path) -> None:
    """A shard's sums, laid out as :func:`save_statistic` lays out values; the header's ``partial`` holds
    the shard, its rows and counts (a partial is not a statistic: :func:`load_statistic` refuses it)."""
    partial = {
        "shard": list(part.shard),
        "span": list(part.span),
        "total": part.total,
        "unit": part.unit,
        "counts": part.counts,
        "rows_sha256": part.rows_sha256,
    }
    _save(part.statistic, part.sums, path, partial=partial)


def read_header(path: str | Path) -> dict[str, Any]:
    """The statistic's recipe form, layer count, value keys and metadata (a partial's: its ``partial``)."""
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["lrkv_statistic"])


def _read(
    path: str | Path, layer: int | None, *, partial: bool
) -> tuple[dict[str, Any], LayerValue | list[LayerValue]]:
    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["lrkv_statistic"])
        if ("partial" in header) != partial:
            raise ValueError(
                f"{path} is one shard's partial sums of {header['statistic']['name']}: merge the shards "
                "(merge_statistic_files)"
                if not partial
                else f"{path} is a whole statistic, not one shard's partial sums"
            )
        keys = header["keys"]

        def value(i: int) -> LayerValue:
            if keys is None:
                return f.get_tensor(str(i))
            return {k: f.get_tensor(f"{i}.{k}") for k in keys}

        if layer is not None:
            if not 0 <= layer < header["layers"]:
                raise IndexError(f"{path} holds {header['layers']} layers, not layer {layer}")
            return header, value(layer)
        return header, [value(i) for i in range(header["layers"])]


def load_statistic(path: str | Path, layer: int | None = None) -> LayerValue | list[LayerValue]:
    """One layer's value (only its tensors are read), or every layer's."""
    return _read(path, layer, partial=False)[1]


def load_partial(path: str | Path) -> Partial:
    """A shard's sums saved by :func:`save_partial`."""
    header, sums = _read(path, None, partial=True)
    p = header["partial"]
    return Partial(
        header["statistic"],
        sums,
        p["counts"],
        tuple(p["shard"]),
        tuple(p["span"]),
        p["total"],
        p["unit"],
        p["rows_sha256"],
    )
