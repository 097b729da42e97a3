"""The one piece of linear algebra behind every weight-level method.

A group slice ``W_g`` (s·D × d) of k_proj or v_proj is replaced by ``B_g A_g``: ``A_g`` (r × d) maps the
input to the latent the cache stores, ``B_g`` (s·D × r) maps it back. Methods differ only in the metric
that picks the subspace:

- plain SVD (LoRC, data-free): SVD of ``W_g``;
- whitened SVD (SVD-LLM / Palu): SVD of ``W_g S`` with ``S Sᵀ = Σ x xᵀ`` over the k/v_proj inputs, then
  ``A = Σ^½ Vᵀ S⁻¹``, ``B = U Σ^½`` (lrkv stores the equivalent ``A = Uᵀ W``, ``B = U``: see
  :func:`fit_group`). Truncating to rank r minimises ``‖(W − B_r A_r) X‖_F`` over the
  calibration activations X (SVD-LLM, Thm. 1), and the error equals ``Σ_{i>r} σ_i²`` (Eckart–Young).

- activation PCA (Eigen Attention, Saxena et al. 2024, §3): eigenvectors of the output covariance
  ``W G Wᵀ`` (``G = Σ x xᵀ``). For values, per group (:func:`fit_output_pca`): the same subspace as
  whitened SVD, computed by eigh of the small s·D × s·D covariance. For keys of RoPE models, one basis
  ``U_k`` (D × D) shared by the KV heads of a layer (:func:`fit_shared_basis`), applied per head and
  interleaved across a group's heads (:func:`fit_on_shared_basis`).

- whitened SVD with an output metric (lrkv, ``whitened`` with ``values="output"``): the error measured
  after a map of the group's outputs, ``‖R (W_g − W_r) X‖_F`` with ``R² = M`` (for values, what o_proj makes
  of them: :func:`value_output_metrics`); the SVD of ``R W_g S`` (:func:`fit_group` with ``output``).

Every method keeps the full ordered spectrum, so rank search and per-token levels are prefixes
(:func:`truncate`). The up-projection is orthonormal in all of them (in the output metric's inner product
``Bᵀ M B = I`` where there is one), so one rule holds throughout: with ``a_j`` the j-th row of ``down``,
``sigma_j² = a_j G a_jᵀ`` is the energy of latent j in the method's metric (``G`` for whitened and pca,
``I`` for plain), and dropping latents r.. costs exactly ``Σ_{j≥r} σ_j²`` (:func:`truncation_error`).
Everything is computed in float64.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

DAMPING_STEPS = (1e-8, 1e-6, 1e-4, 1e-2, 1e-1)


def _checked_gram(gram: torch.Tensor) -> torch.Tensor:
    """The Gram in float64, symmetrised; raises if it is empty or not finite."""
    g = gram.to(torch.float64)
    g = (g + g.T) / 2
    if not torch.isfinite(g).all() or g.diagonal().mean() <= 0:
        raise ValueError("Gram matrix is empty or not finite: were the calibration activations collected?")
    return g


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
    g = _checked_gram(gram)
    scale = g.diagonal().mean()
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

    sigma : (m,) importance of each latent, in latent order: ``sigma_j² = a_j M a_jᵀ``, the energy of latent
        j in the method's metric M, so a prefix of rank r loses ``Σ_{j≥r} σ_j²``. For the SVD methods these
        are the singular values of ``W S`` (``R W S`` with an output metric; descending; m = min(s·D, d));
        for pca values the square roots of the output covariance's eigenvalues (descending; m = s·D); for
        pca keys the square roots of each head's captured variance along each shared direction (m = s·D;
        descending within each direction's block of s latents, see :func:`fit_on_shared_basis`).
    down : (m, d) rows of ``A = Uᵀ W`` (``Uᵀ R W`` with an output metric), most important first.
    up : (s·D, m) columns of ``B = U`` (orthonormal; ``R⁻¹ U`` with an output metric, see :func:`fit_group`).
    """

    sigma: torch.Tensor
    down: torch.Tensor
    up: torch.Tensor

    @property
    def max_rank(self) -> int:
        return int(self.sigma.numel())


@dataclass
class OutputMetric:
    """``R = M^½`` and ``R⁻¹`` of a PSD metric ``M`` (s·D × s·D) on a group's outputs: the error ``δ`` of the
    group's projection costs ``δᵀ M δ`` (:func:`value_output_metrics`)."""

    root: torch.Tensor
    inv_root: torch.Tensor


