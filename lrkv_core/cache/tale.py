"""The ``tale`` cache storage: token-adaptive ranks, each token's latents cut to a prefix by its significance.

TALE (Lee et al., TACL 2025) gives tokens different ranks by their significance, approximates lazily (the
newest tokens stay as computed until the cache must take them in) and attends without rebuilding keys and
values. lrkv's latents are already prefixes of an ordered spectrum (whitened SVD, plain SVD and PCA order
their bases by energy), so cutting one token to rank l is keeping its first l latents and padding the rest
with zeros, exactly as a plan of rank l would give; the fused up-projections (Palu's form) already attend
without rebuilding values. Here, per layer and kind (K or V), with two levels:

1. **Ordinary tokens** keep the first ``⌊low · r_g⌋`` latents of every group ("the low level"; ``low: 0``
   keeps nothing of them, which is token eviction).
2. **Significant tokens** keep every latent. A token's significance is the energy of what the low level
   would drop, ``Σ_g ‖h_g[l_g:]‖²`` (lrkv's rule: the truncation error, measured in the latent coordinates;
   TALE's own rule may differ). The cache keeps the ``round(keep · S)`` most significant of its S
   compressed tokens at full rank, re-ranked over the whole cache each time tokens come in, so a token
   that was kept can later give its place to a more significant one (its tail is then dropped).
   The first ``sink`` tokens of the sequence always keep every latent (attention sinks) and are not
   counted in that share.
3. **Lazy buffer**: new tokens stay as computed until ``buffer`` of them wait; then all waiting tokens in
   whole multiples of ``buffer`` are cut together (``buffer: 0`` cuts every update as it comes).

Parts, per token: ``k_low_latents`` (B, S, Σ_g l_g) and ``v_low_latents``, in the model's dtype. Across
tokens, in :attr:`TaleStore.kept`: per kind, the kept tokens' tails (``tail_latents``, (B, K, Σ_g (r_g −
l_g))), their indices among the compressed tokens (B, K) int32 and their significance (B, K) float32 (what
the next re-ranking compares). K is the same for every batch row; after a crop or a sliding window a row may
hold fewer kept tokens than another, and its spare slots hold zeros with significance −inf (they add nothing
and are the first to go). The cache's reported bytes are all of these, the buffer's tokens and the positions
included.

**Integer levels** (``bits``: 2, 3, 4 or 8): every group's low level, and every whole token's tail, is a
block of latents that is rotated by an orthogonal matrix of its own width (:func:`block_rotation`), then
quantized per token and block (:mod:`lrkv_core.quant`: packed codes, float16 scale and zero-point; parts
``…_codes``, ``…_scale``, ``…_zero`` instead of ``…_latents``). Rotating within a block keeps the order
between levels, which a rotation fused into the factors would not, and spreads the whitened latents'
leading coordinates before quantizing (what the fused rotation is for). Ranking reads the exact tails.

The view gives attention every group at its full rank r_g (zeros past a token's level), so attention
costs what the dense cache's does; only memory shrinks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..quant import INTEGER_BITS, QuantizedRows, dequantize, pack_codes, quantize, unpack_codes
from ..rotation import rotation_matrix
from .storage import CACHE_STORAGES, CacheStorage, LatentStore, split_groups


def low_ranks(ranks: Sequence[int], low: float) -> tuple[int, ...]:
    """Latents kept per group by an ordinary token: ``⌊low · r_g⌋`` (never more than ``low`` of them)."""
    return tuple(int(low * r + 1e-9) for r in ranks)


def cut(h: torch.Tensor, ranks: Sequence[int], lows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Split latents h (..., Σ r_g) into every group's head (..., Σ l_g) and tail (..., Σ (r_g − l_g))."""
    groups = split_groups(h, ranks)
    head = torch.cat([g[..., :lo] for g, lo in zip(groups, lows)], dim=-1)
    tail = torch.cat([g[..., lo:] for g, lo in zip(groups, lows)], dim=-1)
    return head, tail


def join(
    head: torch.Tensor, tail: torch.Tensor, ranks: Sequence[int], lows: Sequence[int]
) -> tuple[torch.Tensor, ...]:
    """Per group (..., r_g): the group's head then its tail (the inverse of :func:`cut`)."""
    heads = torch.split(head, list(lows), dim=-1)
    tails = torch.split(tail, [r - lo for r, lo in zip(ranks, lows)], dim=-1)
    return tuple(torch.cat([h, t], dim=-1) for h, t in zip(heads, tails))


