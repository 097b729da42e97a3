"""Recipes: strict pydantic models (unknown keys fail), loadable from YAML, used as the flow parameter.

The methods a recipe may name (decomposition, allocator, statistics) come from lrkv_core's registries
(:mod:`lrkv_tasks.recipes.registered`): nothing here lists them.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_validator,
)

from lrkv_core.allocation import ALLOCATORS
from lrkv_core.cache import CACHE_STORAGES
from lrkv_core.conversion.convert import CompressionConfig
from lrkv_core.conversion.refine import RefineConfig
from lrkv_core.decompositions import DECOMPOSITIONS
from lrkv_core.evaluation.longcontext import (
    DEFAULT_DEPTHS,
    DEFAULT_LENGTHS,
    DEFAULT_TASKS,
    LongContextProtocol,
    check_stride,
)
from lrkv_core.evaluation.needles import TASKS as NEEDLE_TASKS
from lrkv_core.lora import RecoveryConfig
from lrkv_core.lora.config import Role  # noqa: F401  (the recipe's roles, re-exported)
from lrkv_core.quant.rotation import RotationConfig
from lrkv_core.registry import Method
from lrkv_core.statistics import STATISTICS
from lrkv_core.statistics.precision import PRECISIONS

from ..store.artifacts import STORE_FORMS, is_s3, local_dir
from .registered import registered

DEFAULT_MODEL = "builtin:pydoc-llama"
HELD_OUT = "heldout"  # eval.dataset: the held-out part of the calibration source


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class CalibrationRecipe(Strict):
    dataset: str | None = Field(
        None, description="default: the model's own training text for builtin: models, else WikiText-2 train"
    )
    n_samples: int = Field(
        256,
        ge=1,
        description="calibration windows drawn; 256 (Palu's whitening size) measurably beats 64 at ratio 0.3",
    )
    seq_len: int = Field(256, ge=2, description="tokens per calibration window")
    seed: int = 0
    batch_size: int = Field(8, ge=1, description="calibration rows per forward/backward pass (at most)")
    batch_tokens: int = Field(
        256,
        ge=2,
        description="the most tokens one pass over calibration rows holds: rows per pass are "
        "min(batch_size, batch_tokens // seq_len), at least 1. A gradient pass keeps every layer's "
        "activations for each of its tokens (about 2.8 MB per token on SmolLM2-135M), what a conversion's "
        "memory peaks on; one of more than 1,024 tokens (a long row) recomputes them layer by layer instead",
    )
    shards: int | None = Field(
        None,
        ge=1,
        description="slices of the rows each whole-model statistic is collected over, one task each, merged "
        "after (the same values); default: one per worker of a Dask task runner, else 1",
    )
    precision: Literal[PRECISIONS] = Field(  # type: ignore[valid-type]
        "float32",
        description="what the passes over the calibration rows (statistics, KL response, refinement) compute "
        "the decoder stack in: bfloat16 runs its matrix products under autocast (0.8 of the time where the "
        "hardware multiplies bfloat16 natively), a plan of comparable quality, not the same; "
        "the weights, decompositions and the built model are unchanged",
    )

    @property
    def rows_per_pass(self) -> int:
        """Calibration rows one forward/backward pass takes (``batch_size`` within ``batch_tokens``)."""
        return min(self.batch_size, max(1, self.batch_tokens // self.seq_len))


def config_fields(config: type, types: dict[str, Any] | None = None) -> dict[str, Any]:
    """pydantic field definitions of a core config dataclass: its fields' types and defaults (or ``types``'
    (type, default) where a recipe writes the field differently), and ``help`` (metadata) as descriptions, so
    a recipe section built from them restates nothing."""
    hints = typing.get_type_hints(config)
    fields = {}
    for f in dataclasses.fields(config):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind, default = (types or {}).get(f.name, (hints[f.name], default))
        fields[f.name] = (kind, Field(default, description=f.metadata.get("help")))
    return fields


def _rotation_name(value: Any) -> Any:
    """``rotation: auto`` is short for ``rotation: {name: auto}``."""
    return {"name": value} if isinstance(value, str) else value


class _Compression(Strict):
    name: Literal["palu"] = "palu"

    @model_validator(mode="before")
    @classmethod
    def _flat_section_keys(cls, data: Any) -> Any:
        """The flat forms ``refine_steps: 2`` (``refine_rows``, ...) and ``rotation_seed: 1`` are read as
        ``refine: {steps: 2}`` and ``rotation: {seed: 1}``; a section written as a name
        (``rotation: auto``) keeps it."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for section, config in (("refine", RefineConfig), ("rotation", RotationConfig)):
            prefix = f"{section}_"
            flat = {k[len(prefix) :]: data.pop(k) for k in list(data) if k.startswith(prefix)}
            if flat:
                nested = config.create(data.get(section)).to_dict() if data.get(section) else {}
                data[section] = {**nested, **flat}
        return data

    @model_validator(mode="after")
    def _valid(self) -> _Compression:
        self.to_config()  # the core's own checks (ratio, group size, a cache that refuses the rotation, ...)
        return self

    def to_config(self) -> CompressionConfig:
        """The in-memory config of this section (group size still unresolved if 'auto')."""
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(CompressionConfig)}
        group = None if self.group_size == "auto" else self.group_size
        return CompressionConfig(**options | {"group_size": group, "statistics": tuple(self.statistics)})


