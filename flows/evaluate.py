"""The evaluate flow (a deployment beside convert): evaluate any model reference and log it to MLflow."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from prefect import flow

from lrkv_core.evaluation.metrics import EvalResult
from lrkv_tasks import convert as t
from lrkv_tasks.publish import long_context_outputs
from lrkv_tasks.recipes.convert_recipe import HELD_OUT, EvalRecipe, TrackingRecipe
from lrkv_tasks.store.artifact_store import open_store
from lrkv_tasks.tracking.mlflow_runs import log_conversion

from .runner import ConfiguredTaskRunner


@flow(name="lrkv-evaluate", log_prints=True, task_runner=ConfiguredTaskRunner())
def evaluate_flow(
    model: str,
    eval: EvalRecipe,
    dtype: str = "float32",
    base: str | None = None,
    tracking: TrackingRecipe | None = None,
    store: str | None = None,
) -> dict:
    """Evaluate a model (a directory, a hub id, ``models:/NAME@ALIAS``, ...) and log the result to MLflow;
    returns ``{"eval": EvalResult, "mlflow": the run}``."""
    if eval.dataset in (None, HELD_OUT):
        raise ValueError(
            "the evaluate flow needs an explicit eval.dataset (held-out data belongs to a conversion)"
        )
    tracking = tracking or TrackingRecipe()
    st = open_store(store)
    storage = st.result_storage()
    ref = t.resolve_model.with_options(result_storage=storage)(model, st.root)
    base_ref = t.resolve_model.with_options(result_storage=storage)(base, st.root) if base else None
    result = EvalResult.from_dict(
        t.evaluate.with_options(result_storage=storage)(
            ref, eval.model_dump(exclude={"long"}), dtype, "model", base_ref, st.root
        )
    )
    metrics = result.metrics()
    if result.kl is not None:
        metrics |= {"kl_base_model": result.kl_to_base, "top1_agreement": result.top1_agreement}
    tables, figures = {}, {}
    with tempfile.TemporaryDirectory(prefix="lrkv-figures-") as scratch:
        if eval.long is not None:  # the long-context suite, with the base model on the same data
            long = t.evaluate_long.with_options(result_storage=storage)(
                ref, eval.dataset, eval.long.model_dump(), dtype, "model", base_ref, st.root
            )
            result = replace(result, long=long)
            long_metrics, tables, figures = long_context_outputs(long, scratch)
            metrics |= long_metrics
        run = log_conversion(
            tracking_uri=tracking.mlflow_uri,
            experiment=tracking.experiment,
            run_name=f"evaluate-{Path(model).name}",
            params={
                "model": model,
                "base": base,
                "dtype": dtype,
                **{f"eval.{k}": v for k, v in eval.model_dump(exclude={"long"}).items()},
                **{f"eval.long.{k}": v for k, v in (eval.long.model_dump() if eval.long else {}).items()},
            },
            metrics=metrics,
            json_artifacts={"eval.json": result.to_dict()},
            file_artifacts={},
            tags={"lrkv.kind": "evaluate", "lrkv.model": model},
            tables=tables,
            figures=figures,
        )
    print(f"prefill PPL {metrics['prefill_ppl']:.4f}, decode PPL {metrics['decode_ppl']:.4f}")
    print(f"MLflow run {run['run_id']}")
    return {"eval": result, "mlflow": run}
