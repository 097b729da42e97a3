"""``kl_response``: how much the model's predictions move when one group's latents are cut to each rank.

For one group of K or V latents with full-spectrum factors ``W_g = B A`` (``B`` (s·D, m), ``A`` (m, d)),
keeping the first r latents perturbs the projection's output at token t by ``δ_t(r) = −B_{r:} A_{r:} x_t``.
To second order the KL divergence of the model's next-token distribution from the original's is
``½ δᵀ F δ`` with F the Fisher information of the row's loss, and ``δᵀ F δ = E_y[(∇ℓ · δ)²]`` where the
gradient is taken with targets y drawn from the model's own predictions. With ``u_t = B ᵀ g_t`` and
``v_t = A x_t`` (per latent j: ``u_tj``, ``v_tj``), ``∇ℓ · δ(r) = −Σ_t Σ_{j≥r} u_tj v_tj``: a suffix sum
over latents of ``c_j = Σ_t u_tj v_tj``. So one backward pass per calibration batch gives every group's
whole curve ``KL(r) ≈ (T − 1)/2 · mean_rows (Σ_{j≥r} c_j)²`` in nats per scored token, with the
interactions between latents and between tokens that element-wise (diagonal) Fisher proxies drop.

It reads the factors, so it is collected after the decomposition (``uses_factors``), unlike the Gram and
Fisher that the decomposition itself reads. ``labels="data"`` scores the rows' own next tokens instead (the
empirical Fisher, as Palu's weight Fisher does). Sampled labels are drawn per (row, draw) from generators
seeded by ``seed`` and the row's index, so the curves do not depend on the batches or shards; shards add
their sums of squared tail sums and their row counts, and the mean is taken once. It reads the first 64
calibration rows by default (``n_samples``; all of them when there are fewer), and of those at most
``tokens`` tokens' worth (64 rows of 256, 8 of 2,048): the refinement that follows corrects the plan on rows
of its own, so the curves need fewer rows than the decomposition's statistics, and long rows cost no more
than short ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..model.adapters import get_adapter
from .base import STATISTICS, Counts, LayerValue, Progress, Statistic
from .gradients import kv_gradient_passes, row_seeded_targets

if TYPE_CHECKING:
    from ..decompositions import LayerFactors
    from ..linalg import GroupFactors

KINDS = ("k", "v")
LABELS = ("sampled", "data")
KL_ROWS = 64  # calibration rows the curves are measured on by default (docs/long-context.md)
KL_TOKENS = KL_ROWS * 256  # and the most tokens they hold: 64 rows of 256, 8 of 2,048


@STATISTICS.register
@dataclass(frozen=True)
class KLResponse(Statistic):
    """second-order KL of cutting each K/V group to each rank, one gradient pass (reads the factors)"""

    name: ClassVar[str] = "kl_response"
    uses_factors: ClassVar[bool] = True
    caps_rows: ClassVar[bool] = True
    n_samples: int | None = KL_ROWS  # the first n calibration rows (all of them when fewer); None: all
    tokens: int | None = KL_TOKENS  # of those, at most max(1, tokens // T) rows of T tokens; None: no cap
    labels: str = "sampled"  # targets drawn from the model's predictions (true Fisher), or "data"
    draws: int = 1  # label draws per row when sampled (more: less noise, one more pass each)
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.labels not in LABELS:
            raise ValueError(f"kl_response labels must be one of {LABELS}, got {self.labels!r}")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"kl_response tokens must be ≥ 1 or null, got {self.tokens}")
        if self.draws < 1:
            raise ValueError(f"kl_response draws must be ≥ 1, got {self.draws}")
        if self.labels == "data" and self.draws != 1:
            raise ValueError("kl_response draws > 1 only makes sense with sampled labels")

    def used_rows(self, n_rows: int, seq_len: int | None = None) -> int:
        n = super().used_rows(n_rows, seq_len)
        return n if self.tokens is None or seq_len is None else min(n, max(1, self.tokens // seq_len))

    def accumulate(
        self,
        model: nn.Module,
        rows: torch.Tensor,
        *,
        first_row: int,
        batch_size: int,
        progress: Progress,
        factors: Sequence[LayerFactors] | None = None,
    ) -> tuple[list[LayerValue], Counts]:
        if factors is None:
            raise ValueError("kl_response reads the decomposition's factors: collect it after decomposing")
        sums, n = sum_kl_response(
            model,
            rows,
            factors,
            batch_size=batch_size,
            sampled=self.labels == "sampled",
            draws=self.draws,
            seed=self.seed,
            first_row=first_row,
            progress=progress,
        )
        return sums, {"n_rows": n, "n_scored": n * (rows.shape[1] - 1)}

    def finish(self, sums: list[LayerValue], counts: Counts) -> tuple[list[LayerValue], dict[str, Any]]:
        n = counts["n_rows"]
        curves = kl_curves(sums, n, counts["n_scored"] // n)  # every row scores T − 1 tokens
        return curves, {"n_rows": n, "labels": self.labels, "draws": self.draws}


class LatentProducts:
    """Each group's latent products from one k/v projection's input and output gradient.

    ``products(key, x, g)`` for ``key`` = (layer, kind), x (B, T, d) the projection's input and g (B, T, out)
    the gradient of the batch's mean loss at its output: one (B, m) float64 tensor per group of that key,
    ``c_bj = Σ_t (Bᵀ g_bt)_j (A x_bt)_j``, latent j's share of ``∇ℓ_b · (W x_b)`` for row b's own mean loss.
    Each group's factors are cast once to the projection's device, in float32.
    """

    def __init__(self, groups: Mapping[tuple[int, str], Sequence[GroupFactors]]):
        self.groups = groups
        self._cast: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, key: tuple[int, str], x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
        if key not in self._cast:
            self._cast[key] = [
                (f.up.to(x.device, torch.float32), f.down.to(x.device, torch.float32))
                for f in self.groups[key]
            ]
        g = g.float() * x.shape[0]  # ∂(row b's mean loss) = B · ∂(batch mean loss)
        x = x.float()
        out = []
        for j, (up, down) in enumerate(self._cast[key]):
            w = up.shape[0]
            out.append(((g[..., j * w : (j + 1) * w] @ up) * (x @ down.T)).sum(1).double().cpu())
        return out


def collect_kl_response(
    model: nn.Module,
    rows: torch.Tensor,
    factors: Sequence[LayerFactors],
    *,
    batch_size: int = 8,
    sampled: bool = True,
    draws: int = 1,
    seed: int = 0,
    progress: Progress = None,
) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Every group's second-order KL curve, ``curves[layer][kind]`` (G, m + 1) float64, ``KL[r]`` at rank r.

    Parameters
    ----------
    rows : (N, T) calibration token ids (unpadded).
    factors : every layer's full-spectrum factors, in layer order.
    sampled : targets drawn from the model's own predictions (``KL ≈ ½ δᵀFδ``); else the rows' next tokens.
    draws : label draws per row (each row is repeated ``draws`` times).

    Returns
    -------
    curves, and the number of (row, draw) samples averaged.
    """
    sums, n = sum_kl_response(
        model,
        rows,
        factors,
        batch_size=batch_size,
        sampled=sampled,
        draws=draws,
        seed=seed,
        progress=progress,
    )
    return kl_curves(sums, n, rows.shape[1] - 1), n


