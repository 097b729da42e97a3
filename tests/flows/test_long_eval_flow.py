"""The long-context suite in the convert flow (``eval.long``): a cached task next to the standard evaluation,
its metrics, table and figure in the MLflow run, and its tables in the flow's summary."""

import math

import pytest
from mlflow.tracking import MlflowClient

from lrkv_core.conversion.pipeline import evaluate_long_dir
from lrkv_core.evaluation.longcontext import LongContextResult
from lrkv_flows.convert import convert_flow
from lrkv_flows.report import console, print_summary
from lrkv_tasks.recipes.convert_recipe import LongEvalRecipe, load_recipe
from lrkv_tasks.summary import summary_markdown
from tests.support.models import SHARED

MODEL = SHARED / "models" / "shakespeare-llama"
DATA = SHARED / "data" / "shakespeare"
LONG = {
    "lengths": [128, 320],
    "continuation": 32,
    "windows": 2,
    "depths": [0.0, 1.0],
    "samples": 1,
    "needles": ["passkey"],
}

pytestmark = pytest.mark.skipif(not MODEL.is_dir(), reason=f"{MODEL} is not there (../shared is absent)")


def _recipe(tmp_path, mlflow_uri, **overrides):
    return load_recipe(
        None,
        {
            "model": str(MODEL),
            "calibration": {"dataset": f"text:{DATA / 'train.txt'}", "n_samples": 8, "seq_len": 64},
            "compression": {"ratio": 0.5, "group_size": 2, "allocator": "uniform"},
            "eval": {
                "dataset": f"text:{DATA / 'valid.txt'}",
                "seq_len": 64,
                "max_windows": 2,
                "decode_prefix": 32,
                "decode_windows": 1,
            },
            "tracking": {"mlflow_uri": mlflow_uri, "experiment": "long-eval-test"},
            "store": str(tmp_path / "store"),
            "registry": {"enabled": False},
        }
        | overrides,
    )


def test_the_long_suite_runs_in_the_flow_cached_and_logged(prefect_api, mlflow_server, tmp_path):
    plain = _recipe(tmp_path, mlflow_server)
    first = convert_flow(plain)
    assert "evaluate_long[compressed]" not in {row["task"] for row in first.timings}
    assert first.eval.compressed.long is None

    with_long = _recipe(tmp_path, mlflow_server, **{"eval": plain.eval.model_dump() | {"long": LONG}})
    second = convert_flow(with_long)
    states = {row["task"]: row["state"] for row in second.timings}
    # the standard evaluations do not depend on eval.long: they come from the cache
    assert states["evaluate[base]"] == states["evaluate[compressed]"] == "Cached", states
    assert states["evaluate_long[compressed]"] == "Completed" and states["log_run"] == "Completed"

    long = second.eval.compressed.long
    result = LongContextResult.from_dict(long)
    assert result.to_dict() == long  # the stored result reads back whole
    assert result.protocol.context_lengths == (128, 320) and result.protocol.prompt_lengths == (128, 320)
    # the same suite run in memory on the flow's compressed model and the original gives the same numbers
    again = evaluate_long_dir(
        second.compressed.uri,
        with_long.eval.dataset,
        LongEvalRecipe(**LONG).protocol(with_long.eval.dataset),
        base_dir=str(MODEL),
    )
    assert [c.nll for c in again.continuation] == pytest.approx([c.nll for c in result.continuation])
    assert [r.correct for r in again.retrieval] == [r.correct for r in result.retrieval]
    assert all(c.base_nll is not None and c.base_nll < c.nll for c in result.continuation)  # ratio 0.5 costs

    run = MlflowClient(mlflow_server).get_run(second.mlflow["run_id"])
    m = run.data.metrics
    for c in result.continuation:
        assert m[f"long_ppl_at_{c.context_len}"] == pytest.approx(math.exp(c.nll))
        assert m[f"long_base_ppl_at_{c.context_len}"] == pytest.approx(math.exp(c.base_nll))
    for n in (128, 320):
        cells = [r for r in result.retrieval if r.length == n]
        assert len(cells) == 2  # one per depth
        assert m[f"long_passkey_accuracy_at_{n}"] == sum(r.correct for r in cells) / 2
        assert m[f"long_base_passkey_accuracy_at_{n}"] == sum(r.base_correct for r in cells) / 2
    artifacts = {a.path for a in MlflowClient(mlflow_server).list_artifacts(run.info.run_id)}
    assert {"long_context.json", "long_context.png", "eval.json"} <= artifacts

    summary = summary_markdown(second)
    assert "## Long-context suite" in summary and "| 320 | 2 |" in summary
    assert "Retrieval `passkey`" in summary
    with console.capture() as shown:  # what lrkv convert prints
        print_summary(second)
    assert "long-context suite" in shown.get() and "| 320 | 2 |" in shown.get()

    third = convert_flow(with_long)  # a rerun is served from the cache
    assert {row["state"] for row in third.timings} == {"Cached"}, third.timings
    assert third.eval.compressed.long == long


def test_a_bad_long_section_is_refused_before_any_work(tmp_path):
    from pydantic import ValidationError

    for bad, why in (
        ({"needles": ["haystack"]}, "unknown retrieval task"),
        ({"depths": [1.5]}, r"depth must be in \[0, 1\]"),
        ({"lengths": [0]}, "lengths must be positive"),
        ({"samples": -1}, "greater than or equal to 0"),
    ):
        with pytest.raises(ValidationError, match=why):
            _recipe(tmp_path, "sqlite:///x.db", **{"eval": {"dataset": "text:x.txt", "long": bad}})


def test_the_evaluate_flow_runs_the_long_suite_and_logs_it(prefect_api, tmp_path):
    from lrkv_flows.evaluate import evaluate_flow
    from lrkv_tasks.recipes.convert_recipe import EvalRecipe, TrackingRecipe

    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    dataset = f"text:{DATA / 'valid.txt'}"
    long = LONG | {"lengths": [128], "depths": [0.5]}
    ev = EvalRecipe(dataset=dataset, seq_len=64, max_windows=2, decode_prefix=32, decode_windows=1, long=long)
    tracking = TrackingRecipe(mlflow_uri=mlflow_uri, experiment="eval-long-test")
    result = evaluate_flow(str(MODEL), ev, tracking=tracking, store=str(tmp_path / "store"))
    suite = LongContextResult.from_dict(result["eval"].long)
    assert [c.context_len for c in suite.continuation] == [128] and len(suite.retrieval) == 1
    assert suite.continuation[0].base_nll is None  # no base given: the model alone
    run = MlflowClient(mlflow_uri).get_run(result["mlflow"]["run_id"])
    assert run.data.metrics["long_ppl_at_128"] == pytest.approx(math.exp(suite.continuation[0].nll))
    assert "long_base_ppl_at_128" not in run.data.metrics
    assert run.data.params["eval.long.lengths"] == "[128]"
    artifacts = {a.path for a in MlflowClient(mlflow_uri).list_artifacts(run.info.run_id)}
    assert {"long_context.json", "long_context.png"} <= artifacts
