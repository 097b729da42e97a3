"""The conversion as a graph of steps: the one definition of what a conversion computes, from what.

:func:`conversion_steps` derives the graph from a :class:`~lrkv_core.conversion.convert.CompressionConfig` and
the model's layer count: the calibration statistics the chosen methods ``need`` → each layer's full-spectrum
factors → the statistics that read the factors → each layer's summary (spectra and the allocator's
features) → the rank plan → its refinement, when the config refines → the compressed model. Each
:class:`Step` names the steps it reads and carries the part of the config it depends on, as plain JSON.

Two executors run the same graph: :func:`lrkv_core.conversion.convert.plan_conversion` in memory, and the
convert flow, which submits each step as a cached Prefect task (a step's inputs are the futures of the steps
it reads, so independent steps run at once). Neither lists the steps itself.

A statistic whose collection can be split (:attr:`~lrkv_core.statistics.Statistic.shardable`) becomes
``shards`` steps over disjoint slices of the calibration rows plus one step that merges them, so several
workers share a whole-model pass; the merged value equals the one-pass value. Statistics collected in one
pass each that can share it (:attr:`~lrkv_core.statistics.Statistic.joint`; each on its own number of
rows) are collected together instead: one ``statistics`` step (:mod:`lrkv_core.statistics.joint`) and, for
each of them, a ``pick`` step named as its own collection would be, which takes its value from the joint
step's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..allocation import statistics_for

KINDS = (
    "statistic",
    "statistics",
    "pick",
    "statistic_shard",
    "merge_statistic",
    "decompose",
    "summarize",
    "plan",
    "refine",
    "build",
)


@dataclass(frozen=True)
class Step:
    """One step of a conversion.

    ``name`` is unique in its graph (``statistic[gram]``, ``decompose[3]``, ``plan``, ...); ``kind`` says
    what it computes (one of :data:`KINDS`); ``inputs`` are the names of the steps it reads, in the order
    it reads them; ``params`` is the JSON-able configuration it depends on (and nothing else).
    """

    name: str
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}; known: {', '.join(KINDS)}")


def statistic_step(name: str) -> str:
    """The name of the step whose result is the statistic ``name`` (collected or merged)."""
    return f"statistic[{name}]"


def statistic_inputs(step: Step) -> dict[str, str]:
    """The statistics ``step`` reads: each statistic's name → the step whose result it is."""
    prefix = "statistic["
    return {s[len(prefix) : -1]: s for s in step.inputs if s.startswith(prefix) and s.endswith("]")}


def decompose_step(layer: int) -> str:
    return f"decompose[{layer}]"


def summarize_step(layer: int) -> str:
    return f"summarize[{layer}]"


@dataclass(frozen=True)
class StepGraph:
    """The steps of one conversion in an order where every step follows the steps it reads."""

    steps: tuple[Step, ...]

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, name: str) -> Step:
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.steps]

    @property
    def result(self) -> str:
        """The step whose result is the plan the model is built with (``refine`` when it refines)."""
        return self["build"].inputs[-1]


def joint_step(names: Sequence[str]) -> str:
    """The name of the step that collects the statistics ``names`` in one pass."""
    return f"statistics[{','.join(names)}]"


def _shard_count(stat: Any, shards: int, rows: int | None, batch_size: int, seq_len: int | None) -> int:
    """How many shards ``stat`` is collected in (never more than its rows split into:
    :meth:`~lrkv_core.statistics.Statistic.max_shards`)."""
    n = min(shards, stat.max_shards(rows, batch_size, seq_len)) if rows is not None else shards
    return n if stat.shardable else 1


def _collection_steps(
    stats: Sequence[Any],
    shards: int,
    rows: int | None,
    batch_size: int,
    seq_len: int | None,
    factor_inputs: tuple[str, ...],
) -> list[Step]:
    """The steps collecting ``stats``: those that can share a pass (each collected in one pass, on however
    many of the rows) in a joint step with a pick step each, every other one by :func:`_statistic_steps`."""
    group = [
        stat
        for stat in stats
        if stat.joint and not stat.uses_factors and _shard_count(stat, shards, rows, batch_size, seq_len) <= 1
    ]
    joined = {s.name for s in group} if len(group) > 1 else set()
    steps: list[Step] = []
    if joined:
        joint = joint_step([s.name for s in group])
        steps.append(Step(joint, "statistics", {"statistics": [s.to_dict() for s in group]}, factor_inputs))
        steps += [Step(statistic_step(s.name), "pick", {"statistic": s.to_dict()}, (joint,)) for s in group]
    for stat in stats:
        if stat.name not in joined:
            steps += _statistic_steps(stat, shards, rows, batch_size, seq_len, factor_inputs)
    return steps