def sum_kl_response(
    model: nn.Module,
    rows: torch.Tensor,
    factors: Sequence[LayerFactors],
    *,
    batch_size: int = 8,
    sampled: bool = True,
    draws: int = 1,
    seed: int = 0,
    first_row: int = 0,
    progress: Progress = None,
) -> tuple[list[dict[str, torch.Tensor]], int]:
    """The sums of :func:`collect_kl_response`, ``sums[layer][kind]`` (G, m + 1) float64, ``Σ_rows (Σ_{j≥r}
    c_j)²``, and the number of (row, draw) samples summed. Draw d of row i (i counted from ``first_row``) is
    seeded by ``seed`` and ``i · draws + d``, whatever the batches or shards."""
    shape = get_adapter(model.config).shape(model.config)
    if len(factors) != shape.L or [f.layer for f in factors] != list(range(shape.L)):
        raise ValueError(f"kl_response needs the factors of layers 0..{shape.L - 1} in order")
    rows = rows.repeat_interleave(draws, dim=0) if sampled else rows
    groups = {(f.layer, kind): f.groups[kind] for f in factors for kind in KINDS}
    sums = {key: torch.zeros(len(g), g[0].max_rank + 1, dtype=torch.float64) for key, g in groups.items()}
    products = LatentProducts(groups)

    def visit(layer: int, kind: str, x: torch.Tensor, g: torch.Tensor) -> None:
        for j, c in enumerate(products((layer, kind), x, g)):  # c: (B, m)
            tail = c.flip(-1).cumsum(-1).flip(-1)  # Σ_{j≥r} c_j for r = 0..m−1; r = m is 0
            sums[(layer, kind)][j, :-1] += tail.square().sum(0)

    n, _ = kv_gradient_passes(
        model,
        rows,
        visit,
        batch_size=batch_size,
        progress=progress,
        targets=row_seeded_targets(seed, first_row * draws) if sampled else None,
    )
    return [{kind: sums[(i, kind)] for kind in KINDS} for i in range(shape.L)], n


def kl_curves(sums: list[dict[str, torch.Tensor]], n: int, scored: int) -> list[dict[str, torch.Tensor]]:
    """``KL(r) = (T − 1)/2 · mean_rows (Σ_{j≥r} c_j)²`` from the sums over ``n`` samples of ``scored`` = T − 1
    tokens each."""
    scale = scored / (2 * n)
    return [{kind: layer[kind] * scale for kind in KINDS} for layer in sums]
