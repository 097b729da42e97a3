"""Everything the recipe and the model's config decide, resolved and checked before any expensive step.

:func:`prepare` turns a recipe into a concrete one (group size, calibration and evaluation datasets chosen)
and checks, cheaply, what would otherwise fail minutes later: an unsupported model, a group size that does
not divide the KV heads, a ratio and rank multiple that leave a group at rank 0, missing data files, text
data for a model without a tokenizer, a source model that is already compressed or has only pickle weights
(which are never read), an ``--out`` that is not ours to replace or cannot be written, and evaluation data
that overlaps the calibration data (a warning; the quality gate then refuses champion). The CLI runs it before
Prefect starts, and the flow runs it first (it is idempotent), so programmatic runs fail early too.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig

from lrkv_core.data.datasets import check_dataset, heldout, parse_dataset_spec
from lrkv_core.data.heldout import overlap
from lrkv_core.data.refs import absolute_dataset_spec, absolute_model_ref, absolute_path
from lrkv_core.lora import check_targets, check_training_dataset
from lrkv_core.model.adapters import get_adapter
from lrkv_core.model.attention_rotated import check_rotated_keys
from lrkv_core.model.io import is_compressed_dir
from lrkv_core.model.loading import TOKENIZER_FILES, missing_safetensors, resolve_model_dir

from ..device import pass_limit
from ..store.artifacts import is_s3
from .convert_recipe import HELD_OUT, AblateRecipe, ConvertRecipe, LoraRecipe

DEFAULT_CALIBRATION = "hf:wikitext:wikitext-2-raw-v1:train"  # Palu's and SVD-LLM's calibration text
BENCH_CONTEXTS = (1024, 4096, 16384)  # lrkv bench's contexts when none are given


@dataclass
class Prepared:
    """A concrete recipe and what was chosen for the user (printed by the CLI, logged by the flow)."""

    recipe: ConvertRecipe
    notes: list[str] = field(default_factory=list)


def default_calibration(model_ref: str) -> str:
    """The model's own training text for a ``builtin:`` model, else WikiText-2's train split."""
    if model_ref.startswith("builtin:"):
        return f"{model_ref}:train"
    return DEFAULT_CALIBRATION


def prepare(recipe: ConvertRecipe) -> Prepared:
    """Resolve the recipe's model-dependent defaults and check everything cheap; raises ``ValueError``,
    ``FileNotFoundError`` or ``FileExistsError`` with one clear line."""
    notes: list[str] = []
    recipe = _absolute_paths(recipe)
    model_dir = resolve_model_dir(recipe.model)
    _check_source_model(Path(model_dir), recipe.model)
    config = AutoConfig.from_pretrained(str(model_dir))
    get_adapter(config)  # unsupported architectures fail here, naming the supported ones
    pass_limit()  # a bad LRKV_MODEL_PASSES fails here, not in the first task
    compression = recipe.compression
    resolved = compression.to_config().for_model(config)  # group size, rank-0 budget: before any work
    n_rows, seq_len = recipe.calibration.n_samples, recipe.calibration.seq_len
    for stat in resolved.needed_statistics():
        asks = stat.n_samples is not None and not stat.caps_rows  # a cap reads all of fewer rows
        if asks and stat.n_samples > n_rows:
            raise ValueError(
                f"statistic {stat.name} asks for {stat.n_samples} calibration rows; calibration.n_samples is "
                f"{n_rows}"
            )
        if stat.used_rows(n_rows, seq_len) < stat.used_rows(n_rows):  # long rows: capped by their tokens
            notes.append(
                f"{stat.name} reads {stat.used_rows(n_rows, seq_len)} calibration rows of {seq_len} tokens"
            )
    if resolved.refines:
        refine = resolved.refine
        try:
            split = refine.split(n_rows, seq_len)
        except ValueError as e:
            raise ValueError(f"{e}: raise calibration.n_samples or lower refine.accept_rows") from None
        try:
            uncapped = refine.split(n_rows)  # without the rows' length: no token cap
        except ValueError:  # more rows than there are, but capped by their tokens they fit
            uncapped = None
        if split != uncapped:
            priced, accepted = split
            notes.append(
                f"each refinement step is priced on {priced} and accepted on {accepted} rows of {seq_len} "
                "tokens"
            )
    rotation_warning = resolved.cache.rotation_warning(resolved.rotation.name)
    if rotation_warning:
        notes.append(f"warning: {rotation_warning}")
    if compression.group_size == "auto":
        notes.append(f"group size {resolved.group_size} (auto: the largest divisor of the KV heads ≤ 4)")
        compression = compression.model_copy(update={"group_size": resolved.group_size})

    has_tokenizer = any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)
    calibration = recipe.calibration
    dataset = calibration.dataset
    if dataset is None:
        dataset = default_calibration(recipe.model)
        notes.append(f"calibrating on {dataset} (the default for this model)")
    ev = recipe.eval
    eval_dataset = ev.dataset
    if eval_dataset == HELD_OUT:
        calib_spec, eval_spec, description = heldout(parse_dataset_spec(dataset))
        dataset, eval_dataset = str(calib_spec), str(eval_spec)
        notes.append(f"evaluating on {eval_dataset}: {description}")
    check_dataset(parse_dataset_spec(dataset), has_tokenizer=has_tokenizer, model=recipe.model)
    if eval_dataset is not None:
        check_dataset(parse_dataset_spec(eval_dataset), has_tokenizer=has_tokenizer, model=recipe.model)
        if ev.zeroshot_tasks and not has_tokenizer:
            raise ValueError(f"zero-shot tasks need a tokenizer, and {recipe.model} has none")
    if eval_dataset is not None:
        clash = overlap(dataset, eval_dataset)
        if clash is not None:
            notes.append(
                f"warning: {clash}: perplexities measured on it flatter the model, and the registry's "
                "quality gate will not make it champion"
            )
    if recipe.out:
        out = Path(recipe.out)
        if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not is_compressed_dir(out))):
            raise FileExistsError(
                f"--out {out} exists and is not an lrkv model directory; refusing to replace it"
            )
        check_writable(out)
    lora = recipe.lora
    if lora is not None:
        rope = get_adapter(config).rope
        lora = _prepare_lora(lora, dataset, eval_dataset, has_tokenizer, rope, resolved.key_latents, notes)
    concrete = recipe.model_copy(
        update={
            "calibration": calibration.model_copy(update={"dataset": dataset}),
            "compression": compression,
            "eval": ev.model_copy(update={"dataset": eval_dataset}),
            "lora": lora,
        }
    )
    return Prepared(concrete, notes)


def check_ablation(recipe: AblateRecipe) -> None:
    """Before Prefect starts: raise the first grid point's error when no point passes :func:`prepare` (a
    missing model or dataset fails them all); a point that fails alone is one of the flow's failed rows."""
    first: Exception | None = None
    for compression in recipe.grid():
        try:
            prepare(recipe.base.model_copy(update={"compression": compression, "out": None}))
            return
        except (ValueError, OSError) as e:
            first = first or e
    raise first


