"""Orthogonal rotations of a latent group's rank dimension, fused into the factors before quantization.

Any orthogonal R (r × r) leaves a group's product unchanged, ``B A = (B R)(Rᵀ A)``, while the cached latent
becomes ``h' = Rᵀ h``. Whitened-SVD latents carry their energy in the first few coordinates (σ_1 ≫ σ_r), so
a per-token min/max grid is set by one or two large values and the rest quantize to a handful of levels;
a rotation that spreads every coordinate over all r (a normalised Hadamard matrix, whose entries all have
magnitude 1/√r) evens the row out before quantization (Palu §3.3, after QuaRot). Fused offline into the
down- and up-projections, it costs nothing at run time, and without quantization it changes nothing but
float rounding.

Policies (:data:`ROTATIONS`):

- ``none``: no rotation;
- ``hadamard``: a normalised Hadamard matrix of order r for every group; refused, naming the ranks, when
  :func:`hadamard` cannot build one of that order;
- ``auto``: the Hadamard matrix where :func:`hadamard` builds one, else a seeded random orthogonal matrix
  (Haar, :func:`random_orthogonal`). Palu restricts ranks to Hadamard orders; fused offline, lrkv need not.

:func:`hadamard` builds orders ``n`` from Sylvester's doubling, Paley's constructions I (``q + 1`` for a prime
``q ≡ 3 mod 4``) and II (``2(q + 1)`` for a prime ``q ≡ 1 mod 4``), and Kronecker products of those: every
multiple of 8 up to 256 but 184 and 232 (e.g. 24 = Paley I of 23, 56 = 2 · Paley II of 13).
A block-diagonal Hadamard of a smaller order that divides r was not used: it would mix the leading,
high-energy latents only within their own block, which is what the rotation is there to undo.

**The first row is constant** (``+1/√r`` in every column) for both kinds: the leading latent, which a
whitened basis fills most (a key latent is often mostly its leading coordinate), then adds the same
value to every rotated coordinate, and the per-token zero-point takes it whole; the grid's range is set by
the other latents only. A Hadamard matrix has its columns' signs flipped to make its first row +1 (still
Hadamard); the random matrix is drawn orthogonal to the constant vector past its first row. On SmolLM2's
key latents at 3 bits this halves the relative error against the same matrix with alternating column signs
and cuts it to a third against a Haar-random one; values, whose leading latent dominates less, gain less
(docs/quantized-cache.md § "The fused rotation", ``benchmarks/rotation_error.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Literal, get_args

import torch

from ..registry import Section

Policy = Literal["none", "hadamard", "auto"]
ROTATIONS: tuple[str, ...] = get_args(Policy)


@dataclasses.dataclass(frozen=True)
class RotationConfig(Section):
    """The rotation a conversion fuses into every group's factors: the ``rotation`` section of
    :class:`lrkv_core.conversion.convert.CompressionConfig` and of a recipe's ``compression``, the policy's
    ``name`` (as a registered method's) and its options (``rotation: {name: auto, seed: 1}``; ``rotation:
    auto`` for short). A new option is a field here, read by :func:`lrkv_core.model.fuse.compress_model`."""

    label: ClassVar[str] = "rotation"

    name: Policy = dataclasses.field(
        default="none",
        metadata={
            "help": "orthogonal rotation of each group's rank dimension fused into the factors (spreads "
            "latents before quantization): hadamard, or auto (Hadamard where the rank allows, else random)"
        },
    )
    seed: int = dataclasses.field(
        default=0, metadata={"help": "seeds the random orthogonal matrices auto draws where Hadamard cannot"}
    )

    def __post_init__(self) -> None:
        if self.name not in ROTATIONS:
            raise ValueError(f"unknown rotation {self.name!r}; choose from {', '.join(ROTATIONS)}")

    @classmethod
    def create(cls, value: Any) -> RotationConfig:
        """The section itself, its defaults for None, one from its mapping form, or the policy's name."""
        return cls(name=value) if isinstance(value, str) else super().create(value)


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[i, j] = χ(j − i)`` over GF(q), χ the quadratic character (0 at 0, ±1 for (non-)residues)."""
    chi = torch.full((q,), -1.0, dtype=torch.float64)
    chi[0] = 0.0
    chi[[(x * x) % q for x in range(1, q)]] = 1.0
    idx = torch.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]  # (q, q)


def _paley_one(q: int) -> torch.Tensor:
    """Paley I, order q + 1 (q prime ≡ 3 mod 4): ``H = I + [[0, 1ᵀ], [−1, Q]]``."""
    n = q + 1
    s = torch.zeros(n, n, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
    return torch.eye(n, dtype=torch.float64) + s


def _paley_two(q: int) -> torch.Tensor:
    """Paley II, order 2(q + 1) (q prime ≡ 1 mod 4): ``C ⊗ [[1, 1], [1, −1]] + I ⊗ [[1, −1], [−1, −1]]``."""
    n = q + 1
    c = torch.zeros(n, n, dtype=torch.float64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)  # symmetric conference matrix
    a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, a) + torch.kron(torch.eye(n, dtype=torch.float64), b)


@functools.cache
def _hadamard_pm1(n: int) -> torch.Tensor | None:
    """A ±1 Hadamard matrix of order n (``H Hᵀ = n I``) from the constructions above, or None."""
    if n == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if n == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    if n % 4:
        return None  # no Hadamard matrix of order > 2 exists unless 4 divides n
    if _is_prime(n - 1) and (n - 1) % 4 == 3:
        return _paley_one(n - 1)
    if _is_prime(n // 2 - 1) and (n // 2 - 1) % 4 == 1:
        return _paley_two(n // 2 - 1)
    for a in range(2, int(n**0.5) + 1):  # Kronecker product of two smaller orders (Sylvester: a = 2)
        if n % a == 0:
            left, right = _hadamard_pm1(a), _hadamard_pm1(n // a)
            if left is not None and right is not None:
                return torch.kron(left, right)
    return None


def hadamard(n: int) -> torch.Tensor | None:
    """The normalised Hadamard matrix of order n (float64, orthogonal: entries ±1/√n) with its first row
    +1/√n (module docstring), or None if lrkv cannot build one of that order."""
    h = _hadamard_pm1(int(n))
    return None if h is None else h * torch.sign(h[0]) / n**0.5


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A random orthogonal matrix (n × n, float64) from a seeded generator whose first row is +1/√n: the
    transposed Q of a QR factorisation of a Gaussian matrix whose first column is all ones, with the signs
    of R's diagonal moved into Q (Mezzadri 2007), so its other rows are Haar-random on the complement of
    the constant vector."""
    g = torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    g[:, 0] = 1.0
    q, r = torch.linalg.qr(g)
    return (q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))).T