PaluRecipe = create_model(
    "PaluRecipe",
    __base__=_Compression,
    __doc__="""Palu's latent cache: low-rank factors per group of KV heads, latents cached, B_v folded into
    o_proj; the fields of :class:`lrkv_core.conversion.convert.CompressionConfig` (defaults and descriptions
    taken from it), methods named as the registries know them.""",
    __module__=__name__,
    **config_fields(
        CompressionConfig,
        {  # how a recipe writes what the in-memory config also takes as instances (or as None)
            "group_size": (int | Literal["auto"], "auto"),
            "decomposition": (registered(DECOMPOSITIONS), CompressionConfig.decomposition),
            "allocator": (registered(ALLOCATORS), CompressionConfig.allocator),
            "statistics": (list[registered(STATISTICS)], []),
            "cache": (registered(CACHE_STORAGES), CompressionConfig.cache),
            "rotation": (Annotated[RotationConfig, BeforeValidator(_rotation_name)], RotationConfig()),
            "refine": (RefineConfig, CompressionConfig.refine),
        },
    ),
)


class LongEvalRecipe(Strict):
    """The long-context suite (:mod:`lrkv_core.evaluation.longcontext`): continuation after long contexts,
    retrieval."""

    lengths: list[int] = Field(
        list(DEFAULT_LENGTHS), min_length=1, description="context / prompt lengths (capped by the model's)"
    )
    continuation: int = Field(256, ge=0, description="tokens scored after each context (0: no continuation)")
    windows: int | None = Field(8, ge=1, description="continuation windows per length (null: all there are)")
    stride: int | None = Field(
        None,
        ge=1,
        description="continuation windows start this many tokens apart, ≥ continuation (null: no overlap)",
    )
    depths: list[float] = Field(list(DEFAULT_DEPTHS), min_length=1, description="needle depths in 0..1")
    samples: int = Field(4, ge=0, description="retrieval prompts per task × length × depth (0: none)")
    needles: list[str] = Field(list(DEFAULT_TASKS), description=f"retrieval tasks: {', '.join(NEEDLE_TASKS)}")
    seed: int = Field(0, description="the retrieval prompts' seed")
    chunk_size: int = Field(1024, ge=1, description="tokens per prefill chunk of a context")

    @field_validator("lengths")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if min(v) < 1:
            raise ValueError(f"lengths must be positive, got {v}")
        return v

    @field_validator("depths")
    @classmethod
    def _depths(cls, v: list[float]) -> list[float]:
        if not all(0.0 <= d <= 1.0 for d in v):
            raise ValueError(f"each depth must be in [0, 1], got {v}")
        return v

    @field_validator("needles")
    @classmethod
    def _needles(cls, v: list[str]) -> list[str]:
        unknown = [t for t in v if t not in NEEDLE_TASKS]
        if unknown:
            raise ValueError(f"unknown retrieval task(s) {unknown}; known: {', '.join(NEEDLE_TASKS)}")
        return v

    @model_validator(mode="after")
    def _stride(self) -> LongEvalRecipe:
        check_stride(self.stride, self.continuation)
        return self

    def protocol(self, dataset: str) -> LongContextProtocol:
        """The core's protocol of this section on ``dataset``."""
        return LongContextProtocol(
            dataset=dataset,
            lengths=tuple(self.lengths),
            continuation=self.continuation,
            windows=self.windows,
            stride=self.stride,
            chunk_size=self.chunk_size,
            depths=tuple(self.depths),
            samples=self.samples,
            tasks=tuple(self.needles),
            seed=self.seed,
        )


class EvalRecipe(Strict):
    dataset: str | None = Field(
        HELD_OUT,
        description="'heldout': the part of the calibration source not used for calibration; null: skip",
    )
    seq_len: int = Field(256, ge=2)
    max_windows: int | None = Field(64, ge=1)
    decode_prefix: int = Field(128, ge=1)
    decode_windows: int = Field(16, ge=1)
    batch_size: int = Field(8, ge=1)
    zeroshot_tasks: list[str] = Field([], description="lm-eval task names (hub tasks need network)")
    zeroshot_include: str | None = Field(None, description="directory of local lm-eval task YAMLs")
    zeroshot_limit: int | None = Field(None, ge=1, description="documents per task (all if null)")
    long: LongEvalRecipe | None = Field(
        None,
        description="the long-context suite on eval.dataset, for the compressed model next to the original "
        "(null: not run); e.g. {lengths: [1024, 2048]}",
    )

    @model_validator(mode="after")
    def _prefix_inside(self) -> EvalRecipe:
        if self.decode_prefix >= self.seq_len:
            raise ValueError(f"decode_prefix ({self.decode_prefix}) must be < seq_len ({self.seq_len})")
        return self


