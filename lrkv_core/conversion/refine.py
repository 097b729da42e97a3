"""Refine a rank plan on the model's measured loss: Gauss–Newton steps with the other groups already cut.

Every allocator prices each group alone, as if every other group kept its full rank. Once many groups are
cut (low ratios) they interact: a layer's cut changes the inputs of later layers and how much later errors
matter. Refinement starts from a plan P (any allocator's) and minimises J(P), measured with the model cut to
P on some calibration rows. Two objectives:

- ``nll``: the loss of the rows' own next tokens, ``J(P) = −mean_t log q_t(x_{t+1})``, what perplexity
  measures. On SmolLM2 it tracks the held-out rise of close plans better than the KL (docs/allocation.md:
  objective); it fits the plan to the calibration text's domain.
- ``kl``: the KL from the original's next-token distribution, ``J(P) = mean_t KL(p_t ‖ q_t)``, the
  allocator ``kl``'s own objective: it keeps the model close to the original on any text.

One step: with every group cut to P (dense truncated weights ``B_{:r} A_{:r}``, the same outputs as the fused
latent model), for each group and each rank r near its current r_P, to second order

    J(P with this group at r) − J(P) ≈ ∇J · Δ(r) + ½ Δ(r)ᵀ F Δ(r),   Δ(r) = (W_r − W_{r_P}) x

where ∇J is the gradient of the cross-entropy against the rows' tokens or the original's probabilities (one
backward pass) and F the Fisher of the cut model (a second backward pass through the same forward pass,
targets sampled from its own predictions, as :mod:`lrkv_core.statistics.response`, each row's from a
generator seeded by the seed, the step and the row, so the micro-batch size does not change the draws).
Both are latent prefix sums of :class:`LatentProducts`, so one forward and two backward passes price every
(group, rank). The new plan minimises the summed prices within the budget and no narrower than P (the exact
knapsack), each group moving at most ``radius`` rank steps; it is kept only if its measured J is lower on
the calibration rows after the pricing rows, which the step was not priced on (``accept_rows``, 32 by
default; with ``accept_rows: 0``, on the pricing rows themselves), otherwise the radius halves and the step
is solved again on the same prices (a trust region). Each of the two sets of rows holds at most ``tokens``
tokens (32 rows of 256 by default, 4 of 2,048), so a step on long calibration rows costs about what it costs
on short ones.

The pass that prices a plan measures its J on the way (the loss of its first backward pass is J, up to the
original's entropy for the KL, which the pass adds up too). So with ``accept_rows: 0`` a candidate plan is
measured by the pass that prices the step after it: kept, those are the next step's prices; rejected, they
are dropped. Cost per step: one forward and two backward passes over the pricing rows and a forward pass
over the accepting rows (with ``accept_rows: 0``, the last step's candidate a forward pass alone). The KL
also needs the original's predictions, whose hidden states are computed once per row and kept
(:class:`OriginalHidden`, up to a memory budget). J is that of the cut weights: a quantized latent cache adds
its rounding on top, which the refinement does not see.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from ..allocation import RankPlan
from ..allocation.knapsack import minimize_separable
from ..allocation.problem import KINDS, RankProblem, Ranks
from ..model.adapters import get_adapter
from ..registry import Section
from ..statistics.gradients import (
    Draw,
    Targets,
    last_hidden,
    next_token_log_probs,
    row_seed,
    row_seeded_targets,
    shared_gradient_passes,
)
from ..statistics.response import LatentProducts

if TYPE_CHECKING:
    from ..decompositions import LayerFactors

Key = tuple[int, str]  # (layer, "k"|"v")
REFINE_ROWS = 32  # calibration rows each step is priced on (docs/long-context.md: calibration time)
REFINE_ACCEPT_ROWS = 32  # the rows after them each step is kept or rejected on (docs/long-context.md)
# the most tokens the pricing rows, and the accepting rows, hold: 32 rows of 256 (docs/long-context.md)
REFINE_TOKENS = 32 * 256
REFINE_RADIUS = 4  # rank steps a group may move in one step (docs/allocation.md: radius)
REFINE_OBJECTIVE = "nll"  # what the refinement lowers on its rows, "nll" or "kl" (docs/allocation.md)
ORIGINAL_BYTES = 128 * 2**20  # the most memory the original's kept hidden states take (the rest recomputed)


@dataclasses.dataclass(frozen=True)
class RefineConfig(Section):
    """How a conversion refines the allocator's plan (the module doc): the ``refine`` section of
    :class:`lrkv_core.conversion.convert.CompressionConfig` and of a recipe's ``compression`` (one definition:
    a recipe validates this class itself). A new option is a field here, read by :func:`refine_plan`."""

    label: ClassVar[str] = "refine"

    steps: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Gauss–Newton steps refining the allocator's plan on the measured objective (each kept "
            "only if it lowers it); 0: the allocator's plan; null: the allocator's default (kl: 3, the "
            "others: 0)"
        },
    )
    rows: int = dataclasses.field(
        default=REFINE_ROWS,
        metadata={"help": "calibration rows (the first) each step is priced on (all of them when fewer)"},
    )
    radius: int = dataclasses.field(
        default=REFINE_RADIUS,
        metadata={
            "help": "rank steps (of rank_multiple) one refinement step may move each group; halved after a "
            "step that does not lower the objective"
        },
    )
    accept_rows: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "calibration rows after the first `rows` on which each step is accepted or rejected "
            f"(0: the rows that priced it; null: {REFINE_ACCEPT_ROWS}, at most half the calibration rows, "
            "the pricing rows then fewer where there are not enough for both)"
        },
    )
    tokens: int | None = dataclasses.field(
        default=REFINE_TOKENS,
        metadata={
            "help": "the most calibration tokens the pricing rows hold, and the accepting rows: rows of T "
            f"tokens are capped at max(1, tokens // T) each ({REFINE_TOKENS:,}: 32 rows of 256, 4 of "
            "2,048), so long rows cost a step no more than short ones; null: rows and accept_rows alone"
        },
    )
    objective: Literal["kl", "nll"] = dataclasses.field(
        default=REFINE_OBJECTIVE,
        metadata={
            "help": "what the refinement lowers on its rows: nll, the loss of the rows' own next tokens; kl, "
            "the KL to the original's next-token distribution"
        },
    )

    def __post_init__(self) -> None:
        if self.accept_rows is not None and self.accept_rows < 0:
            raise ValueError(f"refine accept_rows must be ≥ 0, got {self.accept_rows}")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"refine tokens must be ≥ 1 or null, got {self.tokens}")
        if (self.steps is not None and self.steps < 0) or self.rows < 1 or self.radius < 1:
            raise ValueError(
                "refine steps must be ≥ 0, refine rows and radius ≥ 1, got "
                f"{self.steps}, {self.rows}, {self.radius}"
            )
        _check(self.objective)

    def split(self, n_rows: int, seq_len: int | None = None) -> tuple[int, int]:
        """How many of ``n_rows`` calibration rows of ``seq_len`` tokens price each step (the first) and how
        many after them accept it (0: the pricing rows do), each capped by ``tokens`` (none without
        ``seq_len``). A set ``accept_rows`` must fit after ``rows`` (a clear error otherwise); the default
        accepts on 32 rows, at most half of them, and prices on up to ``rows`` of those before."""
        cap = n_rows if self.tokens is None or seq_len is None else max(1, self.tokens // seq_len)
        rows = min(self.rows, cap)
        if self.accept_rows is None:
            accept = min(REFINE_ACCEPT_ROWS, n_rows // 2, cap)
            return min(rows, n_rows - accept), accept
        accept_rows = min(self.accept_rows, cap)
        if accept_rows and rows + accept_rows > n_rows:
            raise ValueError(
                f"refine accepts on {accept_rows} rows after the first {rows}: it needs "
                f"{rows + accept_rows} calibration rows, got {n_rows}"
            )
        return min(rows, n_rows), accept_rows


class PlanWeights:
    """The model's k/v projection weights: the original's, and those of a plan (truncated factors)."""

    def __init__(self, model: nn.Module, factors: Sequence[LayerFactors]):
        adapter = get_adapter(model.config)
        self.factors = {(f.layer, kind): f.groups[kind] for f in factors for kind in KINDS}
        self.proj = {  # the weight's rows (Phi-3's fused qkv_proj: the k or v rows)
            key: adapter.linear(adapter.attention(model, key[0]), key[1], model.config)
            for key in self.factors
        }
        self.original = {key: p.weight.detach().clone() for key, p in self.proj.items()}
        self._last: tuple[Ranks, dict[Key, torch.Tensor]] | None = None  # the last plan's weights

    @torch.no_grad()
    def cut(self, ranks: Ranks) -> None:
        """Set every k/v weight to its groups' first r latents, ``B_{:r} A_{:r}`` stacked over groups."""
        if self._last is None or self._last[0] != ranks:  # built once per plan, not once per batch
            built = {}
            for (layer, kind), groups in self.factors.items():
                rs = ranks[kind][layer]
                weight = torch.cat([g.up[:, :r].double() @ g.down[:r].double() for g, r in zip(groups, rs)])
                built[(layer, kind)] = weight.to(self.original[(layer, kind)].dtype)
            self._last = (
                {kind: [list(layer) for layer in rs] for kind, rs in ranks.items()},
                built,
            )  # a copy
        for key, weight in self._last[1].items():
            self.proj[key].weight.copy_(weight)

    @torch.no_grad()
    def restore(self) -> None:
        for key, p in self.proj.items():
            p.weight.copy_(self.original[key])


