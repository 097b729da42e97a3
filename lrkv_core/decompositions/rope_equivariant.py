"""Latents of *rotated* keys that hold at every position: a RoPE-equivariant basis of a group's keys.

A cache of latents of the keys after RoPE, ``h = A rope_p(k)``, lets each query absorb the up-projection
(``rope(q) · B h = (Bᵀ rope(q)) · h``): attention reads the latents directly, with no key rebuilt and no
RoPE in the decode step. A basis fitted to rotated keys by plain PCA holds only at the positions it was
calibrated on (RoPE turns each pair of key dims by an angle that grows with the position). A map that
*commutes* with RoPE holds everywhere: ``B A rope_p(k) = rope_p(B A k)``, so its error on rotated keys at
any position is its error on the keys before RoPE.

RoPE (transformers' ``rotate_half`` layout) turns, in every head, the pair of dims ``(j, j + D/2)`` by the
angle ``p·θ_j``: as a complex number ``z_j = k_j + i·k_{j+D/2}`` it is multiplied by ``e^{i p θ_j}``, the same
factor in every head of the group. So a map that, per frequency j, mixes only the pairs ``z_{h,j}`` of the
group's heads h by one complex matrix commutes with RoPE. Per frequency, with ``C_j = Σ z zᴴ`` (s × s, the
same before and after RoPE):

- unweighted: the eigenvectors of ``C_j`` (the projection keeping most of the keys' energy);
- weighted by the queries: the oblique map minimising the scores' error ``‖Q_j^½ (I − M) C_j^½‖_F`` with
  ``Q_j`` the diagonal of each head's query energy at that frequency (its query heads summed).

The components of every frequency are ranked together by the energy (score-weighted energy) they keep;
each is one complex latent, i.e. two real latents ``(Re c, Im c)``, side by side. With partial rotary
embeddings (RoPE on the first R of each head's D dims) the other dims pass through RoPE, so any real map of
them commutes with it: they get a real basis across the group's heads, its components paired into units of
two latents ranked with the complex ones.
:func:`rope_equivariant_factors` returns them all as real factors in that order, so a rank is a prefix of an
even length.
"""

from __future__ import annotations

import torch

from ..linalg import GroupFactors

DAMPING = 1e-4  # of the mean diagonal, added to each frequency's Grams before their roots are taken