class _LoraData(Strict):
    dataset: str | None = Field(
        None, description="training data (a dataset spec); default: the calibration data"
    )
    eval_dataset: str | None = Field(
        HELD_OUT,
        description="rows for the held-out loss during training; 'heldout': eval.dataset; null: none",
    )

    @model_validator(mode="after")
    def _valid(self) -> _LoraData:
        self.to_config()  # the core's own checks (distinct targets, ...), as a validation error
        return self

    def to_config(self) -> RecoveryConfig:
        """The in-memory config of this section (the data fields are the task's)."""
        return RecoveryConfig(**self.model_dump(exclude={"dataset", "eval_dataset"}))


LoraRecipe = create_model(
    "LoraRecipe",
    __base__=_LoraData,
    __doc__="""LoRA recovery after compression (Palu's defaults where they fit: r′ 32, α 32, lr 2e-4, cosine),
    merged into the projections so the KV cache keeps its width: the data, and the fields of
    :class:`lrkv_core.lora.RecoveryConfig` (types, defaults and descriptions taken from it).""",
    __module__=__name__,
    **config_fields(RecoveryConfig),
)


class TrackingRecipe(Strict):
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI; default: $MLFLOW_TRACKING_URI, else sqlite:///<LRKV_HOME>/mlflow.db",
    )
    experiment: str = "lrkv"


class RegistryRecipe(Strict):
    """The MLflow model registry: every conversion is registered as ``candidate``; the quality gate decides
    ``champion``."""

    enabled: bool = True
    name: str | None = Field(None, description="registered model name; default lrkv-<model-slug>")
    max_ppl_rise: float = Field(
        0.05,
        ge=0,
        description="champion only if prefill PPL rose at most this much (relative) over the original",
    )
    max_kl: float | None = Field(
        None,
        ge=0,
        description="champion only if KL(original ‖ compressed), nats per token of the evaluation's prefill "
        "windows, is at most this; null: no bound",
    )


class ConvertRecipe(Strict):
    """Everything one conversion needs; the same object is the Prefect flow parameter."""

    model: str = DEFAULT_MODEL
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    calibration: CalibrationRecipe = CalibrationRecipe()
    compression: PaluRecipe = PaluRecipe()
    eval: EvalRecipe = EvalRecipe()
    lora: LoraRecipe | None = Field(None, description="LoRA recovery after compression; null: off")
    tracking: TrackingRecipe = TrackingRecipe()
    registry: RegistryRecipe = RegistryRecipe()
    store: str | None = Field(
        None, description="artifact store root: a directory or s3://bucket/prefix; default <LRKV_HOME>/store"
    )
    out: str | None = Field(None, description="also copy the compressed model directory here")

    @field_validator("store")
    @classmethod
    def _store_is_a_directory_or_s3(cls, value: str | None) -> str | None:
        if value and not is_s3(value):
            local_dir(value, "store", STORE_FORMS)  # "s3:/bucket" (a folded s3://) is never a local directory
        return value

    @field_validator("out")
    @classmethod
    def _out_is_local(cls, value: str | None) -> str | None:
        if value:
            local_dir(value, "out", "a local directory")
        return value


def read_yaml(path: str | Path | None) -> dict:
    """A recipe file as a dict ({} for no file)."""
    if path is None:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe is a YAML mapping")
    return data


def apply_overrides(data: dict, overrides: dict | None) -> dict:
    """Set dotted keys in a nested dict, in place (``{"compression.ratio": 0.5}``). A section written as a
    name (``cache: quantized``) becomes its mapping form (``{name: quantized}``) when a key inside it is
    set (``compression.cache.bits``)."""
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            if isinstance(node.get(p), str):
                node[p] = {"name": node[p]}
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"cannot set {dotted}: {p} is {node!r}, not a section")
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
    decompositions: list[registered(DECOMPOSITIONS)] = ["plain", "whitened", "pca"]  # type: ignore[valid-type]
    group_sizes: list[int | Literal["auto"]] = [1, 2]
    allocators: list[registered(ALLOCATORS)] = ["uniform"]  # type: ignore[valid-type]
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


def method_label(method: Any) -> str:
    """``lorc`` or ``lorc(skip_threshold=1e9)``: a method's name with the options that differ from their
    defaults (a registered method object; a plain ``{"name": ..., **options}`` dict shows every option)."""
    if isinstance(method, Method):
        default = {f.name: f.default for f in dataclasses.fields(method)}  # MISSING where none
        form = {k: v for k, v in method.to_dict().items() if k == "name" or v != default.get(k)}
    else:
        form = dict(method)
    options = ", ".join(f"{k}={v}" for k, v in form.items() if k != "name" and v is not None)
    return f"{form['name']}({options})" if options else form["name"]
