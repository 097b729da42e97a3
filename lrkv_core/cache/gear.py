"""The ``gear`` cache storage: quantized latents corrected by exact outliers and a low-rank residual (GEAR).

GEAR (Kang et al., 2024, §3) makes low-bit KV quantization near-lossless by adding two cheap corrections to
the quantized tensor ``D̂``: a sparse matrix ``S`` of outlier entries kept exactly, and a low-rank
approximation ``L`` of what is still left, ``X − D̂ − S``. Here ``X`` is one layer's cached latents of one kind
(K or V), (n tokens × R latents) per batch row (the paper compresses "batch-wise"):

1. **Outliers** (Eq. 4, ``outlier_share`` s, default 2 %): the ⌊s/2 · n·R⌋ largest and as many smallest
   entries of the whole matrix X are kept in float16 with their int32 flat positions (token · R + column).
   Before quantizing, each is replaced by the mean of the other entries of its token's quantization group,
   so the group's grid spans only the rest (the paper quantizes ``X − S``, i.e. puts zeros there; the value
   at an outlier's place is overwritten by ``S`` either way, only the grid's range differs).
   lrkv's variant, ``outliers: N``: the N entries farthest from their group's mean in every token's row and
   quantization group, kept per token with uint8 positions in the group.
2. **Quantization** of the filled rows, exactly as the ``quantized`` storage does (per token and group,
   asymmetric, packed codes, float16 scales and zero-points; the paper's appendix D.2 group variant).
3. **Low-rank residual** (Eq. 6): per latent group, the residual ``E = X − (D̂ + S)`` (n × r_g) is replaced by
   a rank-``rank`` factorization ``A Bᵀ``: ``A`` (n × rank) kept per token, ``Bᵀ`` (rank × r_g) once per
   compressed segment, both float16. ``rank_share: ρ`` is the paper's rule for the rank (§4, "Implementation
   details"): ``max(1, ⌊ρ · min(n, r_g)⌋)`` for each segment of n tokens, stored zero-padded to the most it
   can be, ``max(1, ⌊ρ · r_g⌋)``. ``solver: power`` is the paper's power iteration (appendix A,
   Algorithm 2, ``iterations`` loops from a seeded random start, so deterministic); ``solver: svd`` is the
   exact truncated SVD (the best rank-``rank`` fit, Eckart–Young).

**Streaming** (§3, Algorithm 1; ``buffer`` is n_b, default 20). ``mode: whole``, the paper's rule: the first
update (the prompt) is compressed at once; new tokens then wait, as given, in the buffer; once ``buffer`` of
them wait, they are appended to the cache's reconstruction ``D̂ + L + S`` and the whole cache is compressed
again (outliers, quantization and low-rank residual of all its tokens, one basis). ``mode: chunked``, lrkv's
variant: once ``buffer`` tokens wait, the waiting tokens in whole multiples of ``buffer`` are compressed as
a new chunk with its own basis and outliers; older chunks are never touched. ``buffer: 0`` compresses every
update as it comes.

Parts, per token: the ``quantized`` storage's codes, scales and zero-points of the filled rows,
``{k,v}_lowrank`` (B, S, Σ_g k_g) float16 (k_g = min(rank, r_g), or ``max(1, ⌊ρ · r_g⌋)``) and, with
``outliers: N``, ``{k,v}_outliers`` (B, S, G·N) float16 and ``{k,v}_positions`` uint8. Per batch row, in
:attr:`GearStore.sparse`: the share's outliers ``{k,v}_values`` (B, K) float16 and ``{k,v}_index`` (B, K)
int32 (−1: an empty slot, left by a crop). Per segment (the whole cache, or each chunk), in
:attr:`GearStore.bases`: one (k_g, r_g) float16 basis per latent group and batch row. The cache's reported
bytes are all of these, the buffer's full-precision tokens and the positions included, measured from the
tensors at every step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..quant import INTEGER_BITS, dequantize, group_widths, quantize
from .quantized import QuantizedStore, check_options
from .storage import CACHE_STORAGES, CacheStorage, split_groups, unrotated_codes_warning

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


def split_share(
    x: torch.Tensor, widths: Sequence[int], share: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GEAR's ``Filter_s`` (Eq. 4): per batch row, the ⌊share/2 · n·R⌋ largest and as many smallest entries of
    the whole matrix x (B, n, R).

    Returns ``(filled, values, index)``: x float32 with each outlier replaced by the mean of the other
    entries of its token's quantization group (0 if it has none), the outliers' values (B, K) float16 and
    their flat positions ``token · R + column`` (B, K) int32, ascending (K = 2·⌊share/2 · n·R⌋).
    """
    x = x.float()
    B, n, R = x.shape
    k = int(share * n * R / 2 + 1e-9)  # per side; 2k ≤ n·R since share ≤ 1
    if k == 0:
        return x, x.new_zeros((B, 0), dtype=_HALF), x.new_zeros((B, 0), dtype=torch.int32)
    flat = x.reshape(B, n * R)
    order = flat.argsort(dim=-1, stable=True)  # ascending values; ties keep the lower position first
    index = torch.cat([order[:, :k], order[:, -k:]], dim=-1).sort(dim=-1).values  # (B, 2k)
    mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, index, True).reshape(B, n, R)
    filled = []
    for xg, mg in zip(torch.split(x, list(widths), dim=-1), torch.split(mask, list(widths), dim=-1)):
        rest = (~mg).sum(-1, keepdim=True)  # (B, n, 1)
        mean = (xg * ~mg).sum(-1, keepdim=True) / rest.clamp_min(1)
        filled.append(torch.where(mg, mean.expand_as(xg), xg))
    return torch.cat(filled, dim=-1), flat.gather(1, index).to(_HALF), index.to(torch.int32)