class OriginalHidden:
    """The original model's last hidden states (B, T, d) of each micro-batch of ``rows`` (N, T): computed
    once (weights restored first) and kept while they fit in ``budget`` bytes, the rest computed again at
    each use, so the KL objective's passes run the original's decoder stack once per row for a whole
    refinement instead of twice per step. The same values either way (the same forward of the same batch).
    """

    def __init__(
        self, model: nn.Module, weights: PlanWeights, rows: torch.Tensor, batch_size: int, budget: int
    ):
        self.model, self.weights, self.rows, self.batch_size = model, weights, rows, batch_size
        self.budget, self.used = budget, 0
        self.kept: dict[int, torch.Tensor] = {}
        self.computed = 0  # forwards run, for the tests' count

    def __call__(self, start: int) -> torch.Tensor:
        """The hidden states of the micro-batch starting at row ``start`` (the weights may be left
        restored)."""
        if start in self.kept:
            return self.kept[start]
        device = next(self.model.parameters()).device
        self.weights.restore()
        with torch.no_grad():
            hidden = last_hidden(self.model, self.rows[start : start + self.batch_size].to(device))
        self.computed += 1
        size = hidden.numel() * hidden.element_size()
        if self.used + size <= self.budget:
            self.kept[start], self.used = hidden, self.used + size
        return hidden


