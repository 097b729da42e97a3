"""The ``tale`` cache storage: token-adaptive ranks, each token's latents cut to a prefix by its level.

TALE (Lee et al., TACL 2025) keeps the attention sinks and the most recent tokens at a high rank and the
middle tokens at a low one (§2.2.1), approximates lazily while decoding (§2.2.2: the newest tokens are read
as computed until a buffer of them is cut; a prefill's whole buffers are cut before attention reads them,
where TALE attends on the uncut ones) and gives each level its own bit width (§2.3). lrkv's latents are
already prefixes of an ordered spectrum (whitened SVD, plain SVD and PCA order their bases by energy), so
cutting one token to rank l is keeping its first l latents and padding the rest with zeros, exactly as a
plan of rank l would give (TALE's "online low-rank approximation": a truncation).
Here, per layer and kind (K or V), with two levels:

1. **The low level**: a token keeps the first ``⌊low · r_g⌋`` latents of every group (TALE's r_0; ``low: 0``
   keeps nothing of them: their keys and values read as zeros, which attention still weighs with a score
   of 0, so it is not eviction, which would take them out of the softmax). ``value_low`` gives the values
   their own share (keys keep ``low``): value latents need the wider level, keys the narrower one, at the
   same bytes (SmolLM2, docs/long-context.md).
2. **The full level**: a token keeps every latent (TALE's r_1: the plan's rank). Which tokens, by ``rule``:

   - ``recency`` (TALE's rule, the default): the first ``sink`` tokens of the sequence (TALE's α) and the
     newest ``⌊keep · (S − α)⌋`` of the S cut tokens (TALE's p, "the ratio of higher rank r_1 tokens does
     not exceed a threshold ratio p"). A new token enters at the full level; when the share would pass
     ``keep``, the oldest full-level tokens move down to the low level (their tails are dropped).
   - ``energy`` (lrkv's variant): the sinks and the ``round(keep · (S − α))`` cut tokens whose tails hold
     the most energy, ``Σ_g ‖h_g[l_g:]‖²`` (the truncation error in latent coordinates), re-ranked over the
     whole cache each time tokens come in.

   ``recent`` (a count, in place of the share ``keep``) holds ``min(recent, S − α)`` cut tokens besides the
   sinks at the full level, however long the sequence: a fixed window of whole tokens, as a sliding-window
   cache keeps, with the bytes per token falling towards the low level's as the context grows.

   Both keep the full-level tokens as one ranked set, :attr:`TaleStore.kept`; recency ranks by the
   sequence position, so the same re-ranking moves the oldest down.
3. **Lazy buffer**: new tokens stay as computed until ``buffer`` of them wait; then all waiting tokens in
   whole multiples of ``buffer`` are cut together (TALE's batched moves, Appendix A; ``buffer: 0`` cuts every
   update as it comes). The buffer is not counted in the share.

**Bits per level** (``low_bits``, ``full_bits``: null for the model's dtype, or 2, 3, 4, 8; TALE's b_0 ≤ b_1):
a block of latents is rotated by an orthogonal matrix of its own width (:func:`block_rotation`), then
quantized per token and block (:mod:`lrkv_core.quant`: packed codes, float16 scale and zero-point).
Every token's low level is stored at ``low_bits`` (blocks: each group's first l_g latents). A full-level
token adds, when both levels have the same bits, only its tail (blocks: each group's r_g − l_g last latents;
its head is the low level's); otherwise its whole latents at ``full_bits`` (blocks: each group), which is
what attention reads for it. ``bits`` is the form recorded before per-level bits: both levels at once.
Ranking reads the exact tails.

Parts, per token: ``k_low_latents`` (B, S, Σ_g l_g) and ``v_low_latents`` (or ``…_codes``, ``…_scale``,
``…_zero``). Across tokens, in :attr:`TaleStore.kept`: per kind, the full-level tokens' ``tail_*`` (B, K, Σ_g
(r_g − l_g)) or ``whole_*`` (B, K, Σ_g r_g), their indices among the cut tokens (B, K) int32 and their rank
key (B, K) float32 (energy, or sequence position). K is the same for every batch row; after a crop or a
sliding window a row may hold fewer of them than another, and its spare slots hold zeros with key −inf
(they add nothing and are the first to go). The cache's reported bytes are all of these, the buffer's tokens
and the positions included.

The view gives attention every group at its full rank r_g (zeros past a token's level), so attention
costs what the dense cache's does; only memory shrinks. Keys are rebuilt from their latents and then
rotated (RoPE), as for every storage: TALE's reconstruction-free keys keep keys out of the low-rank
approximation altogether, which a converted model's key latents cannot undo (docs/tale-cache.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ..quant import INTEGER_BITS, QuantizedRows, dequantize, pack_codes, quantize, unpack_codes
from ..quant.rotation import rotation_matrix
from .storage import CACHE_STORAGES, CacheStorage, LatentStore, split_groups

RULES = ("recency", "energy")
DEFAULT_KEEP = 0.1  # TALE's p: the share of the cut tokens at the full level


def low_ranks(ranks: Sequence[int], low: float) -> tuple[int, ...]:
    """Latents kept per group by a low-level token: ``⌊low · r_g⌋`` (never more than ``low`` of them)."""
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
    normalised Hadamard matrix of order w where :mod:`lrkv_core.quant.rotation` builds one, else a random
    orthogonal one seeded by w. A constant of the widths, like the code (so no cache holds or counts it);
    built once per device, not copied at every step."""
    if torch.device(device).type != "cpu":
        return block_rotation(widths).to(device)
    return torch.block_diag(*(rotation_matrix(w, "auto", seed=w)[0] for w in widths)).float()


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``t[b, index[b, k]]`` of t (B, N, ...) for index (B, K): (B, K, ...)."""
    return t.gather(1, index.view(*index.shape, *(1,) * (t.dim() - 2)).expand(*index.shape, *t.shape[2:]))


class TaleStore(LatentStore):
    """Latents cut to a per-token level: full-level tokens whole, the others to a prefix (module docstring).

    Parameters
    ----------
    ranks_k, ranks_v : per-group ranks of the layer.
    low : share of each group's rank a low-level token keeps (0 ≤ low ≤ 1; TALE's r_0 / r_1).
    value_low : the values' share, when it differs from the keys' (None: ``low`` for both).
    keep : share of the cut tokens (sinks aside) at the full level (0 ≤ keep ≤ 1; TALE's p).
    recent : None, or how many cut tokens (sinks aside) are at the full level, in place of ``keep``
        (:attr:`count`; the base class's ``recent`` is its window of tokens not yet cut).
    sink : the first ``sink`` tokens of the sequence are always at the full level (TALE's α).
    buffer : tokens kept as computed until this many wait to be cut together (0: every update).
    low_bits, full_bits : None to keep a level in the model's dtype; 2, 3, 4 or 8 to keep it as packed
        integer codes, per token and block, each block rotated first (:func:`block_rotation`).
    rule : ``"recency"`` (the sinks and the newest tokens) or ``"energy"`` (the sinks and the tokens whose
        tails hold the most energy).

    Attributes
    ----------
    lows : ``{"k": (l_g per key group), "v": ...}``, the ranks of the low level.
    kept : ``{"k": {"index": (B, K) int32, "significance": (B, K) float32, "tail_*" or "whole_*": the
        latents (B, K, ...) as stored}, "v": ...}``: the full-level tokens (empty before the first cut).
    offset : how many tokens of the sequence were dropped before the first one held (a sliding window);
        token i of the store is token ``offset + i`` of the sequence.
    """

    def __init__(
        self,
        ranks_k: Sequence[int],
        ranks_v: Sequence[int],
        low: float = 0.5,
        keep: float = DEFAULT_KEEP,
        sink: int = 4,
        buffer: int = 32,
        low_bits: int | None = None,
        full_bits: int | None = None,
        rule: str = "recency",
        recent: int | None = None,
        value_low: float | None = None,
    ) -> None:
        super().__init__(ranks_k, ranks_v, residual=buffer)
        self.low, self.keep, self.sink, self.rule, self.count = low, keep, sink, rule, recent
        self.low_bits, self.full_bits = low_bits, full_bits
        self.lows = {
            "k": low_ranks(self.ranks_k, low),
            "v": low_ranks(self.ranks_v, low if value_low is None else value_low),
        }
        self.kept: dict[str, dict[str, torch.Tensor]] = {}
        self.offset = 0

    @property
    def shares_head(self) -> bool:
        """Whether a full-level token's head is its low level's (both levels at the same bits): the full
        level then stores only tails."""
        return self.low_bits == self.full_bits

    def _leaving(self, waiting: int) -> int:
        """The lazy buffer: once ``buffer`` tokens wait, all whole multiples of it are cut together."""
        return waiting - waiting % self.residual

    def significance(self, tail: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Rank key (B, T) float32 of new tokens, the highest at the full level: their sequence positions
        (B, T) under ``recency``; under ``energy``, the energy the low level would drop from their tails
        (B, T, Σ (r_g − l_g)), ``‖tail‖²``."""
        if self.rule == "recency":
            return position.float().expand(tail.shape[:2])
        return tail.float().pow(2).sum(-1)

    def _ranks(self, kind: str) -> tuple[int, ...]:
        return self.ranks_k if kind == "k" else self.ranks_v

    def _whole(self, n_encoded: int) -> int:
        """How many of ``n_encoded`` cut tokens are at the full level: the sinks among them and ``recent`` of
        the others, or the share ``keep`` of them (recency: at most that share, ⌊·⌋; energy: rounded)."""
        sinks = max(0, min(self.sink, self.offset + n_encoded) - self.offset)
        if self.count is not None:
            return min(n_encoded, self.count + sinks)
        share = self.keep * (n_encoded - sinks)
        return min(n_encoded, int(share + (1e-9 if self.rule == "recency" else 0.5)) + sinks)

    def _stored(self, x: torch.Tensor, widths: Sequence[int], bits: int | None) -> dict[str, torch.Tensor]:
        """Latents x (B, T, Σ w) as kept: ``latents`` as given, or each block of width w rotated and quantized
        (``codes`` packed (B, T, ⌈Σ w · b / 8⌉) uint8, ``scale`` and ``zero`` (B, T, blocks) float16)."""
        blocks = tuple(w for w in widths if w)
        if bits is None or not blocks:
            return {"latents": x}
        q = quantize(x.float() @ block_rotation(blocks, x.device), blocks, bits)
        return {"codes": pack_codes(q.codes, bits, check=False), "scale": q.scale, "zero": q.zero}

    def _read(
        self, stored: Mapping[str, torch.Tensor], widths: Sequence[int], bits: int | None
    ) -> torch.Tensor:
        """The latents (B, N, Σ w) in the model's dtype from what :meth:`_stored` kept."""
        if "latents" in stored:
            return stored["latents"]
        blocks = tuple(w for w in widths if w)
        codes = unpack_codes(stored["codes"], bits, sum(blocks))
        x = dequantize(QuantizedRows(codes, stored["scale"], stored["zero"]), blocks, torch.float32)
        return (x @ block_rotation(blocks, x.device).T).to(self.dtype)

    def _full_widths(self, kind: str) -> tuple[str, tuple[int, ...]]:
        """What the full level stores per token: ``("tail", r_g − l_g per group)`` when it shares the low
        level's head, else ``("whole", r_g per group)``."""
        ranks = self._ranks(kind)
        if self.shares_head:
            return "tail", tuple(r - lo for r, lo in zip(ranks, self.lows[kind]))
        return "whole", ranks

    def encode(self, h_k: torch.Tensor, h_v: torch.Tensor) -> dict[str, torch.Tensor]:
        """Cut new tokens to the low level; rank the cache's full-level tokens with them (:attr:`kept`)."""
        before = self._encoded()
        B, T = h_k.shape[:2]
        new = torch.arange(before, before + T, device=h_k.device, dtype=torch.int32).expand(B, T)
        whole = self._whole(before + T)
        parts = {}
        for kind, h in (("k", h_k), ("v", h_v)):
            head, tail = cut(h, self._ranks(kind), self.lows[kind])  # (B, T, Σ l_g), (B, T, Σ (r_g − l_g))
            parts |= {
                f"{kind}_low_{n}": t for n, t in self._stored(head, self.lows[kind], self.low_bits).items()
            }
            key = self.significance(tail, self.offset + new)
            key = key.masked_fill(self.offset + new < self.sink, float("inf"))
            what, widths = self._full_widths(kind)
            full = tail if what == "tail" else h
            candidates = {f"{what}_{n}": t for n, t in self._stored(full, widths, self.full_bits).items()}
            candidates |= {"index": new, "significance": key}
            old = self.kept.get(kind)
            if old is not None:  # candidates: the full-level tokens so far, then the new ones
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
            low = {n[len(prefix) :]: t for n, t in parts.items() if n.startswith(prefix)}
            head = self._read(low, lows, self.low_bits)  # (B, S_e, Σ l_g)
            what, widths = self._full_widths(kind)
            stored = {n[len(what) + 1 :]: t for n, t in kept.items() if n.startswith(what + "_")}
            full = self._read(stored, widths, self.full_bits).to(head.dtype)  # (B, K, Σ w)
            index = kept["index"].long().unsqueeze(-1).expand_as(full)
            if what == "tail":
                tails = head.new_zeros((*head.shape[:2], full.shape[-1]))  # (B, S_e, Σ (r_g − l_g))
                # adding onto zeros is exact; spare slots add zeros wherever they point
                tails.scatter_add_(1, index, full)
                out.append(join(head, tails, ranks, lows))
                continue
            S = head.shape[1]
            rows = torch.cat(
                join(head, head.new_zeros((*head.shape[:2], sum(ranks) - head.shape[-1])), ranks, lows), -1
            )
            live = (kept["significance"] > float("-inf")).unsqueeze(-1)  # spare slots write past the end
            rows = torch.cat([rows, rows.new_zeros(rows.shape[0], 1, rows.shape[-1])], dim=1)
            rows = rows.scatter(1, torch.where(live, index, S), full)[:, :S]  # (B, S_e, Σ r_g)
            out.append(split_groups(rows, ranks))
        return out[0], out[1]

    def _slice_tokens(self, start: int, end: int) -> None:
        """Keep tokens ``start..end-1``; full-level latents outside them go (a row's spare slots become
        zeros, with scale and zero-point zero when quantized)."""
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
    """TALE's token-adaptive ranks: sinks and recent (or energetic) tokens whole, the rest a prefix."""

    name: ClassVar[str] = "tale"
    store: ClassVar[type[TaleStore]] = TaleStore  # what create_store builds
    rule: Literal["recency", "energy"] = "recency"  # which tokens are at the full level (module docstring)
    low: float = 0.5  # share of each group's rank a low-level token keeps (TALE's r_0: 50 %; 0: zeros)
    value_low: float | None = None  # the values' share when it differs from the keys' (None: low)
    keep: float | None = None  # share of the cut tokens at the full level, sinks aside (TALE's p; None: 0.1)
    recent: int | None = None  # or a count of them, the newest (or most energetic), in place of keep
    sink: int = 4  # the first tokens of the sequence, always at the full level (TALE's α)
    buffer: int = 32  # tokens kept as computed until this many are cut together
    low_bits: int | None = None  # the low level: None, the model's dtype; 2/3/4/8: codes per rotated block
    full_bits: int | None = None  # the full level, likewise (TALE's quantized setting: low 2, full 4)
    bits: int | None = None  # both levels at once: the form recorded before per-level bits

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"tale cache rule must be one of {RULES}, got {self.rule!r}")
        for field in ("low", "value_low", "keep"):
            if getattr(self, field) is not None and not 0.0 <= getattr(self, field) <= 1.0:
                raise ValueError(f"tale cache {field} must be between 0 and 1, got {getattr(self, field)}")
        if self.recent is not None and self.keep is not None:
            raise ValueError(
                "tale cache: give keep (a share of the cut tokens) or recent (a count), never both"
            )
        for field in ("sink", "buffer", "recent"):
            if getattr(self, field) is not None and getattr(self, field) < 0:
                raise ValueError(f"tale cache {field} must be ≥ 0, got {getattr(self, field)}")
        for field in ("bits", "low_bits", "full_bits"):
            if getattr(self, field) is not None and getattr(self, field) not in INTEGER_BITS:
                raise ValueError(
                    f"tale cache {field} must be null or one of {INTEGER_BITS}, got {getattr(self, field)}"
                )
        if self.bits is not None and (self.low_bits, self.full_bits) != (None, None):
            raise ValueError("tale cache: give bits (both levels) or low_bits/full_bits, not both")
        low, full = self.level_bits
        if (full is not None and low is None) or (low is not None and full is not None and low > full):
            raise ValueError(
                f"tale cache: the full level keeps at least the low level's precision (TALE's b_0 ≤ b_1), "
                f"got low_bits {low}, full_bits {full}"
            )

    @property
    def share(self) -> float | None:
        """The share of the cut tokens at the full level, sinks aside; None when ``recent`` counts them."""
        if self.recent is not None:
            return None
        return DEFAULT_KEEP if self.keep is None else self.keep

    @property
    def level_bits(self) -> tuple[int | None, int | None]:
        """The low level's and the full level's bits (None: the model's dtype), ``bits`` applied."""
        if self.bits is not None:
            return self.bits, self.bits
        return self.low_bits, self.full_bits

    def check_rotation(self, rotation: str) -> None:
        """A token's level keeps a prefix of its latents, which only means a lower rank when the latents
        come in spectral order: a rotation fused into the factors mixes them."""
        if rotation != "none":
            raise ValueError(
                f"tale cache: cutting a token's latents to a prefix needs them in spectral order, but this "
                f"model's factors carry a fused rotation ({rotation!r}); convert with rotation none"
            )

    def create_store(self, ranks_k: tuple[int, ...], ranks_v: tuple[int, ...]) -> TaleStore:
        low_bits, full_bits = self.level_bits
        return self.store(
            ranks_k,
            ranks_v,
            self.low,
            self.share or 0.0,
            self.sink,
            self.buffer,
            low_bits,
            full_bits,
            self.rule,
            self.recent,
            self.value_low,
        )
