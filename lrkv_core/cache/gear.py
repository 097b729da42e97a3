"""The ``gear`` cache storage: quantized latents corrected by exact outliers and a low-rank residual (GEAR).

GEAR (Kang et al., 2024) makes low-bit KV quantization near-lossless by adding two cheap corrections to
the quantized tensor ``D̂``: a sparse matrix ``S`` of the entries quantization would hurt most, kept exactly,
and a low-rank approximation ``L`` of what is still left, ``X − D̂ − S``. Here it is applied to the cached
latents, per layer and kind (K or V):

1. **Outliers.** In each token's row, per quantization group, the ``outliers`` entries farthest from the
   mean of the group are kept as float16 values with their uint8 positions in the group, and replaced by
   the mean of the others before quantizing, so the group's grid spans only the remaining values.
2. **Quantization** of the filled rows, exactly as the ``quantized`` storage does (per token and group,
   asymmetric, packed codes, float16 scales and zero-points).
3. **Low-rank residual.** Over a chunk of tokens compressed together, the residual ``E = X − (D̂ + S)``
   of each latent group (n × r_g) is replaced by its best rank-``rank`` approximation ``U Vᵀ`` (truncated
   SVD; GEAR's power iteration approximates the same factors): ``U`` (n × rank) is kept per token, the
   basis ``Vᵀ`` (rank × r_g) once per chunk, both float16.

**Streaming buffer** (GEAR's n_b): new tokens stay as given until ``buffer`` of them are waiting; then all
waiting tokens in whole multiples of ``buffer`` are compressed together as one chunk (so a prompt is one
chunk but for its last tokens; decoding adds one chunk every ``buffer`` steps). ``buffer: 0`` compresses every
update as it comes (token by token when decoding: a rank-1 residual per token is exact but costs more than
it saves).

Parts, per token: the ``quantized`` storage's codes, scales and zero-points of the filled rows,
``{k,v}_outliers`` (B, S, G·outliers) float16 and ``{k,v}_positions`` uint8 (the same shape), and
``{k,v}_lowrank`` (B, S, Σ_g min(rank, r_g)) float16. Per chunk, in :attr:`GearStore.bases`: for K and V
one (min(rank, r_g), r_g) float16 basis per latent group and batch row. The cache's reported bytes are all
of these, the buffer's full-precision tokens and the positions included.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..quant import INTEGER_BITS, dequantize, group_widths, quantize
from .quantized import QuantizedStore, check_options
from .storage import CACHE_STORAGES, CacheStorage, split_groups

_HALF = torch.float16
MAX_GROUP_WIDTH = 256  # an outlier's position in its quantization group is one uint8


def split_outliers(
    x: torch.Tensor, widths: Sequence[int], n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Take the ``n`` entries farthest from their group's mean out of every quantization group of rows x.

    Returns ``(filled, values, positions)``: x (..., R) float32 with those entries replaced by the mean of the
    group's other entries (so the group's range is theirs), their values (..., G·n) as float16 and their
    positions in the group (..., G·n) uint8, group after group.
    """
    filled, values, positions = [], [], []
    for xg in torch.split(x.float(), list(widths), dim=-1):  # (..., w)
        if n == 0:
            filled.append(xg)
            continue
        far = (xg - xg.mean(-1, keepdim=True)).abs().topk(n, dim=-1).indices  # (..., n)
        vals = xg.gather(-1, far)
        rest_mean = (xg.sum(-1, keepdim=True) - vals.sum(-1, keepdim=True)) / (xg.shape[-1] - n)
        filled.append(xg.scatter(-1, far, rest_mean.expand_as(vals)))
        values.append(vals.to(_HALF))
        positions.append(far.to(torch.uint8))
    empty = x.new_zeros((*x.shape[:-1], 0))
    return (
        torch.cat(filled, dim=-1),
        torch.cat(values, dim=-1) if values else empty.to(_HALF),
        torch.cat(positions, dim=-1) if positions else empty.to(torch.uint8),
    )


