"""Cache storage strategies: how one layer's latents are kept between steps, and how attention reads them.

A strategy is two classes:

- a :class:`CacheStorage`: the frozen, registered config of the strategy (its fields are its options,
  ``config.lrkv["cache"]`` records ``{"name": ..., **options}``), which makes one store per layer and cache;
- a :class:`LatentStore`: the mutable store itself. It keeps per-token tensors ("parts", each (B, S, ...))
  and, for RoPE models, the (B, S) int32 positions. The generic operations (append along tokens, keep the last
  n, crop, batch select / repeat / beam reorder, reset, byte accounting) are written once here for every
  part; a strategy only says how new latents become parts (:meth:`LatentStore.encode`) and how parts become
  what attention reads (:meth:`LatentStore.decode`).

A store may keep its newest ``residual`` tokens exactly as given (KIVI's full-precision residual window): new
latents enter that window, and only the tokens it pushes out are encoded. The generic operations treat the
encoded tokens and the window as one token sequence, so every strategy gets the window for free.

Attention reads a :class:`LatentView`: per-group key and value latents with exactly the layout's rank r_g
per group (a strategy that keeps fewer dimensions for some tokens pads them with zeros, which equals
truncation since ranks are prefixes of the spectrum), and the positions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..registry import Method, Registry

if TYPE_CHECKING:
    from lrkv_kernels.latent_rope import PackedLatents


@dataclass(frozen=True)
class LatentView:
    """What attention reads from one layer: ``keys[g]``, ``values[g]`` (B, S, r_g) and positions (B, S).

    ``positions`` is None for models without RoPE (their cache holds no positions).
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    positions: torch.Tensor | None

    @property
    def packed(self) -> tuple[PackedLatents, PackedLatents] | None:
        """The keys and values as a kernel can read them without decoding (a quantized store's packed
        codes), or None: read ``keys`` and ``values``."""
        return None

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
    residual : how many of the newest tokens are kept exactly as given, before encoding (0: none).

    Attributes
    ----------
    parts : name → tensor (B, S_e, ...), whatever :meth:`encode` returns for the S_e oldest tokens, appended
        along dim 1.
    recent : ``{"k": (B, S_r, R_k), "v": (B, S_r, R_v)}``, the S_r ≤ ``residual`` newest tokens as given
        (empty without a residual window). Tokens are the encoded ones, then these: S = S_e + S_r.
    positions : (B, S) int32 position ids, or None when the latents come without them (non-RoPE models).
        The first append decides; later ones must agree.
    dtype : dtype of the latents given to the first append (what a strategy decodes back to).
    """

    def __init__(self, ranks_k: Sequence[int], ranks_v: Sequence[int], residual: int = 0) -> None:
        if residual < 0:
            raise ValueError(f"a residual window holds ≥ 0 tokens, got {residual}")
        self.ranks_k = tuple(int(r) for r in ranks_k)
        self.ranks_v = tuple(int(r) for r in ranks_v)
        self.residual = int(residual)
        self.parts: dict[str, torch.Tensor] = {}
        self.recent: dict[str, torch.Tensor] = {}
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
        """Append new latents h_k (B, T, R_k), h_v (B, T, R_v) and their positions: encoded, or, with a
        residual window, into the window, encoding the tokens it pushes out."""
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
        if self.residual:
            h_k, h_v = self._through_window(h_k, h_v)  # the tokens the window pushes out, (B, T_e, R)
        if h_k.shape[1] or not self.residual:
            self._append_encoded(h_k, h_v)
        if position_ids is not None:
            pos = position_ids.to(device=h_k.device, dtype=torch.int32).expand(B, T)
            self.positions = pos if self.positions is None else torch.cat([self.positions, pos], dim=1)

    def _through_window(self, h_k: torch.Tensor, h_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new latents to the residual window; return the oldest ones it no longer holds (B, T_e, R)."""
        k = torch.cat([self.recent["k"], h_k], dim=1) if self.recent else h_k  # (B, S_r + T, R_k)
        v = torch.cat([self.recent["v"], h_v], dim=1) if self.recent else h_v
        out = self._leaving(k.shape[1])
        # a copy, so the window does not keep the pushed-out tokens' memory alive
        self.recent = {"k": k[:, out:].clone(), "v": v[:, out:].clone()}
        return k[:, :out], v[:, :out]

    def _leaving(self, waiting: int) -> int:
        """How many of the ``waiting`` tokens (window and new, oldest first) leave the window to be encoded:
        all but the newest ``residual``. A strategy may release them otherwise (GEAR: whole buffers)."""
        return max(waiting - self.residual, 0)

    def _append_encoded(self, h_k: torch.Tensor, h_v: torch.Tensor) -> None:
        B, T = h_k.shape[:2]
        new = self.encode(h_k, h_v)
        bad = {name: tuple(t.shape) for name, t in new.items() if tuple(t.shape[:2]) != (B, T)}
        if bad:
            raise ValueError(
                f"{type(self).__name__}.encode must return (B, T, ...) = ({B}, {T}, ...) parts: {bad}"
            )
        if self.parts:
            new = {name: torch.cat([self.parts[name], t], dim=1) for name, t in new.items()}  # (B, S_e, ...)
        self.parts = new

    def view(self) -> LatentView:
        """Every stored token, decoded: per group (B, S, r_g), exactly the layout's ranks (the encoded tokens
        as :meth:`decode` gives them back, then the residual window's as they were given)."""
        segments = []
        if self._encoded():
            keys, values = self.decode(self.parts)
            widths = ([k.shape[-1] for k in keys], [v.shape[-1] for v in values])
            if widths != (list(self.ranks_k), list(self.ranks_v)):
                raise ValueError(
                    f"{type(self).__name__}.decode gave groups of widths {widths}, "
                    f"the layout has {self.ranks_k} (keys) and {self.ranks_v} (values)"
                )
            segments.append((keys, values))
        if self.recent and self.recent["k"].shape[1]:
            segments.append(
                (split_groups(self.recent["k"], self.ranks_k), split_groups(self.recent["v"], self.ranks_v))
            )
        if len(segments) == 1:
            keys, values = segments[0]
        else:  # (B, S_e + S_r, r_g) per group
            keys = [torch.cat(g, dim=1) for g in zip(*(seg[0] for seg in segments))]
            values = [torch.cat(g, dim=1) for g in zip(*(seg[1] for seg in segments))]
        return LatentView(tuple(keys), tuple(values), self.positions)

    def _encoded(self) -> int:
        """Number of encoded tokens S_e."""
        return next(iter(self.parts.values())).shape[1] if self.parts else 0

    def __len__(self) -> int:
        """Number of stored tokens S (encoded, then in the residual window)."""
        return self._encoded() + (self.recent["k"].shape[1] if self.recent else 0)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to every batch-major tensor (parts, the residual window and positions)."""
        self.parts = {name: fn(t) for name, t in self.parts.items()}
        self.recent = {name: fn(t) for name, t in self.recent.items()}
        if self.positions is not None:
            self.positions = fn(self.positions)

    def _slice_tokens(self, start: int, end: int) -> None:
        """Keep tokens ``start..end-1`` of the sequence (encoded tokens first, then the window)."""
        n_enc = self._encoded()
        self.parts = {name: t[:, min(start, n_enc) : min(end, n_enc)] for name, t in self.parts.items()}
        lo, hi = max(start - n_enc, 0), max(end - n_enc, 0)
        self.recent = {name: t[:, lo:hi] for name, t in self.recent.items()}
        if self.positions is not None:
            self.positions = self.positions[:, start:end]

    def keep_last(self, n: int) -> None:
        """Drop all but the last ``n`` tokens (a sliding window)."""
        start = max(len(self) - n, 0)
        if start:
            self._slice_tokens(start, len(self))

    def crop(self, n: int) -> None:
        """Drop the last ``n`` tokens."""
        if n > 0:
            self._slice_tokens(0, max(len(self) - n, 0))

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
        self.parts, self.recent, self.positions, self.dtype, self._with_positions = {}, {}, None, None, None

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

    def check_ranks(self, ranks: Sequence[int]) -> None:
        """Raise ``ValueError`` if this strategy cannot keep latent groups of these ranks; every rank is fine
        unless a strategy says otherwise (a quantization group size must divide them, for instance)."""

    def check_static(self) -> None:
        """Raise ``ValueError`` unless this strategy can keep its tokens in preallocated buffers
        (:class:`~lrkv_core.cache.static.StaticLatentLayer`): it must encode every token on its own, so
        that new tokens are written in place and nothing stored changes later. None can unless it says so."""
        raise ValueError(
            f"the {self.name} cache storage re-encodes stored tokens as the cache grows, so it cannot be "
            "preallocated (static); use a LatentCache, or the dense or quantized storage"
        )

    def check_rotation(self, rotation: str) -> None:
        """Raise ``ValueError`` if this strategy cannot read latents whose factors carry the fused
        ``rotation`` (a policy of :mod:`lrkv_core.quant.rotation`); every rotation is fine unless a strategy
        says otherwise (one that cuts latents to a prefix needs them in spectral order, for instance)."""

    def rotation_warning(self, rotation: str) -> str | None:
        """A line for the user where latents this strategy keeps would be poorly served by ``rotation``
        (integer codes of unrotated latents, say); None where there is nothing to say."""
        return None


def unrotated_codes_warning(storage: str, bits: int, rotation: str) -> str | None:
    """The warning for integer codes of latents without a fused rotation: each row's grid is set by its
    leading latents, so the low-energy ones quantize to little more than noise."""
    if bits > 4 or rotation != "none":  # the loss is measured at 2, 3 and 4 bits
        return None
    return (
        f"the {storage} cache stores {bits}-bit codes of unrotated latents, which lose far more than "
        "rotated ones (measured in docs/quantized-cache.md); add --rotation auto (a recipe's "
        "compression.rotation: auto)"
    )


CACHE_STORAGES: Registry[CacheStorage] = Registry("cache storage", CacheStorage)
