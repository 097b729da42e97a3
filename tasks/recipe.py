"""Recipes: strict pydantic models (unknown keys fail), loadable from YAML, used as the flow parameter."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_MODEL = "builtin:pydoc-llama"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CalibrationRecipe(Strict):
    dataset: str = "builtin:pydoc-llama:train"
    n_samples: int = Field(64, ge=1)
    seq_len: int = Field(256, ge=2)
    seed: int = 0
    batch_size: int = Field(8, ge=1)


class PaluRecipe(Strict):
    """Palu: whitened SVD per group of KV heads (G-LRD), latent cache, B_v folded into o_proj."""

    name: Literal["palu"] = "palu"
    decomposition: Literal["whitened", "plain", "pca"] = "whitened"
    ratio: float = Field(0.5, gt=0, le=1, description="compressed KV width / original; 0.5 halves the cache")
    group_size: int = Field(1, ge=1, description="KV heads decomposed together: 1 = M-LRD, Hkv = J-LRD")
    rank_multiple: int = Field(8, ge=1)
    allocator: Literal["uniform", "fisher", "lorc", "eigen", "fisher-greedy"] = "uniform"
    skip_threshold: float | None = Field(None, gt=0, description="lorc: layers with κ below keep full rank")
    fisher_per_row: bool = Field(True, description="Fisher: squared gradients per row, else per batch")


class EvalRecipe(Strict):
    dataset: str | None = "builtin:pydoc-llama:valid"
    seq_len: int = Field(256, ge=2)
    max_windows: int | None = Field(64, ge=1)
    decode_prefix: int = Field(128, ge=1)
    decode_windows: int = Field(16, ge=1)
    batch_size: int = Field(8, ge=1)
    zeroshot_tasks: list[str] = Field([], description="lm-eval task names (hub tasks need network)")
    zeroshot_include: str | None = Field(None, description="directory of local lm-eval task YAMLs")
    zeroshot_limit: int | None = Field(None, ge=1, description="documents per task (all if null)")

    @model_validator(mode="after")
    def _prefix_inside(self) -> EvalRecipe:
        if self.decode_prefix >= self.seq_len:
            raise ValueError(f"decode_prefix ({self.decode_prefix}) must be < seq_len ({self.seq_len})")
        return self


class TrackingRecipe(Strict):
    mlflow_uri: str | None = Field(None, description="default: sqlite:///<LRKV_HOME>/mlflow.db")
    experiment: str = "lrkv"


class ConvertRecipe(Strict):
    """Everything one conversion needs; the same object is the Prefect flow parameter."""

    model: str = DEFAULT_MODEL
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    calibration: CalibrationRecipe = CalibrationRecipe()
    compression: PaluRecipe = PaluRecipe()
    eval: EvalRecipe = EvalRecipe()
    tracking: TrackingRecipe = TrackingRecipe()
    store: str | None = Field(None, description="artifact store root; default <LRKV_HOME>/store")
    out: str | None = Field(None, description="also copy the compressed model directory here")


def read_yaml(path: str | Path | None) -> dict:
    """A recipe file as a dict ({} for no file)."""
    if path is None:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe is a YAML mapping")
    return data


def apply_overrides(data: dict, overrides: dict | None) -> dict:
    """Set dotted keys in a nested dict, in place (``{"compression.ratio": 0.5}``)."""
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return data


def load_recipe(path: str | Path | None = None, overrides: dict | None = None) -> ConvertRecipe:
    """A recipe from YAML (or the defaults) with dotted-key overrides (``{"compression.ratio": 0.5}``)."""
    return ConvertRecipe.model_validate(apply_overrides(read_yaml(path), overrides))


def recipe_yaml(recipe: ConvertRecipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (MLflow params)."""
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class AblateRecipe(Strict):
    """A grid of conversions of one model: decomposition × group size × allocator × ratio."""

    base: ConvertRecipe = ConvertRecipe()
    decompositions: list[Literal["whitened", "plain", "pca"]] = ["plain", "whitened", "pca"]
    group_sizes: list[int] = [1, 2]
    allocators: list[Literal["uniform", "fisher", "lorc", "eigen", "fisher-greedy"]] = ["uniform"]
    ratios: list[float] = [0.7, 0.5, 0.3]

    def grid(self) -> list[PaluRecipe]:
        base = self.base.compression
        return [
            base.model_copy(update={"decomposition": d, "group_size": g, "allocator": a, "ratio": r})
            for d in self.decompositions
            for g in self.group_sizes
            for a in self.allocators
            for r in self.ratios
        ]
