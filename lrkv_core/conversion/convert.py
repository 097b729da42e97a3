"""The in-memory API: ``convert(model, calibration, config) -> model``, and the steps it chains.

One conversion is: collect the calibration statistics the chosen methods need → decompose every layer
(full spectrum) → summarise each layer (spectra + the allocator's features) → plan ranks for the budget →
fuse the truncated factors into the model. :func:`convert` runs them in memory; the Prefect flow runs the
same steps as cached tasks through :mod:`lrkv_core.conversion.pipeline`, and tests and benchmarks call these
functions directly.

    model = lrkv_core.convert(model, rows, CompressionConfig(ratio=0.5, allocator="eigen"))
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from ..allocation import (
    ALLOCATORS,
    DEFAULT_ALLOCATOR,
    FEATURES,
    Allocator,
    LayerSummary,
    RankPlan,
    plan_from_summaries,
    summarize_layer,
)
from ..allocation.problem import budget_width, check_one_step_fits
from ..cache import CACHE_STORAGES, CacheStorage
from ..decompositions import (
    DECOMPOSITIONS,
    KEY_LATENTS,
    Decomposition,
    LayerFactors,
    LayerWeights,
    decompose_layer,
)
from ..linalg import group_slices
from ..model.adapters import get_adapter
from ..model.attention_rotated import check_rotated_keys, rotated_key_inputs
from ..model.fuse import compress_model
from ..quant.rotation import RotationConfig
from ..statistics import STATISTICS, LayerValue, Statistic
from ..statistics.joint import collect_joint
from ..statistics.precision import calibration_precision
from .refine import RefineConfig, refine_plan
from .steps import (
    Step,
    StepGraph,
    build_params,
    conversion_steps,
    decompose_step,
    statistic_inputs,
    statistic_step,
    summarize_step,
)

Progress = Callable[[int, int], None] | None
# the largest group of KV heads picked when the group size is left to lrkv (see resolve_group_size)
AUTO_GROUP_LIMIT = 4


@dataclass(frozen=True)
class CompressionConfig:
    """What one conversion does; the in-memory twin of a recipe's ``compression`` section.

    Parameters
    ----------
    ratio : kept fraction of the KV width, in (0, 1]: 0.5 halves the cache.
    group_size : KV heads decomposed together (1 = per head, Hkv = joint); None lets
        :func:`resolve_group_size` pick one for the model.
    rank_multiple : ranks are rounded down to multiples of this (or a group's max rank).
    decomposition, allocator : registered methods, by name, recipe form or instance.
    statistics : options for calibration statistics (by name, recipe form or instance); statistics not
        listed that a method needs are collected with their defaults.
    cache : the cache storage the compressed model uses (a registered strategy: name, recipe form or
        instance, e.g. ``{"name": "quantized", "bits": 3}``); recorded in the model-format section, so
        loading rebuilds the same cache.
    rotation : the orthogonal rotation fused into each group's factors (:mod:`lrkv_core.quant.rotation`) to
        spread latents before quantization, a :class:`~lrkv_core.quant.rotation.RotationConfig`, its mapping
        form or its policy's name (``none``, ``hadamard`` or ``auto``; its ``seed`` seeds the random
        orthogonal matrices ``auto`` uses where no Hadamard matrix of the rank exists).
    key_latents : ``"rebuilt"`` (the default: latents of the keys before RoPE, keys rebuilt and rotated at
        attention, Palu's form) or ``"rotated"`` (latents of the keys after RoPE in a RoPE-equivariant basis
        weighted by the queries, which absorb the key up-projection: no key rebuilt, no positions cached;
        RoPE models without QK-norm, one RoPE for every layer). Ranks are planned and refined on the keys the
        model caches either way (with ``rotated``, the equivariant basis on k_proj's input).
    refine : how the allocator's plan is refined on calibration rows, a
        :class:`~lrkv_core.conversion.refine.RefineConfig` or its mapping form (``{"steps": 0}`` keeps the
        allocator's plan); its ``steps`` of None (the default) resolves to the allocator's own default
        (``kl``: 3, the others: 0).
    """

    # A recipe's ``compression`` section is built from these fields (defaults, and ``help`` as descriptions;
    # lrkv_tasks.recipes.convert_recipe gives the method fields their recipe types), so they are defined once.
    ratio: float = field(
        default=0.5, metadata={"help": "compressed KV width / original; 0.5 halves the cache"}
    )
    group_size: int | None = field(
        default=None,
        metadata={"help": "KV heads decomposed together: 1 = M-LRD, Hkv = J-LRD; auto = min(Hkv, 4)"},
    )
    rank_multiple: int = field(default=8, metadata={"help": "ranks are rounded down to multiples of this"})
    decomposition: Decomposition | str | Mapping[str, Any] = "whitened"
    allocator: Allocator | str | Mapping[str, Any] = DEFAULT_ALLOCATOR
    statistics: Sequence[Statistic | str | Mapping[str, Any]] = field(
        default=(),
        metadata={"help": "options of calibration statistics, e.g. [{name: fisher, per_row: false}]"},
    )
    cache: CacheStorage | str | Mapping[str, Any] = "dense"
    rotation: RotationConfig | str | Mapping[str, Any] = field(
        default=RotationConfig(),
        metadata={"help": "the rotation fused into each group's factors: a name, or {name: auto, seed: 1}"},
    )
    refine: RefineConfig | Mapping[str, Any] = field(
        default=RefineConfig(),
        metadata={"help": "how the allocator's plan is refined on calibration rows (steps 0: kept)"},
    )
    key_latents: str = field(
        default="rebuilt",
        metadata={
            "help": "latents of keys before RoPE, rebuilt at attention (rebuilt), or of rotated keys that "
            "queries read directly (rotated)"
        },
    )

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")
        if self.rank_multiple < 1:
            raise ValueError(f"rank multiple must be ≥ 1, got {self.rank_multiple}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group size must be ≥ 1, got {self.group_size}")
        if self.key_latents not in KEY_LATENTS:
            raise ValueError(f"key_latents must be one of {', '.join(KEY_LATENTS)}, got {self.key_latents!r}")
        if self.key_latents == "rotated" and self.rank_multiple % 2:
            raise ValueError(
                f"latents of rotated keys take even ranks (RoPE pairs): the rank multiple must be even, "
                f"got {self.rank_multiple}"
            )
        object.__setattr__(self, "decomposition", DECOMPOSITIONS.create(self.decomposition))
        object.__setattr__(self, "allocator", ALLOCATORS.create(self.allocator))
        refine = RefineConfig.create(self.refine)
        if refine.steps is None:
            refine = replace(refine, steps=self.allocator.refine_steps)
        object.__setattr__(self, "refine", refine)
        stats = tuple(STATISTICS.create(s) for s in self.statistics)
        if len({s.name for s in stats}) != len(stats):
            raise ValueError("each statistic may be configured once")
        object.__setattr__(self, "statistics", stats)
        object.__setattr__(self, "cache", CACHE_STORAGES.create(self.cache))
        object.__setattr__(self, "rotation", RotationConfig.create(self.rotation))
        self.cache.check_rotation(self.rotation.name)

    @property
    def refines(self) -> bool:
        """Whether a conversion refines the allocator's plan: refine steps asked for and something to cut."""
        return self.refine.steps > 0 and self.ratio < 1

    def features(self) -> frozenset[str]:
        """Per-group features the allocator reads besides the spectra: none at ratio 1.0, where every group
        keeps its max rank (:meth:`~lrkv_core.allocation.base.Allocator.run`)."""
        return self.allocator.needs if self.ratio < 1 else frozenset()

    def needed_statistics(self) -> list[Statistic]:
        """The statistics the decomposition and the allocator's features read, configured or default."""
        names = set(self.decomposition.needs) | ({"gram"} if self.key_latents == "rotated" else set())
        for feature in self.features():
            if feature not in FEATURES:
                raise ValueError(f"allocator {self.allocator.name!r} needs unknown feature {feature!r}")
            names |= FEATURES[feature].statistics
        configured = {s.name: s for s in self.statistics}
        return [configured.get(name) or STATISTICS.create(name) for name in sorted(names)]

    def for_model(self, model_config: PretrainedConfig) -> CompressionConfig:
        """This config with the group size resolved, checked against a model's attention geometry.

        Raises a clear ``ValueError`` before any work when the group size does not divide the KV heads,
        the ratio and rank multiple leave some group at rank 0, or the cache storage cannot hold some rank
        the plan may give (ranks are multiples of the rank multiple, or a group's max rank: e.g. a
        quantization group size must divide both); the architecture must be supported.
        """
        adapter = get_adapter(model_config)
        shape = adapter.shape(model_config)
        if self.key_latents == "rotated":
            check_rotated_keys(adapter, model_config)
        group_size = resolve_group_size(self.group_size, shape.Hkv)
        group_slices(shape.Hkv, shape.D, group_size)  # raises with the valid sizes
        width = group_size * shape.D
        n_groups = 2 * shape.L * (shape.Hkv // group_size)
        need = n_groups * min(self.rank_multiple, width, shape.d)
        budget = budget_width(self.ratio, 2 * shape.L * shape.kv_width)
        check_one_step_fits(need, budget, self.ratio, self.rank_multiple, width)
        max_rank = min(width, shape.d)
        try:
            self.cache.check_ranks([min(self.rank_multiple, max_rank), max_rank])
        except ValueError as err:
            raise ValueError(
                f"{err}: ranks are multiples of the rank multiple ({self.rank_multiple}) or a group's max "
                f"rank ({max_rank}); choose a quantization group size dividing both"
            ) from None
        return replace(self, group_size=group_size)


def resolve_group_size(group_size: int | None, n_kv_heads: int) -> int:
    """``group_size`` if given, else the largest divisor of Hkv that is at most :data:`AUTO_GROUP_LIMIT`.

    Joint decomposition of more KV heads keeps more accuracy at a given ratio (Palu's J-LRD > G-LRD > M-LRD;
    lrkv's ablation agrees, see the README), while rebuilding each key from a wider group's latents costs
    more; Palu's choice of groups of 4 bounds that cost on large models, and models with at most 4 KV heads
    get the joint decomposition.
    """
    if group_size is not None:
        return group_size
    return max(s for s in range(1, min(n_kv_heads, AUTO_GROUP_LIMIT) + 1) if n_kv_heads % s == 0)


def collect_statistics(
    model: nn.Module,
    rows: torch.Tensor | None,
    statistics: Sequence[Statistic],
    *,
    batch_size: int = 8,
    progress: Progress = None,
    factors: Sequence[LayerFactors] | None = None,
) -> dict[str, list[LayerValue]]:
    """Every layer's value of each statistic over the calibration ``rows`` (N, T).

    ``factors`` (every layer's, in order) go to the statistics that read them (``uses_factors``)."""
    _require_rows(rows, statistics)
    out = {}
    for s in statistics:
        extra = {"factors": factors} if s.uses_factors else {}
        out[s.name] = s.collect(model, rows, batch_size=batch_size, progress=progress, **extra)[0]
    return out


def _require_rows(rows: torch.Tensor | None, statistics: Sequence[Statistic]) -> None:
    if statistics and rows is None:
        names = [s.name for s in statistics]
        raise ValueError(
            f"the chosen methods need calibration statistics {names}: pass calibration rows, or convert "
            "data-free with decomposition='plain' and allocator='uniform' or 'lorc'"
        )


@torch.no_grad()
def model_layer_weights(model: nn.Module, layer: int, reads: Collection[str] = ()) -> LayerWeights:
    """The layer's k/v projection weights (and those of ``reads``: "q", "o"), read from a loaded model, on
    the CPU: decompositions run there in float64 beside the statistics (collected on the model's device,
    returned on the CPU)."""
    adapter = get_adapter(model.config)
    attn = adapter.attention(model, layer)
    weights = {p: adapter.linear(attn, p, model.config).weight for p in {"k", "v", *reads}}
    return LayerWeights(**{p: w.detach().cpu() for p, w in weights.items()})


@dataclass
class Conversion:
    """A planned conversion: the resolved config, every layer's factors, the rank plan, and the step graph
    they came from. :meth:`apply` fuses as the config says (its cache storage and rotation), so
    ``replace(conversion, config=replace(conversion.config, rotation="auto"))`` applies the same plan
    rotated."""

    config: CompressionConfig
    factors: list[LayerFactors]
    summaries: list[LayerSummary]
    plan: RankPlan
    graph: StepGraph

    def apply(self, model: nn.Module) -> nn.Module:
        """Fuse the planned factors into ``model`` in place (see
        :func:`lrkv_core.model.fuse.compress_model`)."""
        return compress_model(model, self.factors, self.plan, **build_params(self.config))


def run_steps(
    model: nn.Module,
    calibration: torch.Tensor | None,
    steps: Sequence[Step],
    results: dict[str, Any] | None = None,
    *,
    batch_size: int = 8,
    progress: Progress = None,
    precision: str = "float32",
) -> dict[str, Any]:
    """Run ``steps`` (of a :func:`~lrkv_core.conversion.steps.conversion_steps` graph, in its order) in memory
    and return every step's result by name, ``results`` (those already at hand) included. A ``build`` step is
    not run here: :meth:`Conversion.apply` fuses. ``precision``: what the passes over the calibration rows
    compute the decoder stack in (:mod:`lrkv_core.statistics.precision`)."""
    with calibration_precision(precision):
        return _run_steps(model, calibration, steps, dict(results or {}), batch_size, progress)


def _run_steps(
    model: nn.Module,
    calibration: torch.Tensor | None,
    steps: Sequence[Step],
    results: dict[str, Any],
    batch_size: int,
    progress: Progress,
) -> dict[str, Any]:
    adapter = get_adapter(model.config)
    shape = adapter.shape(model.config)

    def stats_of(step: Step, layer: int) -> dict[str, LayerValue]:
        return {name: results[s][layer] for name, s in statistic_inputs(step).items()}

    for step in steps:
        p = step.params
        if step.kind == "statistics":
            stats = [STATISTICS.create(r) for r in p["statistics"]]
            _require_rows(calibration, stats)
            kw = dict(batch_size=batch_size, progress=progress)
            collected = collect_joint(stats, model, calibration, **kw)
            results[step.name] = {s.name: values for s, (values, _) in zip(stats, collected, strict=True)}
        elif step.kind == "pick":
            results[step.name] = results[step.inputs[0]][p["statistic"]["name"]]
        elif step.kind in ("statistic", "statistic_shard", "merge_statistic"):
            stat = STATISTICS.create(p["statistic"])
            _require_rows(calibration, [stat])
            if step.kind == "merge_statistic":
                results[step.name] = stat.merge([results[s] for s in step.inputs])[0]
                continue
            kw = dict(batch_size=batch_size, progress=progress)
            if stat.uses_factors:
                kw["factors"] = [results[s] for s in step.inputs]
            if step.kind == "statistic_shard":
                results[step.name] = stat.collect_shard(
                    model, calibration, shard=(p["shard"], p["count"]), **kw
                )
            else:
                results[step.name] = stat.collect(model, calibration, **kw)[0]
        elif step.kind == "decompose":
            method = DECOMPOSITIONS.create(p["decomposition"])
            layer, key_latents = p["layer"], p.get("key_latents", "rebuilt")
            extra, rotary_dim = rotated_key_inputs(adapter, model.config, key_latents)
            results[step.name] = decompose_layer(
                layer,
                model_layer_weights(model, layer, method.reads(adapter.rope) | extra),
                stats_of(step, layer),
                n_kv_heads=shape.Hkv,
                head_dim=shape.D,
                group_size=p["group_size"],
                decomposition=method,
                key_latents=key_latents,
                rotary_dim=rotary_dim,
            )
        elif step.kind == "summarize":
            layer = p["layer"]
            factors = results[step.inputs[0]]
            results[step.name] = summarize_layer(factors, stats_of(step, layer), p["features"])
        elif step.kind == "plan":
            summaries = [results[s] for s in step.inputs]
            results[step.name] = plan_from_summaries(summaries, head_dim=shape.D, **p)
        elif step.kind == "refine":
            if calibration is None:
                raise ValueError("the refinement measures the plan on its rows: pass calibration rows")
            *factors, plan = (results[s] for s in step.inputs)
            results[step.name] = refine_plan(model, factors, plan, calibration, p, batch_size=batch_size)
    return results


def _given(graph_statistics: Mapping[str, list[LayerValue]] | None) -> dict[str, list[LayerValue]]:
    return {statistic_step(name): values for name, values in (graph_statistics or {}).items()}


def decompose_model(
    model: nn.Module,
    calibration: torch.Tensor | None = None,
    config: CompressionConfig | None = None,
    *,
    statistics: Mapping[str, list[LayerValue]] | None = None,
    batch_size: int = 8,
    progress: Progress = None,
    precision: str = "float32",
) -> tuple[list[LayerFactors], dict[str, list[LayerValue]]]:
    """Every layer's full-spectrum factors, and the statistics by name: those given plus those the
    decomposition reads (collected here). The allocator's statistics are not collected: a plan needs them
    (:func:`plan_conversion`), factors alone do not.
    """
    config = (config or CompressionConfig()).for_model(model.config)
    n_layers = get_adapter(model.config).shape(model.config).L
    graph = conversion_steps(config, n_layers, given=list(statistics or {}))
    wanted, reading = set(), [decompose_step(layer) for layer in range(n_layers)]
    present = set(graph.names)  # (a given statistic has no step)
    while reading:  # the decompositions and every step they read, through joint collections
        name = reading.pop()
        if name in present and name not in wanted:
            wanted.add(name)
            reading += graph[name].inputs
    todo = [s for s in graph if s.name in wanted]
    kw = dict(batch_size=batch_size, progress=progress, precision=precision)
    results = run_steps(model, calibration, todo, _given(statistics), **kw)
    factors = [results[decompose_step(layer)] for layer in range(n_layers)]
    names = set(statistics or {}) | set(config.decomposition.needs)
    return factors, {name: results[statistic_step(name)] for name in names}


def plan_conversion(
    model: nn.Module,
    calibration: torch.Tensor | None = None,
    config: CompressionConfig | None = None,
    *,
    statistics: Mapping[str, list[LayerValue]] | None = None,
    batch_size: int = 8,
    progress: Progress = None,
    precision: str = "float32",
) -> Conversion:
    """Statistics, factors, summaries and the rank plan of ``model``, without changing it: the steps of
    :func:`~lrkv_core.conversion.steps.conversion_steps` but the last, run in memory.

    Parameters
    ----------
    calibration : (N, T) token ids, or None for data-free methods.
    statistics : already collected statistics by name (those given are not collected again).
    precision : what the passes over the calibration rows compute the decoder stack in, ``"float32"`` or
        ``"bfloat16"`` (:mod:`lrkv_core.statistics.precision`).
    """
    config = (config or CompressionConfig()).for_model(model.config)
    n_layers = get_adapter(model.config).shape(model.config).L
    graph = conversion_steps(config, n_layers, given=list(statistics or {}))
    kw = dict(batch_size=batch_size, progress=progress, precision=precision)
    results = run_steps(model, calibration, graph, _given(statistics), **kw)
    factors = [results[decompose_step(layer)] for layer in range(n_layers)]
    summaries = [results[summarize_step(layer)] for layer in range(n_layers)]
    return Conversion(config, factors, summaries, results[graph.result], graph)


def convert(
    model: nn.Module,
    calibration: torch.Tensor | None = None,
    config: CompressionConfig | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Compress ``model`` in place to a latent KV cache and return it (see :func:`plan_conversion`)."""
    return plan_conversion(model, calibration, config, **kwargs).apply(model)