def _statistic_steps(
    stat: Any,
    shards: int,
    rows: int | None,
    batch_size: int,
    seq_len: int | None,
    factor_inputs: tuple[str, ...],
) -> list[Step]:
    """The steps collecting one statistic: one step, or ``shards`` shard steps and their merge (never more
    shards than its rows split into: :meth:`~lrkv_core.statistics.Statistic.max_shards`)."""
    name = stat.name
    n = _shard_count(stat, shards, rows, batch_size, seq_len)
    if n <= 1:
        return [Step(statistic_step(name), "statistic", {"statistic": stat.to_dict()}, factor_inputs)]
    recipe = stat.to_dict()
    parts = [
        Step(f"{statistic_step(name)}/{i}", "statistic_shard", {"statistic": recipe, "shard": i, "count": n},
             factor_inputs)
        for i in range(n)
    ]  # fmt: skip
    return [
        *parts,
        Step(statistic_step(name), "merge_statistic", {"statistic": recipe}, tuple(p.name for p in parts)),
    ]


def build_params(config: Any) -> dict[str, Any]:
    """How the build step fuses the factors, from a resolved
    :class:`~lrkv_core.conversion.convert.CompressionConfig`: the decomposition and cache storage it records,
    the rotation it fuses, and the attention kind where it is not the model's default."""
    params = {
        "decomposition": config.decomposition.to_dict(),
        "cache": config.cache.to_dict(),
        "rotation": config.rotation.to_dict(),
    }
    if config.key_latents == "rotated":  # (absent: the model's default attention)
        params["attention"] = "rotated-keys"
    return params


def conversion_steps(
    config: Any,
    n_layers: int,
    *,
    shards: int = 1,
    rows: int | None = None,
    seq_len: int | None = None,
    batch_size: int = 8,
    given: Sequence[str] = (),
) -> StepGraph:
    """The conversion ``config`` (a :class:`~lrkv_core.conversion.convert.CompressionConfig` resolved for the
    model by its ``for_model``) describes, for a model of ``n_layers`` layers.

    Parameters
    ----------
    shards : how many slices of the calibration rows each shardable statistic is collected over (1: one
        pass); never more than its rows split into (``rows``: the calibration size, rows of ``seq_len``
        tokens, collected in batches of ``batch_size``).
    given : statistics already at hand: no step collects them (an executor provides their results).
    """
    if config.group_size is None:
        raise ValueError("resolve the config for the model first (CompressionConfig.for_model)")
    if shards < 1:
        raise ValueError(f"shards must be ≥ 1, got {shards}")
    needed = config.needed_statistics()
    layers = range(n_layers)
    steps: list[Step] = []
    # those the factors do not depend on come first
    first = [s for s in needed if not s.uses_factors and s.name not in given]
    steps += _collection_steps(first, shards, rows, batch_size, seq_len, ())
    decomposition = config.decomposition.to_dict()
    rotated_keys = config.key_latents == "rotated"
    decompose_needs = set(config.decomposition.needs) | ({"gram"} if rotated_keys else set())
    decompose_reads = tuple(statistic_step(n) for n in sorted(decompose_needs))
    rotated = {"key_latents": "rotated"} if rotated_keys else {}  # (absent: the default, rebuilt)
    for layer in layers:
        params = {"layer": layer, "group_size": config.group_size, "decomposition": decomposition, **rotated}
        steps.append(Step(decompose_step(layer), "decompose", params, decompose_reads))
    factors = tuple(decompose_step(layer) for layer in layers)
    later = [s for s in needed if s.uses_factors and s.name not in given]
    steps += _collection_steps(later, shards, rows, batch_size, seq_len, factors)
    features = sorted(config.features())
    feature_reads = tuple(statistic_step(n) for n in sorted(statistics_for(features)))
    for layer in layers:
        params = {"layer": layer, "features": features}
        reads = (decompose_step(layer), *feature_reads)
        steps.append(Step(summarize_step(layer), "summarize", params, reads))
    plan_params = {
        "ratio": config.ratio,
        "group_size": config.group_size,
        "rank_multiple": config.rank_multiple,
        "allocator": config.allocator.to_dict(),
    }
    steps.append(Step("plan", "plan", plan_params, tuple(summarize_step(layer) for layer in layers)))
    plan = "plan"
    if config.refines:
        steps.append(Step("refine", "refine", config.refine.to_dict(), (*factors, "plan")))
        plan = "refine"
    steps.append(Step("build", "build", build_params(config), (*factors, plan)))
    return StepGraph(tuple(steps))
