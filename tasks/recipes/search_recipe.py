"""The search's recipe: a ``base`` convert recipe and the ``search`` section (what varies, the budget).

Prefect-free, like :mod:`lrkv_tasks.recipes.convert_recipe`, so the CLI can validate a recipe before Prefect
starts."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import Field, field_validator, model_validator

from lrkv_core.allocation import ALLOCATORS, DEFAULT_ALLOCATOR
from lrkv_core.cache import CACHE_STORAGES
from lrkv_core.conversion.search import Budget
from lrkv_core.quant.rotation import Policy

from .convert_recipe import ConvertRecipe, PaluRecipe, Strict, method_label
from .registered import registered

DEFAULT_RATIOS = [round(0.05 * k, 2) for k in range(1, 21)]


class SearchSpace(Strict):
    """What the search may vary (cache storage with its bits × allocator × width ratio) and the budget."""

    max_ppl_rise: float = Field(
        0.01, ge=0, description="relative prefill PPL rise over the original allowed (0.01: 1 %)"
    )
    max_kl: float | None = Field(None, ge=0, description="KL(original ‖ compressed) per token allowed")
    ratios: list[float] = Field(DEFAULT_RATIOS, min_length=1, description="width ratios, bisected per arm")
    caches: list[registered(CACHE_STORAGES)] = Field(  # type: ignore[valid-type]
        [{"name": "quantized", "bits": 3}, {"name": "quantized", "bits": 4}, "dense"],
        min_length=1,
        description="cache storages searched, in this order (small caches first prune the others more)",
    )
    allocators: list[registered(ALLOCATORS)] = Field(  # type: ignore[valid-type]
        [DEFAULT_ALLOCATOR], min_length=1
    )
    rotation: Policy = Field(
        "auto", description="rotation fused for every storage but dense (dense keeps the base's)"
    )

    @field_validator("ratios")
    @classmethod
    def _ratios_in_range(cls, value: list[float]) -> list[float]:
        if any(not 0 < r <= 1 for r in value):
            raise ValueError(f"ratios must be in (0, 1], got {value}")
        return sorted(set(value))

    def budget(self) -> Budget:
        return Budget(self.max_ppl_rise, self.max_kl)


class SearchRecipe(Strict):
    """A search of one model: a ``base`` convert recipe (calibration, evaluation, tracking, registry, store,
    out: where the winner is exported) and the ``search`` section."""

    base: ConvertRecipe = ConvertRecipe()
    search: SearchSpace = SearchSpace()

    @model_validator(mode="after")
    def _evaluated(self) -> SearchRecipe:
        if self.base.eval.dataset is None:
            raise ValueError("a search measures quality: base.eval.dataset cannot be null")
        return self

    def arms(self) -> dict[str, tuple[Any, Any]]:
        """label -> (cache storage, allocator), caches outermost (the order the search takes)."""
        return {
            f"{method_label(c)} {method_label(a)}": (c, a)
            for c in self.search.caches
            for a in self.search.allocators
        }

    def candidate(self, arm: str, ratio: float) -> PaluRecipe:
        """The base's compression section at this arm and ratio."""
        cache, allocator = self.arms()[arm]
        comp = self.base.compression
        rotation = comp.rotation
        if cache.name != "dense":
            rotation = replace(rotation, name=self.search.rotation)
        return comp.model_copy(
            update={"cache": cache, "allocator": allocator, "ratio": ratio, "rotation": rotation}
        )