def put_share(x: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, n, R) with the outliers of :func:`split_share` written back (flat index (B, K); −1: empty)."""
    B, n, R = x.shape
    if index.shape[-1] == 0:
        return x
    flat = torch.cat([x.reshape(B, n * R), x.new_zeros((B, 1))], dim=-1)  # the last column: empty slots
    slot = torch.where(index >= 0, index.long(), n * R)
    return flat.scatter(1, slot, values.to(x.dtype))[:, : n * R].reshape(B, n, R)


def _padded(a: torch.Tensor, b: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Coefficients a (B, n, m) and basis b (B, m, r) zero-padded to k ≥ m components, as float16."""
    coeffs = a.new_zeros((*a.shape[:2], k))
    basis = b.new_zeros((b.shape[0], k, b.shape[-1]))
    coeffs[..., : a.shape[-1]], basis[:, : b.shape[1]] = a, b
    return coeffs.to(_HALF), basis.to(_HALF)


def low_rank(e: torch.Tensor, rank: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The best rank-``rank`` approximation ``u @ basis`` of e (B, n, r) over its n tokens (truncated SVD),
    zero-padded to exactly ``width`` components (default ``min(rank, r)``): u (B, n, k) and basis (B, k, r),
    both float16."""
    k = min(rank, e.shape[-1]) if width is None else width
    u, s, vh = torch.linalg.svd(e.float(), full_matrices=False)  # (B, n, m), (B, m), (B, m, r); m = min(n, r)
    m = min(rank, k, s.shape[-1])
    return _padded(u[..., :m] * s[:, None, :m], vh[:, :m], k)


def power_iteration(
    e: torch.Tensor, rank: int, iterations: int, seed: int = 0, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """GEAR's ``SVDSolver_r`` (appendix A, Algorithm 2): a rank-``rank`` fit ``A Bᵀ`` of e (B, n, r) by power
    iteration from a random B drawn with ``seed`` (so the same e always gives the same factors).

    Each loop computes ``A = E B`` then ``B = Eᵀ A``; the last loop first orthonormalizes B, then A (QR), so
    ``A Bᵀ = A Aᵀ E`` projects E onto the subspace found. Returns u = A (B, n, k) and basis = Bᵀ (B, k, r),
    float16, zero-padded to ``width`` components, by default k = min(rank, r) (a segment of n < k tokens has
    rank ≤ n).
    """
    e = e.float()
    k = min(rank, e.shape[-1]) if width is None else width
    m = min(rank, k, e.shape[1])
    gen = torch.Generator(device=e.device).manual_seed(seed)
    b = torch.randn(e.shape[-1], m, generator=gen, device=e.device).expand(e.shape[0], -1, -1)  # (B, r, m)
    for loop in range(iterations):
        last = loop == iterations - 1
        if last:
            b = torch.linalg.qr(b).Q
        a = e @ b  # (B, n, m)
        if last:
            a = torch.linalg.qr(a).Q
        b = e.mT @ a  # (B, r, m)
    return _padded(a, b.mT, k)


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
    """Quantized latents with exact outliers and a low-rank residual, streamed (see the module docstring).

    Parameters
    ----------
    ranks_k, ranks_v : per-group ranks of the layer.
    bits : 2, 3, 4 or 8.
    quant_group_size : width of a quantization group; None: each latent group's whole row.
    outlier_share : share s of each segment's entries kept exactly, s/2 largest and s/2 smallest (Eq. 4).
    outliers : if given, this many entries per token and quantization group instead (lrkv's variant).
    rank : rank of the residual's approximation per latent group and segment (0: none).
    rank_share : if given, the rank is GEAR's ``max(1, ⌊ρ · min(n, r_g)⌋)`` per segment of n tokens instead.
    solver : ``"power"`` (Algorithm 2, ``iterations`` loops) or ``"svd"`` (exact truncated SVD).
    mode : ``"whole"`` (Algorithm 1: the buffer is appended and the whole cache compressed again) or
        ``"chunked"`` (each full buffer is compressed alone, as a new chunk).
    buffer : tokens kept as given until this many wait to be compressed (GEAR's n_b; 0: every update).

    Attributes
    ----------
    chunk_sizes : tokens of each compressed segment, oldest first (one segment in ``whole`` mode).
    bases : ``{"k": one (B, C, k_g, r_g) per key group, "v": ...}`` float16: the C segments' bases, oldest
        first (k_g = min(rank, r_g)); empty before the first segment.
    sparse : ``{"k_values": (B, K) float16, "k_index": (B, K) int32, "v_...": ...}``: the share's outliers of
        every encoded token, flat positions ``token · R + column`` over the encoded tokens (−1: empty).
    """

    def __init__(
        self,
        ranks_k: Sequence[int],
        ranks_v: Sequence[int],
        bits: int,
        quant_group_size: int | None = None,
        outlier_share: float = 0.02,
        outliers: int | None = None,
        rank: int = 2,
        solver: str = "power",
        iterations: int = 3,
        mode: str = "whole",
        buffer: int = 20,
        rank_share: float | None = None,
    ) -> None:
        super().__init__(ranks_k, ranks_v, bits, quant_group_size, residual=buffer)
        self.outlier_share, self.outliers, self.rank = outlier_share, outliers, rank
        self.rank_share = rank_share
        self.has_lowrank = rank_share is not None or rank > 0
        self.solver, self.iterations, self.mode = solver, iterations, mode
        self.chunk_sizes: list[int] = []
        self.bases: dict[str, tuple[torch.Tensor, ...]] = {}
        self.sparse: dict[str, torch.Tensor] = {}

    def lowrank_width(self, r_g: int) -> int:
        """Components stored per token and segment for a latent group of width r_g (k_g)."""
        if self.rank_share is None:
            return min(self.rank, r_g)
        return max(1, int(self.rank_share * r_g + 1e-9))

    def segment_rank(self, n: int, r_g: int) -> int:
        """The residual's rank in a segment of n tokens of a latent group of width r_g."""
        if self.rank_share is None:
            return self.rank
        return max(1, int(self.rank_share * min(n, r_g) + 1e-9))

    def _leaving(self, waiting: int) -> int:
        """The streaming buffer. ``whole``: the first update all at once, then the buffer once it is full;
        ``chunked``: once ``buffer`` tokens wait, all whole multiples of it leave together."""
        if self.mode == "whole":
            return waiting if not self._encoded() or waiting >= self.residual else 0
        return waiting - waiting % self.residual

    def _append_encoded(self, h_k: torch.Tensor, h_v: torch.Tensor) -> None:
        """``whole`` mode: the leaving tokens are appended to the reconstruction of the encoded ones and all
        are compressed again, as one segment (Algorithm 1, lines 4–9)."""
        if self.mode == "whole" and self._encoded():
            h_k = torch.cat([self._reconstructed(self.parts, "k"), h_k.float()], dim=1)  # (B, S_e + T, R_k)
            h_v = torch.cat([self._reconstructed(self.parts, "v"), h_v.float()], dim=1)
            self.parts, self.chunk_sizes, self.bases, self.sparse = {}, [], {}, {}
        super()._append_encoded(h_k, h_v)

    def encode(self, h_k: torch.Tensor, h_v: torch.Tensor) -> dict[str, torch.Tensor]:
        """One segment: its per-token parts are returned, its bases and outliers appended to :attr:`bases`
        and :attr:`sparse`."""
        parts, bases, sparse = {}, {}, {}  # bases: per kind, one (B, 1, k_g, r_g) per group
        offset = self._encoded()  # the segment's first token, for the outliers' flat positions
        for kind, h, ranks in (("k", h_k, self.ranks_k), ("v", h_v, self.ranks_v)):
            widths = self.widths[kind]
            if self.outliers is None:
                filled, values, index = split_share(h, widths, self.outlier_share)
                q = quantize(filled, widths, self.bits)
                approx = put_share(dequantize(q, widths, torch.float32), values, index)
                sparse[f"{kind}_values"], sparse[f"{kind}_index"] = values, index + offset * h.shape[-1]
            else:
                filled, values, positions = split_outliers(h, widths, self.outliers)
                q = quantize(filled, widths, self.bits)
                approx = put_outliers(
                    dequantize(q, widths, torch.float32), widths, self.outliers, values, positions
                )
                parts[f"{kind}_outliers"], parts[f"{kind}_positions"] = values, positions
            parts |= self._packed(kind, q)
            coeffs, bases[kind] = [], []
            if self.has_lowrank:
                for e in split_groups(h.float() - approx, ranks):  # (B, T, r_g)
                    r_g = e.shape[-1]
                    rank, width = self.segment_rank(e.shape[1], r_g), self.lowrank_width(r_g)
                    if self.solver == "power":
                        u, basis = power_iteration(e, rank, self.iterations, width=width)
                    else:
                        u, basis = low_rank(e, rank, width)
                    coeffs.append(u)
                    bases[kind].append(basis.unsqueeze(1))
            parts[f"{kind}_lowrank"] = (
                torch.cat(coeffs, dim=-1) if coeffs else h.new_zeros((*h.shape[:2], 0), dtype=_HALF)
            )
        self.chunk_sizes.append(h_k.shape[1])
        for kind, chunk in bases.items() if self.has_lowrank else ():
            old = self.bases.get(kind)
            self.bases[kind] = (
                tuple(chunk) if old is None else tuple(torch.cat([o, n], dim=1) for o, n in zip(old, chunk))
            )
        self.sparse = {
            name: torch.cat([self.sparse[name], t], dim=1) if self.sparse else t for name, t in sparse.items()
        }
        return parts

    def _reconstructed(self, parts: Mapping[str, torch.Tensor], kind: str) -> torch.Tensor:
        """``D̂ + S + L`` of the encoded tokens of ``kind``: (B, S_e, R) float32."""
        x = self._dequantized(parts, kind, torch.float32)
        if self.outliers is None:
            x = put_share(x, self.sparse[f"{kind}_values"], self.sparse[f"{kind}_index"])
        else:
            x = put_outliers(
                x, self.widths[kind], self.outliers, parts[f"{kind}_outliers"], parts[f"{kind}_positions"]
            )
        if self.has_lowrank:
            ranks = self.ranks_k if kind == "k" else self.ranks_v
            x = x + self._residual(parts[f"{kind}_lowrank"], kind, ranks)
        return x

    def _latents(self, parts: Mapping[str, torch.Tensor], kind: str) -> torch.Tensor:
        return self._reconstructed(parts, kind).to(self.dtype)

    def _residual(self, coeffs: torch.Tensor, kind: str, ranks: Sequence[int]) -> torch.Tensor:
        """The low-rank residual (B, S_e, R) of every chunk: per group, tokens' coefficients × their chunk's
        basis, one batched product per run of equal-sized chunks (decoding makes them all ``buffer`` long)."""
        ks = [self.lowrank_width(r) for r in ranks]
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
        for kind, width in (("k", sum(self.ranks_k)), ("v", sum(self.ranks_v))):
            if f"{kind}_index" in self.sparse:
                values, index = _kept_outliers(
                    self.sparse[f"{kind}_values"], self.sparse[f"{kind}_index"], lo * width, hi * width
                )
                self.sparse[f"{kind}_values"], self.sparse[f"{kind}_index"] = values, index
        super()._slice_tokens(start, end)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super()._map(fn)
        self.bases = {kind: tuple(fn(b) for b in bs) for kind, bs in self.bases.items()}
        self.sparse = {name: fn(t) for name, t in self.sparse.items()}

    def reset(self) -> None:
        super().reset()
        self.chunk_sizes, self.bases, self.sparse = [], {}, {}


def _kept_outliers(
    values: torch.Tensor, index: torch.Tensor, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outliers (B, K) whose flat positions lie in ``lo..hi-1``, shifted by ``−lo``, each row's kept ones
    first, then −1 slots up to the row keeping the most (K' ≤ K)."""
    kept = (index >= lo) & (index < hi)
    order = torch.where(kept, index.long(), torch.iinfo(torch.int32).max).argsort(dim=-1, stable=True)
    width = int(kept.sum(-1).max()) if kept.numel() else 0
    order = order[:, :width]
    shifted = torch.where(kept.gather(1, order), index.gather(1, order) - lo, -1)
    return values.gather(1, order), shifted.to(torch.int32)


SOLVERS = ("power", "svd")
MODES = ("whole", "chunked")


@CACHE_STORAGES.register
@dataclass(frozen=True)
class GearStorage(CacheStorage):
    """GEAR: 2/3/4/8-bit latents + a share of exact outliers + a low-rank residual, streamed (buffer)."""

    name: ClassVar[str] = "gear"
    bits: int = 4
    quant_group_size: int | None = None  # None: one quantization group per latent group row
    outlier_share: float = 0.02  # GEAR's s: s/2 largest and s/2 smallest entries of a segment kept exactly
    outliers: int | None = None  # instead of the share: this many per token and quantization group
    rank: int | None = 2  # rank of the residual's approximation per latent group and segment
    # GEAR's ρ: the rank is max(1, ⌊ρ · min(n, r_g)⌋) per segment of n tokens instead (with rank: null)
    rank_share: float | None = None
    solver: str = "power"  # "power": GEAR's power iteration; "svd": exact truncated SVD
    iterations: int = 3  # power iteration loops (Algorithm 2's L)
    mode: str = "whole"  # "whole": append the full buffer and recompress all; "chunked": a chunk per buffer
    buffer: int = 20  # tokens kept as given until this many are compressed (GEAR's n_b)

    def __post_init__(self) -> None:
        check_options(self, INTEGER_BITS, "buffer")
        if (self.rank is None) == (self.rank_share is None):
            raise ValueError(
                "gear cache: give either rank (a fixed rank per latent group and segment) or rank_share "
                f"(GEAR's ρ) with rank: null, got rank {self.rank} and rank_share {self.rank_share}"
            )
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"gear cache rank must be ≥ 0 or null, got {self.rank}")
        if self.rank_share is not None and not 0 < self.rank_share <= 1:
            raise ValueError(f"gear cache rank_share must be in (0, 1], got {self.rank_share}")
        if not 0 <= self.outlier_share <= 1:
            raise ValueError(f"gear cache outlier_share must be in [0, 1], got {self.outlier_share}")
        if self.outliers is not None and self.outliers < 0:
            raise ValueError(f"gear cache outliers must be ≥ 0 or null, got {self.outliers}")
        if self.outliers is not None and self.outlier_share:
            raise ValueError(
                f"gear cache: outliers: {self.outliers} (a count per token and quantization group) replaces "
                f"outlier_share, so give outlier_share: 0 with it (got {self.outlier_share}); a format that "
                "records gear before the share existed kept outliers: N, rank, buffer only: add "
                "outlier_share: 0, solver: svd, mode: chunked to keep its behaviour"
            )
        if self.solver not in SOLVERS:
            raise ValueError(f"gear cache solver must be one of {SOLVERS}, got {self.solver!r}")
        if self.mode not in MODES:
            raise ValueError(f"gear cache mode must be one of {MODES}, got {self.mode!r}")
        if self.iterations < 1:
            raise ValueError(f"gear cache iterations must be ≥ 1, got {self.iterations}")

    def check_ranks(self, ranks: Sequence[int]) -> None:
        """The quantization group size must divide every rank; with ``outliers: N``, every quantization group
        must hold more entries than N (and at most 256, for uint8 positions)."""
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

    def rotation_warning(self, rotation: str) -> str | None:
        return unrotated_codes_warning(self.name, self.bits, rotation)

    def create_store(self, ranks_k: tuple[int, ...], ranks_v: tuple[int, ...]) -> GearStore:
        self.check_ranks(ranks_k + ranks_v)
        return GearStore(
            ranks_k,
            ranks_v,
            self.bits,
            self.quant_group_size,
            self.outlier_share,
            self.outliers,
            self.rank or 0,
            self.solver,
            self.iterations,
            self.mode,
            self.buffer,
            self.rank_share,
        )