def _damped_roots(S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(S'^½, S'^-½, m)`` of a Hermitian Gram ``S`` scaled to mean diagonal 1 (``S' = S / m + δ I``)."""
    m = float(S.diagonal().real.mean())
    if m <= 0:
        m = 1.0
    S = S / m + DAMPING * torch.eye(S.shape[0], dtype=S.dtype)
    ev, V = torch.linalg.eigh(S)
    ev = ev.clamp_min(1e-12)
    return (V * ev.sqrt()) @ V.mH, (V / ev.sqrt()) @ V.mH, m


def pair_gram(
    gram: torch.Tensor, n_heads: int, head_dim: int, j: int, rotary_dim: int | None = None
) -> torch.Tensor:
    """``C_j = Σ z zᴴ`` (s × s complex) of frequency ``j``'s pairs ``z_h = k_{h,j} + i·k_{h,j+R/2}`` from the
    real Gram (s·D × s·D) of the group's keys (heads side by side); R the rotary dims (None: D)."""
    half = (rotary_dim or head_dim) // 2
    a = torch.tensor([h * head_dim + j for h in range(n_heads)])
    b = a + half
    G = gram.to(torch.float64).cpu()
    C = (G[a][:, a] + G[b][:, b]) + 1j * (G[b][:, a] - G[a][:, b])
    return (C + C.mH) / 2


def _components(
    G: torch.Tensor, weight: torch.Tensor | None
) -> list[tuple[float, torch.Tensor, torch.Tensor]]:
    """``(energy, A row, B column)`` of each component of a map ``M = Σ_m b_m a_m`` on vectors with Hermitian
    Gram ``G`` (n × n, real or complex): the eigenvectors of G (the energy they keep), or with ``weight``
    (n,) the oblique map minimising ``‖W^½ (I − M) G^½‖_F`` for ``W = diag(weight)`` (the weighted energy)."""
    n = G.shape[0]
    if weight is None:
        ev, V = torch.linalg.eigh(G)
        return [(float(ev[m]), V[:, m].conj(), V[:, m]) for m in range(n)]
    q_half, q_inv, q_scale = _damped_roots(torch.diag(weight.to(torch.float64)).to(G.dtype))
    k_half, k_inv, k_scale = _damped_roots(G)
    U, sv, Vh = torch.linalg.svd(q_half @ k_half)
    down, up = sv[:, None].to(Vh.dtype) * Vh @ k_inv, q_inv @ U  # M = up @ down
    return [(float(sv[m]) ** 2 * q_scale * k_scale, down[m], up[:, m]) for m in range(n)]


def _complex_units(
    key_gram: torch.Tensor, s: int, D: int, R: int, query_energy: torch.Tensor | None
) -> list[tuple[float, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """One unit per component of every rotation frequency: its energy and its two real latents' (A row, B
    column) pairs over the group's s·D key dims (the ``Re c`` latent, then ``Im c``)."""
    half, heads = R // 2, torch.arange(s) * D
    units = []
    for j in range(half):
        C = pair_gram(key_gram, s, D, j, R)
        ja, jb = heads + j, heads + j + half
        weight = None if query_energy is None else query_energy[ja] + query_energy[jb]
        for energy, a, b in _components(C, weight):
            re_a, im_a, re_b, im_b = (torch.zeros(s * D, dtype=torch.float64) for _ in range(4))
            # c = a·z: Re c = Σ Re a·k_j − Im a·k_{j+½}, Im c = Σ Im a·k_j + Re a·k_{j+½}
            re_a[ja], re_a[jb] = a.real, -a.imag
            im_a[ja], im_a[jb] = a.imag, a.real
            # z ≈ b c: k_j gets Re(b c) = Re b·Re c − Im b·Im c, k_{j+½} gets Im(b c) = Im b·Re c + Re b·Im c
            re_b[ja], re_b[jb] = b.real, b.imag
            im_b[ja], im_b[jb] = -b.imag, b.real
            units.append((energy, [(re_a, re_b), (im_a, im_b)]))
    return units


def _pass_through_units(
    key_gram: torch.Tensor, s: int, D: int, R: int, query_energy: torch.Tensor | None
) -> list[tuple[float, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """With partial rotary embeddings, the dims RoPE leaves alone (``R..D−1`` of every head): any real map of
    them commutes with RoPE, so their basis mixes them across the group's heads freely (PCA, or the oblique
    map weighted by the queries); its components, most energetic first, are paired into units of two
    latents so that every even rank keeps whole units."""
    dims = torch.tensor([h * D + i for h in range(s) for i in range(R, D)], dtype=torch.long)
    if dims.numel() == 0:
        return []
    G = key_gram.to(torch.float64).cpu()[dims][:, dims]
    G = (G + G.T) / 2
    comps = _components(G, None if query_energy is None else query_energy[dims])
    comps.sort(key=lambda c: c[0], reverse=True)
    units = []
    for first, second in zip(comps[0::2], comps[1::2], strict=True):
        rows = []
        for _, a, b in (first, second):
            row, col = torch.zeros(s * D, dtype=torch.float64), torch.zeros(s * D, dtype=torch.float64)
            row[dims], col[dims] = a, b
            rows.append((row, col))
        units.append((first[0] + second[0], rows))
    return units


def rope_equivariant_factors(
    key_gram: torch.Tensor,
    n_heads: int,
    head_dim: int,
    query_energy: torch.Tensor | None = None,
    rotary_dim: int | None = None,
) -> GroupFactors:
    """Full-rank real factors of a RoPE-equivariant basis of one group's keys, most important first.

    Parameters
    ----------
    key_gram : (s·D, s·D) Gram of the group's keys (before or after RoPE: the pairs' Grams are the same),
        heads side by side.
    n_heads, head_dim : s and D (D even).
    query_energy : (s·D,) each key dim's query energy (the diagonal of the queries' Gram, each KV head's
        query heads summed), to weigh the scores' error; None for the unweighted basis.
    rotary_dim : the dims of each head RoPE turns (the first R, paired ``(j, j + R/2)``); None: all D. The
        other ``D − R`` pass through RoPE and get a real basis of their own (:func:`_pass_through_units`).

    Returns
    -------
    :class:`~lrkv_core.linalg.GroupFactors` with ``down`` A (s·D, s·D) acting on (rotated) keys, ``up`` B
    (s·D, s·D) with ``B A = I``, and ``sigma`` the square root of each latent's half of its unit's (weighted)
    energy: a unit is a complex component of one frequency or two pass-through components, two latents side
    by side, units in descending energy. ``B_r A_r`` commutes with RoPE for every even r.
    """
    s, D = n_heads, head_dim
    R = D if rotary_dim is None else rotary_dim
    if D % 2 or R % 2 or not 0 < R <= D:
        raise ValueError(f"RoPE pairs need an even head dim and rotary dims, got {D} and {R}")
    if key_gram.shape != (s * D, s * D):
        raise ValueError(f"a key Gram of shape {tuple(key_gram.shape)} for {s} heads of {D}")
    units = _complex_units(key_gram, s, D, R, query_energy)
    units += _pass_through_units(key_gram, s, D, R, query_energy)
    units.sort(key=lambda u: u[0], reverse=True)
    A = torch.zeros(s * D, s * D, dtype=torch.float64)
    B = torch.zeros(s * D, s * D, dtype=torch.float64)
    sigma = torch.zeros(s * D, dtype=torch.float64)
    for n, (energy, rows) in enumerate(units):
        for i, (row, col) in enumerate(rows):
            A[2 * n + i], B[:, 2 * n + i] = row, col
        sigma[2 * n : 2 * n + 2] = max(energy, 0.0) ** 0.5 / 2**0.5
    return GroupFactors(sigma, A, B)


def rotated_key_factors(
    w_k: torch.Tensor,
    w_q: torch.Tensor,
    gram: torch.Tensor,
    n_kv_heads: int,
    head_dim: int,
    group_size: int,
    *,
    weighted: bool = True,
    rotary_dim: int | None = None,
) -> list[GroupFactors]:
    """Each group's full-rank RoPE-equivariant factors of the keys ``W_k x`` (Gram ``W_k G W_kᵀ`` from the
    layer input's Gram ``G``), weighted by the queries ``W_q x`` (each KV head's query heads summed) unless
    ``weighted`` is False, RoPE turning the first ``rotary_dim`` dims of each head (None: all;
    :func:`rope_equivariant_factors`)."""
    G = gram.to(torch.float64).cpu()
    w_k, w_q = (w.detach().to(torch.float64).cpu() for w in (w_k, w_q))
    D, s = head_dim, group_size
    n_rep = w_q.shape[0] // (n_kv_heads * D)
    q_energy = ((w_q @ G) * w_q).sum(-1).view(n_kv_heads, n_rep, D).sum(1).reshape(-1)  # (Hkv·D,)
    factors = []
    for g in range(n_kv_heads // s):
        rows = slice(g * s * D, (g + 1) * s * D)
        key_gram = w_k[rows] @ G @ w_k[rows].T
        q = q_energy[rows] if weighted else None
        factors.append(rope_equivariant_factors(key_gram, s, D, q, rotary_dim))
    return factors