def fit_output_metric(metric: torch.Tensor) -> OutputMetric:
    """Square root of an output metric and its inverse, in float64, eigenvalues clamped at ``1e-10·max``
    (directions the metric ignores stay invertible, so the factors remain exact at full rank)."""
    evals, evecs = _eigh_descending(metric.to(torch.float64))
    if not torch.isfinite(evals).all() or evals[0] <= 0:
        raise ValueError("output metric is zero or not finite")
    evals = evals.clamp_min(1e-10 * evals[0])
    return OutputMetric((evecs * evals.sqrt()) @ evecs.T, (evecs / evals.sqrt()) @ evecs.T)


@torch.no_grad()
def fit_group(
    weight: torch.Tensor, whitening: Whitening | None = None, output: OutputMetric | None = None
) -> GroupFactors:
    """Factor one group slice of k_proj/v_proj.

    Parameters
    ----------
    weight : (s·D, d) rows of the projection for the group's KV heads.
    whitening : the layer input's whitening (whitened SVD), or None for plain SVD.
    output : a metric on the group's outputs, or None (every output direction counts the same). With
        ``M = R²``, the SVD of ``R W S`` gives ``B = R⁻¹ U``, ``A = Uᵀ R W``: truncating to rank r minimises
        ``‖R (W − B_r A_r) X‖_F`` (the same Eckart–Young argument on the two-sided weighted matrix), and
        ``B A = W`` at full rank. ``B`` is then orthonormal in the metric (``Bᵀ M B = I``), not in the
        Euclidean sense.
    """
    w = weight.to(torch.float64)
    left = output.root @ w if output is not None else w  # (s·D, d)
    m = left @ whitening.S if whitening is not None else left  # (s·D, d)
    U, sigma, _ = torch.linalg.svd(m, full_matrices=False)  # U (s·D, m), sigma (m,)
    # B = U, A = Uᵀ W: the same rank-r product as Palu's (U Σ^½)(Σ^½ Vᵀ S⁻¹), since
    # U_r U_rᵀ W = U_r Σ_r V_rᵀ S⁻¹, with the latent rescaled by Σ^½. An orthonormal up-projection keeps
    # S⁻¹ out of the runtime factors, so float32 rounding stays at the level of the original k/v_proj.
    up = output.inv_root @ U if output is not None else U  # (s·D, m)
    down = U.T @ left  # (m, d)
    return GroupFactors(sigma=sigma, down=down, up=up)


