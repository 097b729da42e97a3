"""Percent slices of a dataset source, in Hugging Face datasets' split-slicing syntax: ``[:90%]``, ``[90%:]``.

A slice is written after a dataset spec (``text:corpus.txt[:90%]``, ``parquet:rows.parquet[90%:]``,
``hf:wikitext:wikitext-2-raw-v1:train[10%:50%]``). Bounds are integer percents, ``0 <= A < B <= 100``; an
omitted bound is 0 or 100. A percent becomes an index as in ``datasets`` (``round(pct * n / 100)``, to the
closest), and the same function cuts both sides of a boundary, so ``[:p%]`` and ``[p%:]`` are disjoint and
together cover the source exactly. What is counted depends on the source: tokens of a text stream, rows of
a Parquet file.

``[:]`` is the whole source. Written after a path it strips nothing but itself, which is how a file whose
name ends in something that looks like a slice is named: ``text:odd[:90%].txt`` needs no escape, while a
file literally called ``x[:90%]`` is ``text:x[:90%][:]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SLICE_FORM = "[A%:B%] with integer percents 0 <= A < B <= 100, e.g. [:90%] or [90%:]"
_SLICE_LIKE = re.compile(r"\[[^\[\]:]*:[^\[\]:]*\]$")  # a trailing bracket holding exactly one ':'
_PERCENT_SLICE = re.compile(r"\[(?:(\d{1,3})%)?:(?:(\d{1,3})%)?\]")


def percent_index(pct: int, n: int) -> int:
    """Index of ``pct`` percent into ``n`` items, rounded to the closest (as ``datasets`` does)."""
    return int(round(pct * n / 100.0))


@dataclass(frozen=True)
class PercentSlice:
    """A contiguous part ``[start%, stop%)`` of a source; ``str()`` gives its ``[A%:B%]`` form."""

    start: int = 0
    stop: int = 100

    def __post_init__(self) -> None:
        ok = all(isinstance(b, int) and not isinstance(b, bool) for b in (self.start, self.stop))
        if not ok or not 0 <= self.start < self.stop <= 100:
            raise ValueError(f"bad slice [{self.start}%:{self.stop}%]: slices are {SLICE_FORM}")

    def __str__(self) -> str:
        start = f"{self.start}%" if self.start else ""
        stop = f"{self.stop}%" if self.stop != 100 else ""
        return f"[{start}:{stop}]"

    @classmethod
    def parse(cls, text: str) -> PercentSlice:
        """Parse ``[A%:B%]`` (either bound may be omitted).

        Raises
        ------
        ValueError
            Anything else, or bounds outside ``0 <= A < B <= 100``.
        """
        m = _PERCENT_SLICE.fullmatch(text)
        if m is None:
            raise ValueError(f"bad slice {text!r}: slices are {SLICE_FORM}")
        start, stop = m.group(1), m.group(2)
        try:
            return cls(int(start) if start else 0, int(stop) if stop else 100)
        except ValueError:
            raise ValueError(f"bad slice {text!r}: slices are {SLICE_FORM}") from None

    @property
    def is_full(self) -> bool:
        """True for ``[:]``, the whole source."""
        return self.start == 0 and self.stop == 100

    def bounds(self, n: int) -> tuple[int, int]:
        """``(begin, end)`` indices of this slice of ``n`` items (possibly empty for tiny ``n``)."""
        return percent_index(self.start, n), percent_index(self.stop, n)

    def describe(self, unit: str, source: str) -> str:
        """Words for the slice: ``"the last 10% of X's tokens"``, ``"the first 90% of X's rows"``, ..."""
        whose = f"{source}'s {unit}" if unit else source
        if self.start == 0:
            return f"the first {self.stop}% of {whose}"
        if self.stop == 100:
            return f"the last {100 - self.start}% of {whose}"
        return f"{self.start}% to {self.stop}% of {whose}"


def ends_like_slice(text: str) -> bool:
    """Whether ``text`` ends in a bracket that would be read as a slice (valid or not)."""
    return _SLICE_LIKE.search(text) is not None


def split_slice(text: str, *, path: bool = False) -> tuple[str, PercentSlice | None]:
    """Split a trailing slice off ``text``: ``"x.txt[:90%]"`` -> ``("x.txt", PercentSlice(0, 90))``.

    Parameters
    ----------
    text : str
        A spec without its ``kind:`` prefix.
    path : bool
        ``text`` names a local file: a trailing bracket that is not a valid percent slice is then kept as
        part of the name when a file of that full name exists (``data[a:b]``), instead of raising.

    Returns
    -------
    tuple
        ``(head, slice)``; the slice is None when there is none or when it is ``[:]`` (the whole source).

    Raises
    ------
    ValueError
        A trailing ``[...:...]`` that is not a percent slice (and, with ``path``, no such file exists).
    """
    m = _SLICE_LIKE.search(text)
    if m is None:
        return text, None
    try:
        part = PercentSlice.parse(m.group(0))
    except ValueError:
        if path and Path(text).expanduser().exists():
            return text, None
        raise
    return text[: m.start()], None if part.is_full else part
