"""What the convert flow returns: its artifacts, evaluations, MLflow run and registration, by name.

Tasks pass JSON records to each other (evaluations as :meth:`EvalResult.to_dict`); the flow gathers them into
a :class:`ConvertResult` at its end, which the CLI prints, the ablation and search flows tabulate and the
Prefect UI's summary shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lrkv_core.evaluation.metrics import EvalResult

from .recipes.convert_recipe import ConvertRecipe
from .store.artifacts import ArtifactRef


def eval_result(record: Mapping[str, Any] | None) -> EvalResult | None:
    """An evaluate task's record as an :class:`EvalResult` (None stays None)."""
    return None if record is None else EvalResult.from_dict(record)


@dataclass(frozen=True)
class Evaluations:
    """The original's and the compressed model's evaluations on the same windows (None when the recipe's
    ``eval.dataset`` is null); with LoRA recovery, ``compressed`` is the recovered model and ``before_lora``
    the model it started from."""

    base: EvalResult | None = None
    compressed: EvalResult | None = None
    before_lora: EvalResult | None = None

    @property
    def kv_bytes_ratio(self) -> float | None:
        """The compressed cache's measured bytes per token over the original's."""
        if self.base is None or self.compressed is None:
            return None
        return self.compressed.kv_bytes_per_token / self.base.kv_bytes_per_token


@dataclass(frozen=True)
class ConvertResult:
    """One conversion: the recipe as run (group size and datasets resolved), the artifacts (references into
    the store), the evaluations, the MLflow run (``run_id``, ``experiment_id``, ``tracking_uri``), the
    registration (name, version, aliases, quality gate) when the recipe registers, each task's state,
    seconds and peak RSS, and the notes the recipe's preparation printed."""

    recipe: ConvertRecipe
    model: ArtifactRef
    calibration: ArtifactRef
    plan: ArtifactRef
    compressed: ArtifactRef
    eval: Evaluations
    mlflow: dict[str, str]
    timings: list[dict[str, Any]]
    exported: ArtifactRef | None = None
    lora: ArtifactRef | None = None
    before_lora: ArtifactRef | None = None
    registered: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