@torch.no_grad()
def value_output_metrics(o_weight: torch.Tensor, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Per KV head, the metric of a value error as o_proj sees it: ``M_j = W̄_jᵀ W̄_j`` (D × D) with
    ``W̄_j = Σ_h W_o,h`` (d × D) over the query heads h that read KV head j.

    A change ``δ`` of a value row reaches the attention output of head h as ``W_o,h (p_h δ)``; if the heads
    sharing KV head j weigh the row alike (``p_h`` the same), the output moves by ``W̄_j p δ``, so
    ``‖W̄_j δ‖² = δᵀ M_j δ`` is what the error costs (per unit attention weight). Directions o_proj maps
    to little, or that the heads of a GQA group cancel, cost little.

    Parameters
    ----------
    o_weight : (d, H·D) the layer's o_proj weight, query heads in order (head h reads KV head
        ``h // (H / Hkv)``).

    Returns
    -------
    (Hkv, D, D) float64.
    """
    d, width = o_weight.shape
    if width % (n_kv_heads * head_dim):
        raise ValueError(f"o_proj input width {width} is not a multiple of Hkv·D = {n_kv_heads * head_dim}")
    w = o_weight.to(torch.float64).reshape(d, n_kv_heads, width // (n_kv_heads * head_dim), head_dim)
    summed = w.sum(2)  # (d, Hkv, D): W̄_j
    return torch.einsum("dji,djk->jik", summed, summed)


def _eigh_descending(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a symmetric PSD matrix, largest first."""
    evals, evecs = torch.linalg.eigh((cov + cov.T) / 2)
    return evals.flip(0).clamp_min(0), evecs.flip(1)


@torch.no_grad()
def fit_output_pca(weight: torch.Tensor, gram: torch.Tensor) -> GroupFactors:
    """Activation PCA of one group's outputs (Eigen Attention's value basis).

    The outputs ``y = W x`` of the group have (uncentred) covariance ``C = W G Wᵀ`` (s·D × s·D); its
    eigenvectors ``U`` (descending eigenvalues λ) give ``B = U``, ``A = Uᵀ W`` and ``sigma = √λ``.

    This is the subspace whitened SVD picks: with ``G = S Sᵀ``, ``C = (W S)(W S)ᵀ``, whose eigenvectors
    are the left singular vectors of ``W S`` and whose eigenvalues are its squared singular values. So
    every prefix has the same product ``U_r U_rᵀ W`` as :func:`fit_group` with the whitening of ``G``
    (up to a rotation within equal eigenvalues), and the rank-r truncation minimises ``‖(W − W_r) X‖_F``.
    PCA needs no Cholesky factor: a singular Gram is fine, and the factors stay exact at full rank
    because ``U`` is square (m = s·D; directions beyond rank(C) carry zero variance).

    Parameters
    ----------
    weight : (s·D, d) rows of the projection for the group's KV heads.
    gram : (d, d) ``Σ x xᵀ`` of the projection's input.
    """
    w = weight.to(torch.float64)
    g = _checked_gram(gram)
    evals, U = _eigh_descending(w @ g @ w.T)  # (s·D,), (s·D, s·D)
    return GroupFactors(sigma=evals.sqrt(), down=U.T @ w, up=U)


@torch.no_grad()
def fit_shared_basis(weight: torch.Tensor, gram: torch.Tensor, head_dim: int) -> torch.Tensor:
    """One key basis for all KV heads of a layer (Eigen Attention for RoPE models).

    ``C_k = Σ_h W_h G W_hᵀ`` (D × D) sums the heads' output covariances; its eigenvectors, largest
    eigenvalue first, are the shared basis ``U_k``: the directions of the per-head key space that carry the
    most key energy over all heads of the layer.

    Parameters
    ----------
    weight : (Hkv·D, d) the layer's k_proj weight.
    gram : (d, d) ``Σ x xᵀ`` of the k_proj input.
    head_dim : D.

    Returns
    -------
    (D, D) orthonormal ``U_k``, columns in descending order of ``C_k``'s eigenvalues.
    """
    g = _checked_gram(gram)
    w = weight.to(torch.float64).reshape(-1, head_dim, weight.shape[-1])  # (Hkv, D, d)
    cov = torch.einsum("hik,kl,hjl->ij", w, g, w)  # (D, D)
    return _eigh_descending(cov)[1]


@torch.no_grad()
def fit_on_shared_basis(weight: torch.Tensor, gram: torch.Tensor, basis: torch.Tensor) -> GroupFactors:
    """Factors of a group of s KV heads on a shared per-head basis ``U_k`` (D × D).

    Each head h gets ``A_h = U_kᵀ W_h`` (D × d) and ``B_h = U_k``; the group's factors are these blocks,
    with up block-diagonal up to a column order. Latent order (the rule rank prefixes follow): direction
    major, head minor. Latent ``j`` is shared direction ``i = j // s`` (0-based) of the head that has the
    ``(j mod s)``-th largest captured variance ``v_{h,i} = u_iᵀ W_h G W_hᵀ u_i`` along that direction (ties:
    lower head first). A prefix of length r thus keeps the top ``⌊r/s⌋`` shared directions for every head
    of the group, plus direction ``⌊r/s⌋`` for the ``r mod s`` heads that capture most along it; ranks that
    are multiples of s keep the heads balanced. ``sigma_j = √v_{h,i}``: descending within each block of s
    latents, and since ``U_k`` is orthonormal per head, dropping latents r.. costs exactly ``Σ_{j≥r} σ_j²``
    in ``‖(W − W_r) X‖_F²``.

    Parameters
    ----------
    weight : (s·D, d) rows of k_proj for the group's KV heads.
    gram : (d, d) ``Σ x xᵀ`` of the k_proj input.
    basis : (D, D) the layer's shared basis (:func:`fit_shared_basis`).
    """
    D = basis.shape[0]
    g = _checked_gram(gram)
    u = basis.to(torch.float64)
    w = weight.to(torch.float64).reshape(-1, D, weight.shape[-1])  # (s, D, d)
    s = w.shape[0]
    a = u.T @ w  # (s, D, d): A_h = U_kᵀ W_h, row i = direction i of head h
    var = ((a @ g) * a).sum(-1).clamp_min(0)  # (s, D): v_{h,i}
    heads = torch.sort(var.T, dim=1, descending=True, stable=True).indices.reshape(-1)  # (D·s,)
    dirs = torch.arange(D, device=u.device).repeat_interleave(s)  # (D·s,): direction of latent j
    cols = torch.arange(s * D, device=u.device)
    up = torch.zeros(s, D, s * D, dtype=torch.float64, device=u.device)
    up[heads, :, cols] = u[:, dirs].T  # column j: u_{dirs[j]} in the block of head heads[j]
    up = up.reshape(s * D, s * D)
    return GroupFactors(sigma=var[heads, dirs].sqrt(), down=a[heads, dirs], up=up)


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
