"""The one piece of linear algebra behind every weight-level method.

A group slice ``W_g`` (s·D × d) of k_proj or v_proj is replaced by ``B_g A_g``: ``A_g`` (r × d) maps the
input to the latent the cache stores, ``B_g`` (s·D × r) maps it back. Methods differ only in the metric
that picks the subspace:

- plain SVD (LoRC, data-free): SVD of ``W_g``;
- whitened SVD (SVD-LLM / Palu): SVD of ``W_g S`` with ``S Sᵀ = Σ x xᵀ`` over the k/v_proj inputs, then
  ``A = Σ^½ Vᵀ S⁻¹``, ``B = U Σ^½`` (lrkv stores the equivalent ``A = Uᵀ W``, ``B = U``: see
  :func:`fit_group`). Truncating to rank r minimises ``‖(W − B_r A_r) X‖_F`` over the
  calibration activations X (SVD-LLM, Thm. 1), and the error equals ``Σ_{i>r} σ_i²`` (Eckart–Young).

:func:`fit_group` returns the full ordered spectrum, so rank search and per-token levels are prefixes
(:func:`truncate`). Everything is computed in float64.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

DAMPING_STEPS = (1e-8, 1e-6, 1e-4, 1e-2, 1e-1)


@dataclass
class Whitening:
    """``S`` with ``S Sᵀ = Gram (+ λ·mean diag·I)``, its inverse, and how it was obtained."""

    S: torch.Tensor  # (d, d)
    S_inv: torch.Tensor  # (d, d)
    method: str  # "cholesky" | "cholesky+damping" | "eigh"
    damping: float


def fit_whitening(gram: torch.Tensor) -> Whitening:
    """Whitening factor of an activation Gram matrix, in float64.

    Cholesky first; if the Gram is not numerically positive definite, retry with damping
    ``λ·mean(diag)·I`` for increasing λ; if that still fails, an eigendecomposition with the spectrum
    clamped at ``1e-10·max``.

    Parameters
    ----------
    gram : (d, d) symmetric PSD ``Σ x xᵀ``.
    """
    g = gram.to(torch.float64)
    g = (g + g.T) / 2
    scale = g.diagonal().mean()
    if not torch.isfinite(g).all() or scale <= 0:
        raise ValueError("Gram matrix is empty or not finite: were the calibration activations collected?")
    eye = torch.eye(g.shape[0], dtype=torch.float64, device=g.device)
    for lam in (0.0, *DAMPING_STEPS):
        L, info = torch.linalg.cholesky_ex(g + lam * scale * eye)
        if int(info) == 0 and bool(torch.isfinite(L).all()) and bool((L.diagonal() > 0).all()):
            if lam > 0:
                log.info("Gram not positive definite: Cholesky with damping %.0e", lam)
            S_inv = torch.linalg.solve_triangular(L, eye, upper=False)
            return Whitening(L, S_inv, "cholesky" if lam == 0 else "cholesky+damping", lam)
    evals, evecs = torch.linalg.eigh(g)
    evals = evals.clamp_min(1e-10 * evals.max())
    log.warning("Cholesky failed even with damping: eigh whitening")
    return Whitening(evecs * evals.sqrt(), (evecs / evals.sqrt()).T, "eigh", 0.0)


@dataclass
class GroupFactors:
    """Full-spectrum factors of one group: ``W_g = up @ down`` (exactly, up to float64 rounding).

    sigma : (m,) singular values of the metric-weighted weight ``W S``, descending; m = min(s·D, d).
    down : (m, d) rows of ``A = Uᵀ W``, most important first.
    up : (s·D, m) columns of ``B = U`` (orthonormal).
    """

    sigma: torch.Tensor
    down: torch.Tensor
    up: torch.Tensor

    @property
    def max_rank(self) -> int:
        return int(self.sigma.numel())


@torch.no_grad()
def fit_group(weight: torch.Tensor, whitening: Whitening | None = None) -> GroupFactors:
    """Factor one group slice of k_proj/v_proj.

    Parameters
    ----------
    weight : (s·D, d) rows of the projection for the group's KV heads.
    whitening : the layer input's whitening (whitened SVD), or None for plain SVD.
    """
    w = weight.to(torch.float64)
    m = w @ whitening.S if whitening is not None else w  # (s·D, d)
    U, sigma, _ = torch.linalg.svd(m, full_matrices=False)  # U (s·D, m), sigma (m,)
    # B = U, A = Uᵀ W: the same rank-r product as Palu's (U Σ^½)(Σ^½ Vᵀ S⁻¹), since
    # U_r U_rᵀ W = U_r Σ_r V_rᵀ S⁻¹, with the latent rescaled by Σ^½. An orthonormal up-projection keeps
    # S⁻¹ out of the runtime factors, so float32 rounding stays at the level of the original k/v_proj.
    up = U  # (s·D, m)
    down = U.T @ w  # (m, d)
    return GroupFactors(sigma=sigma, down=down, up=up)


def truncate(factors: GroupFactors, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-r prefix of the factors: ``(A_r (r, d), B_r (s·D, r))``."""
    if not 0 < rank <= factors.max_rank:
        raise ValueError(f"rank {rank} outside 1..{factors.max_rank}")
    return factors.down[:rank], factors.up[:, :rank]


def truncation_error(sigma: torch.Tensor, rank: int) -> float:
    """Eckart–Young error ``Σ_{i>r} σ_i²`` of keeping the first ``rank`` directions."""
    return float((sigma[rank:].to(torch.float64) ** 2).sum())


def group_slices(n_kv_heads: int, head_dim: int, group_size: int) -> list[slice]:
    """Row slices of k/v_proj for each group of ``group_size`` consecutive KV heads."""
    if group_size < 1 or n_kv_heads % group_size:
        raise ValueError(
            f"group size {group_size} must divide the number of KV heads ({n_kv_heads}); "
            f"valid: {[s for s in range(1, n_kv_heads + 1) if n_kv_heads % s == 0]}"
        )
    width = group_size * head_dim
    return [slice(g * width, (g + 1) * width) for g in range(n_kv_heads // group_size)]
