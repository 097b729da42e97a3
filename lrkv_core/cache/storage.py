"""Cache storage strategies: how one layer's latents are kept between steps, and how attention reads them.

A strategy is two classes:

- a :class:`CacheStorage`: the frozen, registered config of the strategy (its fields are its options,
  ``config.lrkv["cache"]`` records ``{"name": ..., **options}``), which makes one store per layer and cache;
- a :class:`LatentStore`: the mutable store itself. It keeps per-token tensors ("parts", each (B, S, ...))
  and, for RoPE models, the (B, S) int32 positions. The generic operations (append along tokens, keep the last
  n, crop, batch select / repeat / beam reorder, reset, byte accounting) are written once here for every
  part; a strategy only says how new latents become parts (:meth:`LatentStore.encode`) and how parts become
  what attention reads (:meth:`LatentStore.decode`).

Attention reads a :class:`LatentView`: per-group key and value latents with exactly the layout's rank r_g
per group (a strategy that keeps fewer dimensions for some tokens pads them with zeros, which equals
truncation since ranks are prefixes of the spectrum), and the positions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..registry import Method, Registry


@dataclass(frozen=True)
class LatentView:
    """What attention reads from one layer: ``keys[g]``, ``values[g]`` (B, S, r_g) and positions (B, S).

    ``positions`` is None for models without RoPE (their cache holds no positions).
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    positions: torch.Tensor | None

    @classmethod
    def from_latents(
        cls,
        h_k: torch.Tensor,
        h_v: torch.Tensor,
        positions: torch.Tensor | None,
        ranks_k: Sequence[int],
        ranks_v: Sequence[int],
    ) -> LatentView:
        """The view of concatenated latents H_k (B, S, R_k), H_v (B, S, R_v), split into groups (no copy)."""
        return cls(split_groups(h_k, ranks_k), split_groups(h_v, ranks_v), positions)