def group_seed(seed: int, layer: int, kind: str, group: int) -> int:
    """A distinct, reproducible seed per (layer, K/V, group) from the conversion's one seed."""
    return ((seed * 1_000_003 + layer) * 2 + (kind == "v")) * 10_007 + group


def rotation_matrix(rank: int, policy: str, seed: int) -> tuple[torch.Tensor | None, str]:
    """The rotation of one group of rank r under ``policy``, and which kind it is.

    Returns ``(R, kind)``: R (r × r) float64 orthogonal, or None for ``none``; kind is ``"none"``,
    ``"hadamard"`` or ``"orthogonal"``.
    """
    if policy not in ROTATIONS:
        raise ValueError(f"unknown rotation {policy!r}; choose from {', '.join(ROTATIONS)}")
    if policy == "none":
        return None, "none"
    h = hadamard(rank)
    if h is not None:
        return h, "hadamard"
    if policy == "hadamard":
        raise ValueError(
            f"no Hadamard matrix of order {rank} can be built here (Sylvester, Paley I/II and their "
            "Kronecker products); use --rotation auto (a random orthogonal matrix for such ranks)"
        )
    return random_orthogonal(rank, seed), "orthogonal"


def check_rotation(policy: str, ranks: list[list[int]]) -> None:
    """Refuse before any work a policy that cannot rotate every group of ``ranks[layer][g]``."""
    if policy not in ROTATIONS:
        raise ValueError(f"unknown rotation {policy!r}; choose from {', '.join(ROTATIONS)}")
    if policy == "hadamard":
        missing = sorted({r for layer in ranks for r in layer if hadamard(r) is None})
        if missing:
            raise ValueError(
                f"--rotation hadamard: no Hadamard matrix of order {missing} can be built here; "
                "use --rotation auto (a seeded random orthogonal matrix for those ranks)"
            )


def rotate_factors(
    down: torch.Tensor, up: torch.Tensor, rotation: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Rᵀ A, B R)`` for one group's factors A (r × d) and B (s·D × r): the same product ``B A``."""
    if rotation is None:
        return down, up
    r = rotation.to(down.dtype)
    return r.T @ down, up @ r
