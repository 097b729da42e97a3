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
    decomposition: Literal["whitened", "plain"] = "whitened"
    ratio: float = Field(0.5, gt=0, le=1, description="compressed KV width / original; 0.5 halves the cache")
    group_size: int = Field(1, ge=1, description="KV heads decomposed together: 1 = M-LRD, Hkv = J-LRD")
    rank_multiple: int = Field(8, ge=1)
    allocator: Literal["uniform"] = "uniform"


class EvalRecipe(Strict):
    dataset: str | None = "builtin:pydoc-llama:valid"
    seq_len: int = Field(256, ge=2)
    max_windows: int | None = Field(64, ge=1)
    decode_prefix: int = Field(128, ge=1)
    decode_windows: int = Field(16, ge=1)
    batch_size: int = Field(8, ge=1)

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


def load_recipe(path: str | Path | None = None, overrides: dict | None = None) -> ConvertRecipe:
    """A recipe from YAML (or the defaults) with dotted-key overrides (``{"compression.ratio": 0.5}``)."""
    data: dict = {}
    if path is not None:
        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a recipe is a YAML mapping")
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return ConvertRecipe.model_validate(data)


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