def split_groups(h: torch.Tensor, ranks: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Views ``h[..., o_g : o_g + r_g]`` (B, S, r_g) of latents (B, S, Σ r_g) laid out group after group."""
    if h.shape[-1] != sum(ranks):
        raise ValueError(f"latents of width {h.shape[-1]} cannot hold groups of ranks {tuple(ranks)}")
    return tuple(torch.split(h, list(ranks), dim=-1))


class LatentStore(ABC):
    """One layer's cached latents, as per-token parts (each (B, S, ...)) plus (B, S) int32 positions.

    Parameters
    ----------
    ranks_k, ranks_v : per-group ranks r_g of the layer's key and value latents.

    Attributes
    ----------
    parts : name → tensor (B, S, ...), whatever :meth:`encode` returns, appended along dim 1.
    positions : (B, S) int32 position ids, or None when the latents come without them (non-RoPE models).
        The first append decides; later ones must agree.
    dtype : dtype of the latents given to the first append (what a strategy decodes back to).
    """

    def __init__(self, ranks_k: Sequence[int], ranks_v: Sequence[int]) -> None:
        self.ranks_k = tuple(int(r) for r in ranks_k)
        self.ranks_v = tuple(int(r) for r in ranks_v)
        self.parts: dict[str, torch.Tensor] = {}
        self.positions: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None
        self._with_positions: bool | None = None

    # ------------------------------------------------------------------------------ what a strategy defines

    @abstractmethod
    def encode(self, h_k: torch.Tensor, h_v: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parts of new latents: h_k (B, T, R_k), h_v (B, T, R_v) → name → (B, T, ...)."""

    @abstractmethod
    def decode(
        self, parts: Mapping[str, torch.Tensor]
    ) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
        """Per-group key and value latents (B, S, r_g), in :attr:`dtype`, from parts (B, S, ...)."""

    # ------------------------------------------------------------------------------ generic, for every part

    def append(self, h_k: torch.Tensor, h_v: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        """Encode new latents h_k (B, T, R_k), h_v (B, T, R_v) and append them (and their positions)."""
        B, T = h_k.shape[:2]
        if h_k.shape[-1] != sum(self.ranks_k) or h_v.shape[-1] != sum(self.ranks_v):
            raise ValueError(
                f"latents of widths ({h_k.shape[-1]}, {h_v.shape[-1]}) for a layer of ranks "
                f"{self.ranks_k} (keys) and {self.ranks_v} (values)"
            )
        if self._with_positions is None:
            self._with_positions, self.dtype = position_ids is not None, h_k.dtype
        elif (position_ids is not None) != self._with_positions:
            raise ValueError(
                f"latent cache layer {'holds' if self._with_positions else 'has no'} positions; "
                "updates must all come with position ids or all without"
            )
        new = self.encode(h_k, h_v)
        bad = {name: tuple(t.shape) for name, t in new.items() if tuple(t.shape[:2]) != (B, T)}
        if bad:
            raise ValueError(
                f"{type(self).__name__}.encode must return (B, T, ...) = ({B}, {T}, ...) parts: {bad}"
            )
        if self.parts:
            new = {name: torch.cat([self.parts[name], t], dim=1) for name, t in new.items()}  # (B, S, ...)
        self.parts = new
        if position_ids is not None:
            pos = position_ids.to(device=h_k.device, dtype=torch.int32).expand(B, T)
            self.positions = pos if self.positions is None else torch.cat([self.positions, pos], dim=1)

    def view(self) -> LatentView:
        """Every stored token, decoded: per group (B, S, r_g), exactly the layout's ranks."""
        keys, values = self.decode(self.parts)
        widths = ([k.shape[-1] for k in keys], [v.shape[-1] for v in values])
        if widths != (list(self.ranks_k), list(self.ranks_v)):
            raise ValueError(
                f"{type(self).__name__}.decode gave groups of widths {widths}, "
                f"the layout has {self.ranks_k} (keys) and {self.ranks_v} (values)"
            )
        return LatentView(tuple(keys), tuple(values), self.positions)

    def __len__(self) -> int:
        """Number of stored tokens S."""
        return next(iter(self.parts.values())).shape[1] if self.parts else 0

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to every per-token tensor (parts and positions)."""
        self.parts = {name: fn(t) for name, t in self.parts.items()}
        if self.positions is not None:
            self.positions = fn(self.positions)

    def keep_last(self, n: int) -> None:
        """Drop all but the last ``n`` tokens (a sliding window)."""
        start = max(len(self) - n, 0)
        if start:
            self._map(lambda t: t[:, start:])

    def crop(self, n: int) -> None:
        """Drop the last ``n`` tokens."""
        if n > 0:
            end = max(len(self) - n, 0)
            self._map(lambda t: t[:, :end])

    def select(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices`` (in that order)."""
        self._map(lambda t: t[indices])

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Reorder batch rows for beam search: row i becomes old row ``beam_idx[i]``."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in place (batch expansion)."""
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        """Forget every token; the next append starts afresh (and decides about positions again)."""
        self.parts, self.positions, self.dtype, self._with_positions = {}, None, None, None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the store holds: parts, positions and whatever else a strategy keeps as attributes."""
        found: dict[int, torch.Tensor] = {}
        pending = list(vars(self).values())
        while pending:
            item = pending.pop()
            if isinstance(item, torch.Tensor):
                found.setdefault(id(item), item)
            elif isinstance(item, Mapping):
                pending.extend(item.values())
            elif isinstance(item, (list, tuple)):
                pending.extend(item)
        return list(found.values())


@dataclass(frozen=True)
class CacheStorage(Method, ABC):
    """How a latent cache keeps one layer's latents: a registered method whose fields are its options."""

    @abstractmethod
    def create_store(self, ranks_k: tuple[int, ...], ranks_v: tuple[int, ...]) -> LatentStore:
        """A new, empty store for one layer with these per-group ranks."""


CACHE_STORAGES: Registry[CacheStorage] = Registry("cache storage", CacheStorage)