def put_outliers(
    x: torch.Tensor, widths: Sequence[int], n: int, values: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Rows x (..., R) with the kept outliers (:func:`split_outliers`) written back into their groups."""
    if n == 0:
        return x
    groups = torch.split(x, list(widths), dim=-1)
    out = [
        xg.scatter(
            -1, positions[..., g * n : (g + 1) * n].long(), values[..., g * n : (g + 1) * n].to(x.dtype)
        )
        for g, xg in enumerate(groups)
    ]
    return torch.cat(out, dim=-1)


def low_rank(e: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best rank-``rank`` approximation ``u @ basis`` of e (B, n, r) over its n tokens, zero-padded to
    exactly ``min(rank, r)`` components: u (B, n, k) and basis (B, k, r), both float16."""
    k = min(rank, e.shape[-1])
    u, s, vh = torch.linalg.svd(e.float(), full_matrices=False)  # (B, n, m), (B, m), (B, m, r); m = min(n, r)
    m = min(k, s.shape[-1])
    coeffs = e.new_zeros((*e.shape[:2], k), dtype=torch.float32)
    basis = e.new_zeros((e.shape[0], k, e.shape[-1]), dtype=torch.float32)
    coeffs[..., :m] = u[..., :m] * s[:, None, :m]
    basis[:, :m] = vh[:, :m]
    return coeffs.to(_HALF), basis.to(_HALF)


def _runs(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Runs of equal consecutive sizes as (size, how many): [256, 32, 32, 32] → [(256, 1), (32, 3)]."""
    runs: list[tuple[int, int]] = []
    for n in sizes:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return runs


class GearStore(QuantizedStore):
    """Quantized latents with exact outliers and a per-chunk low-rank residual (see the module docstring).

    Parameters
    ----------
    ranks_k, ranks_v : per-group ranks of the layer.
    bits : 2, 3, 4 or 8.
    quant_group_size : width of a quantization group; None: each latent group's whole row.
    outliers : entries per token and quantization group kept exactly.
    rank : rank of the residual's approximation per latent group and chunk (0: none).
    buffer : tokens kept as given until this many wait to be compressed as one chunk (0: every update).

    Attributes
    ----------
    chunk_sizes : tokens of each compressed chunk, oldest first (they sum to the encoded tokens).
    bases : ``{"k": one (B, C, k_g, r_g) per key group, "v": ...}`` float16: the C chunks' bases, oldest
        first (k_g = min(rank, r_g)); empty before the first chunk.
    """

    def __init__(
        self,
        ranks_k: Sequence[int],
        ranks_v: Sequence[int],
        bits: int,
        quant_group_size: int | None = None,
        outliers: int = 1,
        rank: int = 2,
        buffer: int = 32,
    ) -> None:
        super().__init__(ranks_k, ranks_v, bits, quant_group_size, residual=buffer)
        self.outliers, self.rank = outliers, rank
        self.chunk_sizes: list[int] = []
        self.bases: dict[str, tuple[torch.Tensor, ...]] = {}

    def _leaving(self, waiting: int) -> int:
        """The streaming buffer: once ``buffer`` tokens wait, all whole multiples of it leave together."""
        return waiting - waiting % self.residual

    def encode(self, h_k: torch.Tensor, h_v: torch.Tensor) -> dict[str, torch.Tensor]:
        """One chunk: its per-token parts are returned, its bases appended to :attr:`bases`."""
        parts, bases = {}, {}  # bases: per kind, one (B, 1, k_g, r_g) per group
        for kind, h, ranks in (("k", h_k, self.ranks_k), ("v", h_v, self.ranks_v)):
            widths = self.widths[kind]
            filled, values, positions = split_outliers(h, widths, self.outliers)
            q = quantize(filled, widths, self.bits)
            approx = put_outliers(
                dequantize(q, widths, torch.float32), widths, self.outliers, values, positions
            )
            parts |= self._packed(kind, q)
            parts[f"{kind}_outliers"], parts[f"{kind}_positions"] = values, positions
            coeffs, bases[kind] = [], []
            if self.rank:
                for e in split_groups(h.float() - approx, ranks):  # (B, T, r_g)
                    u, basis = low_rank(e, self.rank)
                    coeffs.append(u)
                    bases[kind].append(basis.unsqueeze(1))
            parts[f"{kind}_lowrank"] = (
                torch.cat(coeffs, dim=-1) if coeffs else h.new_zeros((*h.shape[:2], 0), dtype=_HALF)
            )
        self.chunk_sizes.append(h_k.shape[1])
        for kind, chunk in bases.items() if self.rank else ():
            old = self.bases.get(kind)
            self.bases[kind] = (
                tuple(chunk) if old is None else tuple(torch.cat([o, n], dim=1) for o, n in zip(old, chunk))
            )
        return parts

    def _latents(self, parts: Mapping[str, torch.Tensor], kind: str) -> torch.Tensor:
        x = put_outliers(
            self._dequantized(parts, kind, torch.float32),
            self.widths[kind],
            self.outliers,
            parts[f"{kind}_outliers"],
            parts[f"{kind}_positions"],
        )
        if self.rank:
            ranks = self.ranks_k if kind == "k" else self.ranks_v
            x = x + self._residual(parts[f"{kind}_lowrank"], kind, ranks)
        return x.to(self.dtype)

    def _residual(self, coeffs: torch.Tensor, kind: str, ranks: Sequence[int]) -> torch.Tensor:
        """The low-rank residual (B, S_e, R) of every chunk: per group, tokens' coefficients × their chunk's
        basis, one batched product per run of equal-sized chunks (decoding makes them all ``buffer`` long)."""
        ks = [min(self.rank, r) for r in ranks]
        runs, start, first = [], 0, 0
        for n, chunks in _runs(self.chunk_sizes):
            u = coeffs[:, start : start + n * chunks].float().unflatten(1, (chunks, n))  # (B, c, n, K)
            runs.append(
                torch.cat(
                    [
                        ug @ b[:, first : first + chunks].float()
                        for ug, b in zip(u.split(ks, -1), self.bases[kind])
                    ],
                    dim=-1,
                ).flatten(1, 2)
            )  # (B, c·n, R)
            start, first = start + n * chunks, first + chunks
        return torch.cat(runs, dim=1)

    def _slice_tokens(self, start: int, end: int) -> None:
        """Keep tokens ``start..end-1``; chunks left without tokens drop their bases."""
        n_enc = self._encoded()
        lo, hi = min(start, n_enc), min(end, n_enc)
        sizes, kept_chunks, offset = [], [], 0
        for c, n in enumerate(self.chunk_sizes):
            kept = min(offset + n, hi) - max(offset, lo)
            if kept > 0:
                sizes.append(kept)
                kept_chunks.append(c)
            offset += n
        if kept_chunks != list(range(len(self.chunk_sizes))):
            keep = torch.tensor(kept_chunks, dtype=torch.long)
            self.bases = {
                kind: tuple(b.index_select(1, keep.to(b.device)) for b in group_bases)
                for kind, group_bases in self.bases.items()
            } if kept_chunks else {}  # fmt: skip
        self.chunk_sizes = sizes
        super()._slice_tokens(start, end)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super()._map(fn)
        self.bases = {kind: tuple(fn(b) for b in bs) for kind, bs in self.bases.items()}

    def reset(self) -> None:
        super().reset()
        self.chunk_sizes, self.bases = [], {}


@CACHE_STORAGES.register
@dataclass(frozen=True)
class GearStorage(CacheStorage):
    """GEAR: 2/3/4/8-bit latents + exact outliers + a low-rank residual per chunk, with a streaming buffer."""

    name: ClassVar[str] = "gear"
    bits: int = 4
    quant_group_size: int | None = None  # None: one quantization group per latent group row
    outliers: int = 1  # entries per token and quantization group kept exactly
    rank: int = 2  # rank of the residual's approximation per latent group and chunk
    buffer: int = 32  # tokens kept as given until this many are compressed together (GEAR's n_b)

    def __post_init__(self) -> None:
        check_options(self, INTEGER_BITS, "outliers", "rank", "buffer")

    def check_ranks(self, ranks: Sequence[int]) -> None:
        """The quantization group size must divide every rank, and every quantization group must hold more
        entries than the outliers taken from it (and at most 256, for uint8 positions)."""
        widths = group_widths(ranks, self.quant_group_size)
        if self.outliers and min(widths) <= self.outliers:
            raise ValueError(
                f"gear cache: {self.outliers} outlier(s) per quantization group leave nothing to quantize in "
                f"a group of {min(widths)} latents"
            )
        if self.outliers and max(widths) > MAX_GROUP_WIDTH:
            raise ValueError(
                f"gear cache: outlier positions are uint8, so quantization groups hold at most "
                f"{MAX_GROUP_WIDTH} latents (got {max(widths)}; set quant_group_size)"
            )

    def create_store(self, ranks_k: tuple[int, ...], ranks_v: tuple[int, ...]) -> GearStore:
        self.check_ranks(ranks_k + ranks_v)
        return GearStore(
            ranks_k, ranks_v, self.bits, self.quant_group_size, self.outliers, self.rank, self.buffer
        )
