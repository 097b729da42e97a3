"""``lrkv eval``: a model directory evaluated directly (the standard windows or the long suite)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from lrkv_core.evaluation.metrics import EvalResult

from ..options import (
    csv_list,
    path_option,
)
from ..report import console, fail, print_eval, recipe_error, rich_progress
from .common import (
    DATASET_FORMS,
    DeviceOption,
    cache_option,
    step,
    user_errors,
)


def eval_cmd(
    model_dir: Annotated[str, typer.Argument(help="compressed model dir (or any supported model)")],
    dataset: Annotated[str, typer.Option(help=DATASET_FORMS)],
    seq_len: int = 256,
    max_windows: Optional[int] = None,
    decode_prefix: Optional[int] = None,
    decode_windows: int = 16,
    batch_size: int = 8,
    json_out: Annotated[
        Optional[Path], path_option("--json-out", "write the result JSON here", "FILE")
    ] = None,
    base: Annotated[
        Optional[str], typer.Option(help="the original model: adds KL(base ‖ model) and top-1 agreement")
    ] = None,
    tasks: Annotated[Optional[str], typer.Option(help="lm-eval zero-shot tasks, comma list")] = None,
    tasks_path: Annotated[
        Optional[Path], path_option("--tasks-path", "directory of local lm-eval task YAMLs", "DIR")
    ] = None,
    limit: Annotated[Optional[int], typer.Option(help="documents per zero-shot task")] = None,
    hf_quant_cache: Annotated[
        Optional[str],
        typer.Option(
            help="evaluate an original model through transformers' QuantizedCache, the anchor for lrkv's "
            "quantized cache: BACKEND:BITS[:GROUP[:RESIDUAL]], e.g. hqq:4 (hqq: 2/3/4/8 bits, quanto: 2/4; "
            "per-token groups, default group = head dim, residual 0); needs `pip install 'lrkv\\[anchor]'`"
        ),
    ] = None,
    cache: cache_option(
        "evaluate a compressed model with another cache storage", "the one it was saved with"
    ) = None,
    device: DeviceOption = None,
    suite: Annotated[
        str,
        typer.Option(
            help="standard: prefill/decode PPL, KV bytes; long: continuation NLL after long contexts and "
            "needle retrieval through the model's cache (--lengths, --depths, --samples, --continuation, "
            "--stride)"
        ),
    ] = "standard",
    lengths: Annotated[
        Optional[str], typer.Option(help="--suite long: context/prompt lengths (default 1024,2048,4096,8192)")
    ] = None,
    depths: Annotated[
        Optional[str], typer.Option(help="--suite long: needle depths in 0..1 (default 0,0.25,0.5,0.75,1)")
    ] = None,
    samples: Annotated[int, typer.Option(help="--suite long: prompts per task × length × depth")] = 4,
    continuation: Annotated[int, typer.Option(help="--suite long: tokens scored after each context")] = 256,
    stride: Annotated[
        Optional[int],
        typer.Option(
            help="--suite long: continuation windows start this many tokens apart (≥ --continuation; "
            "default: windows do not overlap)"
        ),
    ] = None,
    needles: Annotated[
        Optional[str],
        typer.Option(help="--suite long: passkey,needle,multikey,variables (default the first three)"),
    ] = None,
    seed: Annotated[int, typer.Option(help="--suite long: the retrieval prompts' seed")] = 0,
) -> None:
    """Evaluate a model: prefill PPL, teacher-forced decode PPL, measured KV bytes/token."""
    device = device or "cpu"
    if suite != "standard":
        long_options = dict(lengths=lengths, depths=depths, samples=samples, continuation=continuation)
        long_options |= {"needles": needles, "seed": seed, "stride": stride}
        return _eval_long(
            model_dir, dataset, suite, long_options, max_windows, json_out,
            base_dir=base, hf_quantized_cache=hf_quant_cache, cache=cache, device=device,
        )  # fmt: skip
    with user_errors():
        res = _evaluate(
            model_dir,
            dataset,
            seq_len,
            decode_prefix,
            max_windows=max_windows,
            decode_windows=decode_windows,
            batch_size=batch_size,
            base_dir=base,
            hf_quantized_cache=hf_quant_cache,
            cache=cache,
            device=device,
        )
        if tasks:
            from lrkv_tasks.zeroshot import run_zeroshot

            with rich_progress(), step("zero-shot tasks"):
                zeroshot = run_zeroshot(
                    model_dir,
                    csv_list(tasks),
                    include_path=str(tasks_path) if tasks_path else None,
                    limit=limit,
                    batch_size=batch_size,
                    device=device,
                )
            res = replace(res, zeroshot=zeroshot)
    print_eval(model_dir, res)
    text = json.dumps(res.to_dict(), indent=2)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text)
        console.print(f"wrote {json_out}")
    else:
        console.print_json(text)


def _evaluate(model_dir: str, dataset: str, seq_len: int, decode_prefix: int | None, **options) -> EvalResult:
    """:func:`lrkv_core.conversion.pipeline.evaluate_dir` with the CLI's progress (``options``: its
    keywords)."""
    from lrkv_core.conversion.pipeline import evaluate_dir

    if decode_prefix is not None and not 0 < decode_prefix < seq_len:
        raise ValueError(f"--decode-prefix {decode_prefix} must be inside the window (1..{seq_len - 1})")
    with rich_progress(), step("evaluate") as advance:
        prefix = decode_prefix or seq_len // 2
        return evaluate_dir(
            model_dir, dataset, seq_len=seq_len, decode_prefix=prefix, progress=advance, **options
        )


def _eval_long(
    model_dir: str, dataset: str, suite: str, opts: dict, windows: int | None, json_out: Path | None, **kwargs
) -> None:
    """``lrkv eval --suite long``: :func:`lrkv_core.conversion.pipeline.evaluate_long_dir`, printed as
    tables."""
    from lrkv_core.conversion.pipeline import evaluate_long_dir
    from lrkv_tasks.recipes.convert_recipe import LongEvalRecipe

    if suite != "long":
        raise fail(f"--suite must be standard or long, got {suite!r}")
    with user_errors(recipe_error):
        given = {
            "lengths": csv_list(opts["lengths"], int),
            "depths": csv_list(opts["depths"], float),
            "needles": csv_list(opts["needles"]),
        }
        fixed = {k: opts[k] for k in ("continuation", "samples", "seed", "stride")}
        section = LongEvalRecipe(**{k: v for k, v in given.items() if v}, **fixed, windows=windows or 8)
        protocol = section.protocol(dataset)
        with rich_progress(), step("long-context suite") as advance:
            res = evaluate_long_dir(model_dir, dataset, protocol, progress=advance, **kwargs)
    console.print(f"long-context suite: {model_dir}\n\n{res.markdown()}", markup=False, highlight=False)
    text = json.dumps(res.to_dict() | {"model": model_dir}, indent=2)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text)
        console.print(f"wrote {json_out}")
    else:
        console.print_json(text)