def bench_contexts(model: str, contexts: list[int] | None, decode_steps: int) -> list[int]:
    """The contexts ``lrkv bench`` measures, shortest first: those given, else :data:`BENCH_CONTEXTS`, each
    that the model's positions cannot hold with ``decode_steps`` after it replaced by the longest they can
    (1,024, 4,096 and 8,174 tokens on an 8K-position model with 18 decode steps)."""
    if contexts:
        return sorted(contexts)
    try:
        limit = getattr(
            AutoConfig.from_pretrained(str(resolve_model_dir(model))), "max_position_embeddings", None
        )
    except (OSError, ValueError):  # check_bench_models says what is wrong with the model
        limit = None
    if limit is None:
        return list(BENCH_CONTEXTS)
    return sorted({min(c, limit - decode_steps) for c in BENCH_CONTEXTS})


def check_bench_models(
    model: str, compressed: list[str], keys: list[str], context: int, decode_steps: int
) -> None:
    """The bench's models, checked before Prefect starts: the original a supported model with safetensors
    weights that holds the longest ``context`` and its ``decode_steps`` (warmup and timed) in its positions
    (and, for ``rotated`` keys, one whose attention can read latents of rotated keys), each ``compressed``
    directory an lrkv model. Raises ``ValueError`` or ``FileNotFoundError`` with one line."""
    model_dir = resolve_model_dir(model)
    _check_source_model(
        model_dir,
        model,
        "--model takes the original (a compressed model is measured beside it with --compressed)",
    )
    config = AutoConfig.from_pretrained(str(model_dir))
    adapter = get_adapter(config)  # unsupported architectures fail here, naming the supported ones
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and context + decode_steps > limit:
        raise ValueError(
            f"context {context} + {decode_steps} decode steps passes {model}'s {limit} positions: give "
            f"--contexts up to {limit - decode_steps}"
        )
    if "rotated" in keys:
        check_rotated_keys(adapter, config, remedy="--keys rebuilt measures it")
    for path in compressed:
        if not is_compressed_dir(resolve_model_dir(path)):
            raise ValueError(f"--compressed {path} is not an lrkv compressed model (lrkv convert writes one)")