def _original(
    model: nn.Module,
    weights: PlanWeights,
    rows: torch.Tensor,
    batch_size: int,
    original: OriginalHidden | None,
) -> OriginalHidden:
    """``original`` if it holds ``rows`` in micro-batches of ``batch_size``, else a fresh one keeping none."""
    if original is not None and original.rows is rows and original.batch_size == batch_size:
        return original
    return OriginalHidden(model, weights, rows, batch_size, budget=0)


def single_cut(factors: Sequence[LayerFactors], layer: int, kind: str, group: int, rank: int) -> Ranks:
    """The plan that keeps every group at full rank but one, cut to ``rank``."""
    ranks = {k: [[g.max_rank for g in f.groups[k]] for f in factors] for k in KINDS}
    ranks[kind][layer][group] = rank
    return ranks


def measured_nll(
    model: nn.Module,
    weights: PlanWeights,
    ranks: Ranks,
    rows: torch.Tensor,
    batch_size: int,
    original: OriginalHidden | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> float:
    """Mean per-token negative log-likelihood of ``rows``' own next tokens, the model cut to ranks, nats
    (the full-vocabulary log-probabilities of a few hundred positions at a time). ``original`` is not read
    (the signature of every objective). ``progress(rows done, rows)`` after each micro-batch."""
    total, n = 0.0, 0
    device = next(model.parameters()).device
    weights.cut(ranks)
    with torch.no_grad():
        for start in range(0, rows.shape[0], batch_size):
            batch = rows[start : start + batch_size].to(device)
            for at, q in next_token_log_probs(model, last_hidden(model, batch)):
                total -= float(q.gather(-1, batch[:, at + 1 : at + 1 + q.shape[1], None]).sum())
            n += batch.shape[0] * (batch.shape[1] - 1)
            if progress:
                progress(start + batch.shape[0], rows.shape[0])
    return total / n


def measured_kl(
    model: nn.Module,
    weights: PlanWeights,
    ranks: Ranks,
    rows: torch.Tensor,
    batch_size: int,
    original: OriginalHidden | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> float:
    """Mean per-token ``KL(original ‖ cut to ranks)`` over ``rows`` (N, T), nats (each model's last hidden
    states, the original's from ``original`` where it holds these rows, then both distributions a few
    hundred positions at a time). ``progress(rows done, rows)`` after each micro-batch."""
    total, n = 0.0, 0
    device = next(model.parameters()).device
    states = _original(model, weights, rows, batch_size, original)
    with torch.no_grad():
        for start in range(0, rows.shape[0], batch_size):
            batch = rows[start : start + batch_size].to(device)
            kept = states(start)
            weights.cut(ranks)
            cut = last_hidden(model, batch)
            for (_, p), (_, q) in zip(
                next_token_log_probs(model, kept), next_token_log_probs(model, cut), strict=True
            ):
                total += float((p.exp() * (p - q)).sum())
            n += batch.shape[0] * (batch.shape[1] - 1)
            if progress:
                progress(start + batch.shape[0], rows.shape[0])
    return total / n


def measuring_targets(
    total: list[float], log_probs: Iterator[tuple[int, torch.Tensor]] | None = None
) -> Targets:
    """The gradient pass's targets for one micro-batch that add the objective of its rows to ``total[0]``
    as the loss reaches each chunk: with ``log_probs`` (the original's next-token log-probabilities,
    :func:`~lrkv_core.statistics.gradients.next_token_log_probs` of its hidden states) their probabilities,
    adding ``Σ p (log p − log q)`` (the KL's sum); without, the rows' own next tokens, adding ``−Σ log q``
    (the NLL's sum). The sums :func:`measured_kl` and :func:`measured_nll` take, chunk by chunk."""

    def for_batch(batch: torch.Tensor) -> Draw:
        def draw(logits: torch.Tensor, start: int) -> torch.Tensor:
            q = torch.log_softmax(logits, dim=-1)
            if log_probs is None:
                wanted = batch[:, start + 1 : start + 1 + logits.shape[1]].to(q.device)
                total[0] -= float(q.gather(-1, wanted[..., None]).sum())
                return wanted
            at, log_p = next(log_probs)
            if at != start or log_p.shape[1] != logits.shape[1]:
                raise RuntimeError(f"the original's chunk at {at} does not match the loss's at {start}")
            p = log_p.exp()
            total[0] += float((p * (log_p - q)).sum())
            return p

        return draw

    return for_batch


def step_costs(
    model: nn.Module,
    weights: PlanWeights,
    ranks: Ranks,
    rows: torch.Tensor,
    *,
    batch_size: int,
    seed: int,
    objective: str = "kl",
    original: OriginalHidden | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[Key, torch.Tensor], float]:
    """The prices of a step from ``ranks``, and J of ``ranks`` on ``rows``, from one forward and two
    backward passes. Prices: per (layer, kind), (G, m + 1) float64, the estimated change of J when that group
    alone goes from its rank in ``ranks`` to each rank r (0 at its own rank), every other group staying cut.
    J is the KL to the original (``objective="kl"``; its hidden states from ``original`` where it holds these
    rows) or the rows' own next-token loss (``"nll"``), as :func:`measured_kl` or :func:`measured_nll` gives
    it (up to the order of float sums), added up by the first backward pass's targets
    (:func:`measuring_targets`). ``seed`` seeds the curvature pass's draws, per row
    (:func:`~lrkv_core.statistics.gradients.row_seeded_targets`). ``progress(rows done, rows)`` after each
    micro-batch."""
    _check(objective)
    lin = {key: torch.zeros(len(g), g[0].max_rank, dtype=torch.float64) for key, g in weights.factors.items()}
    quad = {
        key: torch.zeros(len(g), g[0].max_rank + 1, dtype=torch.float64) for key, g in weights.factors.items()
    }
    products = LatentProducts(weights.factors)

    def visit_gradient(layer: int, kind: str, x: torch.Tensor, g: torch.Tensor) -> None:
        for j, c in enumerate(products((layer, kind), x, g)):
            lin[(layer, kind)][j] += c.sum(0)

    def visit_curvature(layer: int, kind: str, x: torch.Tensor, g: torch.Tensor) -> None:
        for j, c in enumerate(products((layer, kind), x, g)):
            prefix = torch.cat([torch.zeros(c.shape[0], 1, dtype=torch.float64), c.cumsum(-1)], dim=-1)
            r = ranks[kind][layer][j]
            quad[(layer, kind)][j] += (prefix - prefix[:, r : r + 1]).square().sum(0)

    curvature = row_seeded_targets(seed)  # counts the rows it has drawn for, across the batches below
    total = [0.0]  # J's sum over the rows' scored positions
    if objective == "nll":  # the rows' own next tokens
        weights.cut(ranks)
        n, _ = shared_gradient_passes(
            model,
            rows,
            [(visit_gradient, measuring_targets(total)), (visit_curvature, curvature)],
            batch_size=batch_size,
            progress=progress,
        )
    else:
        states = _original(model, weights, rows, batch_size, original)
        n = 0
        for start in range(0, rows.shape[0], batch_size):  # one batch at a time: the original's predictions
            batch = rows[start : start + batch_size]
            kept = states(start)
            weights.cut(ranks)
            targets = measuring_targets(total, next_token_log_probs(model, kept))  # the original's
            seen, _ = shared_gradient_passes(
                model, batch, [(visit_gradient, targets), (visit_curvature, curvature)], batch_size=batch_size
            )
            n += seen
            if progress:
                progress(start + batch.shape[0], rows.shape[0])
    scale = (rows.shape[1] - 1) / (2 * n)
    costs = {}
    for key, groups in weights.factors.items():
        layer, kind = key
        prefix = torch.cat(
            [torch.zeros(len(groups), 1, dtype=torch.float64), (lin[key] / n).cumsum(-1)], dim=-1
        )
        at = torch.tensor(ranks[kind][layer])[:, None]
        costs[key] = prefix - prefix.gather(1, at) + scale * quad[key]
    return costs, total[0] / (n * (rows.shape[1] - 1))


def refine_plan(
    model: nn.Module,
    factors: Sequence[LayerFactors],
    plan: RankPlan,
    rows: torch.Tensor,
    config: RefineConfig | Mapping[str, Any],
    *,
    batch_size: int = 8,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    original_bytes: int = ORIGINAL_BYTES,
    measure_while_pricing: bool = True,
) -> RankPlan:
    """The plan after up to ``config.steps`` accepted-or-rejected Gauss–Newton steps on the measured
    ``config.objective`` (``nll`` or ``kl``), priced on the first rows of ``rows`` (N, T) and accepted on
    the rows after them (on the pricing rows when none), as :meth:`RefineConfig.split` divides them (see the
    module doc); the model is left as it was. Its details gain ``refine``: the rows, the objective, and its
    measured value on the accepting rows before and after each step (under its name) and whether it was
    kept. Never above the plan's budget, never a higher measured objective on the accepting rows than the
    plan's. The KL objective keeps the original's hidden states of up to ``original_bytes``
    (:class:`OriginalHidden`): the same plan, fewer forwards. ``measure_while_pricing`` (with
    ``accept_rows: 0``): each candidate is measured by the pass that prices
    the next step (the module doc); off, by a forward pass of its own and every step priced afresh (a step
    after a rejection then draws its curvature anew): the same plan where every step is kept.
    ``progress(rows done, rows planned)`` after each micro-batch of every pass, over the rows of the passes
    all ``config.steps`` would make (fewer when a step stops the search early)."""
    config = RefineConfig.create(config)
    if config.steps is None:
        raise ValueError("refine needs a number of steps (the conversion resolves the allocator's default)")
    steps, radius, objective = config.steps, config.radius, config.objective
    measure = OBJECTIVES[objective]
    if rows.ndim != 2 or rows.shape[0] < 1 or rows.shape[1] < 2:
        raise ValueError(f"refine needs (N, T) calibration rows with T ≥ 2, got {tuple(rows.shape)}")
    n_priced, n_accept = config.split(*rows.shape)
    rows, accept = rows[:n_priced], rows[n_priced : n_priced + n_accept]
    if not n_accept:
        accept = rows
    spectra = [f.spectra() for f in factors]
    problem = RankProblem(spectra, plan.group_width, plan.target_ratio, plan.rank_multiple)
    ranks = plan.ranks
    if steps == 0 or all(r == s.max_rank for r, s in zip(_flat(problem, ranks), problem.groups)):
        return plan
    weights = PlanWeights(model, factors)
    priced = OriginalHidden(model, weights, rows, batch_size, original_bytes)
    accepting = (
        priced if accept is rows else OriginalHidden(model, weights, accept, batch_size, original_bytes)
    )
    if objective != "kl":
        priced.budget = accepting.budget = 0  # the loss of the rows' own tokens never reads the original
    shared = measure_while_pricing and accept is rows
    # progress counts the rows of every pass a run of all the steps makes: one pricing pass each and a
    # measuring one each, the start's included (shared: one pass each, the start's pricing included)
    planned = (steps + 1) * len(rows) if shared else steps * len(rows) + (steps + 1) * len(accept)
    done = [0]

    def rows_done() -> Callable[[int, int], None] | None:  # for the pass that starts now
        if progress is None:
            return None
        before = done[0]

        def report(rows_of_pass: int, _: int) -> None:
            done[0] = before + rows_of_pass
            progress(done[0], planned)

        return report

    def price(plan_ranks: Ranks, step: int) -> tuple[dict[Key, torch.Tensor], float]:
        return step_costs(
            model,
            weights,
            plan_ranks,
            rows,
            batch_size=batch_size,
            seed=row_seed(seed, step),
            objective=objective,
            original=priced,
            progress=rows_done(),
        )

    try:
        costs: dict[Key, torch.Tensor] | None = None  # the prices of the current plan, where known
        if shared:
            costs, value = price(ranks, 0)
        else:
            value = measure(model, weights, ranks, accept, batch_size, accepting, rows_done())
        history = [{objective: value}]
        for step in range(steps):
            if costs is None:
                costs, _ = price(ranks, step)
            current = _flat(problem, ranks)
            bounded = []
            for spec, r in zip(problem.groups, current):
                cost = costs[(spec.layer, spec.kind)][spec.index].clone()
                cost[(torch.arange(cost.numel()) - r).abs() > radius * problem.rank_multiple] = math.inf
                bounded.append(cost)
            flat, estimate = minimize_separable(problem, bounded, at_least=sum(current))  # never narrower
            moved = sum(abs(a - b) for a, b in zip(flat, current))
            if moved == 0:  # no move is estimated to help: a smaller radius offers none either
                break
            candidate = problem.nest(flat)
            next_costs = None  # the candidate's prices: the next step's if it is kept
            if shared and step + 1 < steps:
                next_costs, new_value = price(candidate, step + 1)
            else:
                new_value = measure(model, weights, candidate, accept, batch_size, accepting, rows_done())
            kept = new_value < value
            history.append(
                {objective: new_value, "estimate": estimate, "radius": radius, "moved": moved, "kept": kept}
            )
            if kept:
                ranks, value, costs = candidate, new_value, next_costs
            elif radius == 1:
                break
            else:
                radius //= 2  # shared: solved again on the current plan's prices
                if not shared:
                    costs = None  # priced afresh at the next step
    finally:
        weights.restore()
    record = {
        "rows": rows.shape[0],
        "accept_rows": n_accept,
        "objective": objective,
        "steps": history,
    }
    details = plan.details | {"refine": record}
    return replace(plan, ranks=ranks, details=details)


OBJECTIVES = {"kl": measured_kl, "nll": measured_nll}  # what a refinement lowers (module doc)


def _check(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise ValueError(f"refine objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    return objective


def _flat(problem: RankProblem, ranks: Ranks) -> list[int]:
    return [ranks[s.kind][s.layer][s.index] for s in problem.groups]