@functools.cache
def block_rotation(widths: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """Block-diagonal orthogonal matrix (Σ w × Σ w) float32 on ``device``: per block of width w, the
    normalised Hadamard matrix of order w where :mod:`lrkv_core.rotation` builds one, else a random orthogonal
    one seeded by w. A constant of the widths, like the code (so no cache holds or counts it); built once per
    device, not copied at every step."""
    if torch.device(device).type != "cpu":
        return block_rotation(widths).to(device)
    return torch.block_diag(*(rotation_matrix(w, "auto", seed=w)[0] for w in widths)).float()


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``t[b, index[b, k]]`` of t (B, N, ...) for index (B, K): (B, K, ...)."""
    return t.gather(1, index.view(*index.shape, *(1,) * (t.dim() - 2)).expand(*index.shape, *t.shape[2:]))


class TaleStore(LatentStore):
    """Latents cut to a per-token level: significant tokens whole, the others to a prefix (module docstring).

    Parameters
    ----------
    ranks_k, ranks_v : per-group ranks of the layer.
    low : share of each group's rank an ordinary token keeps (0 ≤ low ≤ 1).
    keep : share of the compressed tokens kept whole, the most significant (0 ≤ keep ≤ 1).
    sink : the first ``sink`` tokens of the sequence are always kept whole.
    buffer : tokens kept as computed until this many wait to be cut together (0: every update).
    bits : None to keep latents in the model's dtype; 2, 3, 4 or 8 to keep them as packed integer codes, per
        token and per block of a group's low level or tail, each block rotated first (:func:`block_rotation`).

    Attributes
    ----------
    lows : ``{"k": (l_g per key group), "v": ...}``, the ranks of the low level.
    kept : ``{"k": {"index": (B, K) int32, "significance": (B, K) float32, "tail_*": the tails (B, K, ...)
        as stored}, "v": ...}``: the tokens kept whole beyond their low level (empty before the first cut).
        A tail is stored as ``tail_latents`` (B, K, Σ (r_g − l_g)), or quantized as ``tail_codes``,
        ``tail_scale`` and ``tail_zero``.
    offset : how many tokens of the sequence were dropped before the first one held (a sliding window);
        token i of the store is token ``offset + i`` of the sequence.
    """

    def __init__(
        self,
        ranks_k: Sequence[int],
        ranks_v: Sequence[int],
        low: float = 0.5,
        keep: float = 0.25,
        sink: int = 4,
        buffer: int = 32,
        bits: int | None = None,
    ) -> None:
        super().__init__(ranks_k, ranks_v, residual=buffer)
        self.low, self.keep, self.sink, self.bits = low, keep, sink, bits
        self.lows = {"k": low_ranks(self.ranks_k, low), "v": low_ranks(self.ranks_v, low)}
        self.kept: dict[str, dict[str, torch.Tensor]] = {}
        self.offset = 0

    def _leaving(self, waiting: int) -> int:
        """The lazy buffer: once ``buffer`` tokens wait, all whole multiples of it are cut together."""
        return waiting - waiting % self.residual

    def significance(self, tail: torch.Tensor) -> torch.Tensor:
        """Significance (B, T) float32 of new tokens from their tails (B, T, Σ (r_g − l_g)): the energy the
        low level would drop, ``‖tail‖²``."""
        return tail.float().pow(2).sum(-1)

    def _ranks(self, kind: str) -> tuple[int, ...]:
        return self.ranks_k if kind == "k" else self.ranks_v

    def _whole(self, n_encoded: int) -> int:
        """How many of ``n_encoded`` compressed tokens keep every latent: the significant share plus the
        sinks among them."""
        sinks = max(0, min(self.sink, self.offset + n_encoded) - self.offset)
        return min(n_encoded, int(self.keep * (n_encoded - sinks) + 0.5) + sinks)

    def _stored(self, x: torch.Tensor, widths: Sequence[int]) -> dict[str, torch.Tensor]:
        """Latents x (B, T, Σ w) as kept: ``latents`` as given, or each block of width w rotated and quantized
        (``codes`` packed (B, T, ⌈Σ w · b / 8⌉) uint8, ``scale`` and ``zero`` (B, T, blocks) float16)."""
        blocks = tuple(w for w in widths if w)
        if self.bits is None or not blocks:
            return {"latents": x}
        q = quantize(x.float() @ block_rotation(blocks, x.device), blocks, self.bits)
        return {"codes": pack_codes(q.codes, self.bits), "scale": q.scale, "zero": q.zero}

    def _read(self, stored: Mapping[str, torch.Tensor], widths: Sequence[int]) -> torch.Tensor:
        """The latents (B, N, Σ w) in the model's dtype from what :meth:`_stored` kept."""
        if "latents" in stored:
            return stored["latents"]
        blocks = tuple(w for w in widths if w)
        codes = unpack_codes(stored["codes"], self.bits, sum(blocks))
        x = dequantize(QuantizedRows(codes, stored["scale"], stored["zero"]), blocks, torch.float32)
        return (x @ block_rotation(blocks, x.device).T).to(self.dtype)

    def _tail_widths(self, kind: str) -> tuple[int, ...]:
        return tuple(r - lo for r, lo in zip(self._ranks(kind), self.lows[kind]))

    def encode(self, h_k: torch.Tensor, h_v: torch.Tensor) -> dict[str, torch.Tensor]:
        """Cut new tokens to the low level; re-rank the whole cache's tails with theirs (:attr:`kept`)."""
        before = self._encoded()
        B, T = h_k.shape[:2]
        new = torch.arange(before, before + T, device=h_k.device, dtype=torch.int32).expand(B, T)
        whole = self._whole(before + T)
        parts = {}
        for kind, h in (("k", h_k), ("v", h_v)):
            head, tail = cut(h, self._ranks(kind), self.lows[kind])  # (B, T, Σ l_g), (B, T, Σ (r_g − l_g))
            parts |= {f"{kind}_low_{n}": t for n, t in self._stored(head, self.lows[kind]).items()}
            significance = self.significance(tail).masked_fill(self.offset + new < self.sink, float("inf"))
            candidates = {f"tail_{n}": t for n, t in self._stored(tail, self._tail_widths(kind)).items()}
            candidates |= {"index": new, "significance": significance}
            old = self.kept.get(kind)
            if old is not None:  # candidates: the tokens kept whole so far, then the new ones
                candidates = {name: torch.cat([old[name], t], dim=1) for name, t in candidates.items()}
            ranked = candidates["significance"]  # (B, N): after a crop, fewer than the tokens held
            top = ranked.topk(min(whole, ranked.shape[1]), dim=1).indices  # (B, K)
            self.kept[kind] = {name: _take(t, top) for name, t in candidates.items()}
        return parts

    def decode(self, parts: Mapping[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], ...]:
        out = []
        for kind in ("k", "v"):
            ranks, lows, kept = self._ranks(kind), self.lows[kind], self.kept[kind]
            prefix = f"{kind}_low_"
            head = self._read({n[len(prefix) :]: t for n, t in parts.items() if n.startswith(prefix)}, lows)
            tail = self._read(
                {n[5:]: t for n, t in kept.items() if n.startswith("tail_")}, self._tail_widths(kind)
            )
            full = head.new_zeros((*head.shape[:2], tail.shape[-1]))  # (B, S_e, Σ (r_g − l_g))
            # adding onto zeros is exact; spare slots add zeros wherever they point
            full.scatter_add_(1, kept["index"].long().unsqueeze(-1).expand_as(tail), tail.to(head.dtype))
            out.append(join(head, full, ranks, lows))
        return out[0], out[1]

    def _slice_tokens(self, start: int, end: int) -> None:
        """Keep tokens ``start..end-1``; kept tails outside them go (a row's spare slots become zeros, with
        scale and zero-point zero when quantized)."""
        lo, hi = min(start, self._encoded()), min(end, self._encoded())
        for kind, kept in self.kept.items():
            index = kept["index"].long()
            inside = (index >= lo) & (index < hi)  # (B, K)
            width = int(inside.sum(1).max()) if inside.numel() else 0
            order = inside.int().argsort(dim=1, descending=True, stable=True)[:, :width]  # inside ones first
            live = inside.gather(1, order)
            moved = {name: _take(t, order) for name, t in kept.items()}
            self.kept[kind] = {
                "index": torch.where(live, moved.pop("index") - lo, 0).to(torch.int32),
                "significance": moved.pop("significance").masked_fill(~live, float("-inf")),
            } | {name: t * live.view(*live.shape, *(1,) * (t.dim() - 2)) for name, t in moved.items()}
        self.offset += start
        super()._slice_tokens(start, end)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super()._map(fn)
        self.kept = {kind: {name: fn(t) for name, t in kept.items()} for kind, kept in self.kept.items()}

    def reset(self) -> None:
        super().reset()
        self.kept, self.offset = {}, 0


@CACHE_STORAGES.register
@dataclass(frozen=True)
class TaleStorage(CacheStorage):
    """TALE-style token-adaptive ranks: significant tokens keep every latent, the rest a prefix, lazily."""

    name: ClassVar[str] = "tale"
    low: float = 0.5  # share of each group's rank an ordinary token keeps (0: evict them)
    keep: float = 0.25  # share of compressed tokens kept whole, the most significant
    sink: int = 4  # the first tokens of the sequence, always kept whole
    buffer: int = 32  # tokens kept as computed until this many are cut together
    bits: int | None = None  # None: the model's dtype; 2/3/4/8: integer codes per rotated block

    def __post_init__(self) -> None:
        for field in ("low", "keep"):
            if not 0.0 <= getattr(self, field) <= 1.0:
                raise ValueError(f"tale cache {field} must be between 0 and 1, got {getattr(self, field)}")
        for field in ("sink", "buffer"):
            if getattr(self, field) < 0:
                raise ValueError(f"tale cache {field} must be ≥ 0, got {getattr(self, field)}")
        if self.bits is not None and self.bits not in INTEGER_BITS:
            raise ValueError(f"tale cache bits must be null or one of {INTEGER_BITS}, got {self.bits}")

    def check_rotation(self, rotation: str) -> None:
        """A token's level keeps a prefix of its latents, which only means a lower rank when the latents
        come in spectral order: a rotation fused into the factors mixes them."""
        if rotation != "none":
            raise ValueError(
                f"tale cache: cutting a token's latents to a prefix needs them in spectral order, but this "
                f"model's factors carry a fused rotation ({rotation!r}); convert with rotation none"
            )

    def create_store(self, ranks_k: tuple[int, ...], ranks_v: tuple[int, ...]) -> TaleStore:
        return TaleStore(ranks_k, ranks_v, self.low, self.keep, self.sink, self.buffer, self.bits)