def _check_source_model(
    model_dir: Path,
    ref: str,
    instead: str = "convert takes the original model it was made from (to evaluate this one: lrkv eval)",
) -> None:
    """The original model: not already an lrkv model (``instead`` says what to do), and with safetensors
    weights (no pickle is read)."""
    if is_compressed_dir(model_dir):
        raise ValueError(f"--model {ref} is already an lrkv compressed model; {instead}")
    problem = missing_safetensors(model_dir)
    if problem is not None:
        raise ValueError(f"--model {ref} {problem}")


def check_writable(out: Path) -> None:
    """That ``--out`` can be written: its nearest existing ancestor is a directory this process can create
    entries in, and so is ``out`` itself when it exists (tried, not inferred from permission bits)."""
    ancestor = next(p for p in out.parents if p.exists())
    if not ancestor.is_dir():
        raise NotADirectoryError(f"--out {out} cannot be created: {ancestor} is not a directory")
    for where in (ancestor, out) if out.is_dir() else (ancestor,):
        try:
            Path(tempfile.mkdtemp(prefix=".lrkv-write-check-", dir=where)).rmdir()
        except OSError as err:
            raise PermissionError(
                f"--out {out} is not writable: cannot create files in {where} ({err.strerror})"
            ) from None


def _absolute_paths(recipe: ConvertRecipe) -> ConvertRecipe:
    """Local paths made absolute against this process's directory (the model, data files, ``out``, a local
    store), so that every task reads and writes the same files wherever it runs (a Dask worker may start in
    another directory, or on another host that mounts them at the same place)."""

    def spec(value: str | None) -> str | None:
        return absolute_dataset_spec(value) if value not in (None, HELD_OUT) else value

    def path(value: str | None) -> str | None:
        return absolute_path(value) if value and not is_s3(value) else value

    update = {
        "model": absolute_model_ref(recipe.model),
        "calibration": recipe.calibration.model_copy(update={"dataset": spec(recipe.calibration.dataset)}),
        "eval": recipe.eval.model_copy(update={"dataset": spec(recipe.eval.dataset)}),
        "out": path(recipe.out),
        "store": path(recipe.store),
    }
    if recipe.lora is not None:
        update["lora"] = recipe.lora.model_copy(
            update={"dataset": spec(recipe.lora.dataset), "eval_dataset": spec(recipe.lora.eval_dataset)}
        )
    return recipe.model_copy(update=update)


def _prepare_lora(
    lora: LoraRecipe,
    calibration: str,
    evaluation: str | None,
    has_tokenizer: bool,
    rope: bool,
    key_latents: str,
    notes: list,
) -> LoraRecipe:
    """The LoRA section with its data resolved (training: the calibration data unless given; held-out rows:
    the evaluation data for ``heldout``) and checked, and its targets checked against the architecture."""
    check_targets(rope, lora.targets, key_latents)
    dataset = lora.dataset
    if dataset is None:
        dataset = calibration
        notes.append(f"LoRA trains on {dataset} (the calibration data)")
    eval_dataset = evaluation if lora.eval_dataset == HELD_OUT else lora.eval_dataset
    for spec in filter(None, (dataset, eval_dataset)):
        check_training_dataset(spec, has_tokenizer=has_tokenizer)
    return lora.model_copy(update={"dataset": dataset, "eval_dataset": eval_dataset})
