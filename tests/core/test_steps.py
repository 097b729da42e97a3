"""The conversion's step graph: derived from the config, in an order every executor can follow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lrkv_core.conversion.convert import CompressionConfig, run_steps
from lrkv_core.conversion.steps import StepGraph, conversion_steps, statistic_inputs
from tests.support.models import tiny_config, tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _graph(
    shards: int = 1,
    rows: int | None = None,
    given=(),
    batch_size: int = 8,
    seq_len: int | None = None,
    **config,
) -> StepGraph:
    resolved = CompressionConfig(**config).for_model(tiny_config("llama", 2))
    return conversion_steps(
        resolved, 2, shards=shards, rows=rows, seq_len=seq_len, batch_size=batch_size, given=given
    )


def _check_order(graph: StepGraph) -> None:
    seen: set[str] = set()
    for step in graph:
        assert step.name not in seen, f"{step.name} twice"
        missing = [name for name in step.inputs if name not in seen]
        assert not missing, f"{step.name} reads {missing} before they are computed"
        seen.add(step.name)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"allocator": "uniform"},
        {"allocator": "fisher", "decomposition": "plain"},
        {"allocator": "kl", "refine": {"steps": 0}},
        {"allocator": {"name": "eigen", "rule": "layerwise"}},
        {"decomposition": "plain", "allocator": "lorc"},
        {"ratio": 1.0},
    ],
    ids=str,
)
def test_every_step_follows_the_steps_it_reads(config) -> None:
    graph = _graph(**config)
    _check_order(graph)
    assert graph.names[-1] == "build"
    resolved = CompressionConfig(**config).for_model(tiny_config("llama", 2))
    collected = {name for s in graph for name in statistic_inputs(s)}
    assert collected == {s.name for s in resolved.needed_statistics()}  # what the methods need, nothing else
    assert ("refine" in graph.names) == resolved.refines
    assert graph.result == ("refine" if resolved.refines else "plan")


def test_the_steps_read_what_their_methods_need() -> None:
    config = CompressionConfig(allocator="kl", rank_multiple=8)
    graph = _graph(allocator="kl", rank_multiple=8)
    reads = tuple(f"statistic[{name}]" for name in sorted(config.decomposition.needs))
    assert reads and graph["decompose[1]"].inputs == reads
    params = {"layer": 1, "group_size": 2, "decomposition": config.decomposition.to_dict()}
    assert graph["decompose[1]"].params == params
    kl = graph["statistic[kl_response]"]
    assert kl.inputs == ("decompose[0]", "decompose[1]")  # it reads the factors, so comes after them
    assert graph["summarize[0]"].inputs == ("decompose[0]", "statistic[kl_response]")
    assert graph["plan"].inputs == ("summarize[0]", "summarize[1]")
    assert graph["build"].inputs == ("decompose[0]", "decompose[1]", "refine")
    assert graph["refine"].params == config.refine.to_dict() | {"steps": 3}  # all of RefineConfig


def test_given_statistics_are_not_collected_and_the_config_is_resolved_first() -> None:
    graph = _graph(
        given=["gram"],
        allocator="uniform",
        decomposition={"name": "whitened", "values": "projection", "keys": "projection"},
    )
    assert "statistic[gram]" not in graph.names
    assert graph["decompose[0]"].inputs == ("statistic[gram]",)  # the executor provides it
    with pytest.raises(ValueError, match="for_model"):
        conversion_steps(CompressionConfig(), 2)
    with pytest.raises(ValueError, match="shards"):
        _graph(shards=0)


def test_statistics_become_shards_and_a_merge() -> None:
    graph = _graph(shards=3, rows=8, allocator="kl")
    _check_order(graph)
    for name in ("gram", "attention_gram", "output_fisher", "kl_response"):
        steps = [s for s in graph if s.name.startswith(f"statistic[{name}]")]
        assert [s.kind for s in steps] == ["statistic_shard"] * 3 + ["merge_statistic"], name
        assert [s.params["shard"] for s in steps[:-1]] == [0, 1, 2]
        assert steps[-1].inputs == tuple(s.name for s in steps[:-1])
    kl = [s for s in graph if s.name.startswith("statistic[kl_response]/")]
    assert all(s.inputs == ("decompose[0]", "decompose[1]") for s in kl)  # each shard reads the factors
    # never more shards than a statistic's rows split into: 2 rows, or the batches of a per-batch Fisher
    few = _graph(shards=3, rows=2, allocator="uniform")
    assert sum(s.kind == "statistic_shard" for s in few) == 2 * len(
        [s for s in few if s.kind == "merge_statistic"]
    )
    long = _graph(shards=3, rows=8, seq_len=8192, allocator="kl")  # kl_response reads 2 rows of 8,192
    assert sum(s.name.startswith("statistic[kl_response]/") for s in long) == 2
    assert sum(s.name.startswith("statistic[gram]/") for s in long) == 3
    per_batch = _graph(
        shards=4, rows=16, batch_size=8, allocator="fisher", statistics=[{"name": "fisher", "per_row": False}]
    )
    assert sum(s.name.startswith("statistic[fisher]/") for s in per_batch) == 2


@pytest.mark.parametrize("allocator", ["kl", "fisher"])
def test_a_sharded_graph_gives_the_plan_and_factors_of_one_pass(allocator) -> None:
    """In memory too: 3 uneven shards of 10 rows merge to the statistics of one pass (float64)."""
    model = tiny_model("llama", 2).double()
    rows = torch.randint(3, model.config.vocab_size, (10, 16), generator=torch.Generator().manual_seed(0))
    config = CompressionConfig(ratio=0.5, rank_multiple=4, allocator=allocator).for_model(model.config)
    one = run_steps(model, rows, conversion_steps(config, 2, rows=10), batch_size=3)
    sharded_graph = conversion_steps(config, 2, shards=3, rows=10, batch_size=3)
    assert any(s.kind == "merge_statistic" for s in sharded_graph)
    sharded = run_steps(model, rows, sharded_graph, batch_size=3)
    for name in one:
        if name.startswith("decompose["):
            for kind in ("k", "v"):
                for a, b in zip(one[name].groups[kind], sharded[name].groups[kind], strict=True):
                    torch.testing.assert_close(a.sigma, b.sigma, rtol=1e-5, atol=1e-8)
    result = "refine" if "refine" in one else "plan"
    assert one[result].ranks == sharded[result].ranks


def test_the_flow_runs_the_graph_without_naming_its_steps() -> None:
    """The step order is written once (lrkv_core.conversion.steps): the flow submits whatever the graph
    holds."""
    text = (ROOT / "flows" / "convert.py").read_text()
    for task in ("collect_statistic", "decompose_layer", "summarize_layer", "plan_ranks", "refine_plan"):
        assert task not in text, task


def test_a_conversion_fuses_as_its_config_says() -> None:
    """The build step's options come from the config, in the graph and when a conversion is applied: the
    same plan with another rotation or storage needs no new plan."""
    from dataclasses import replace

    from lrkv_core.conversion.convert import plan_conversion

    model = tiny_model("llama", 2)
    rows = torch.randint(3, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    conversion = plan_conversion(
        model, rows, CompressionConfig(ratio=0.5, rank_multiple=4, allocator="uniform")
    )
    assert conversion.graph["build"].params["rotation"] == {"name": "none", "seed": 0}
    rotated = replace(conversion, config=replace(conversion.config, rotation="hadamard", cache="quantized"))
    fused = rotated.apply(tiny_model("llama", 2)).config.lrkv
    assert fused["rotation"] == "hadamard" and fused["cache"]["name"] == "quantized"
    assert conversion.apply(tiny_model("llama", 2)).config.lrkv["rotation"] == "none"  # the plan's own
