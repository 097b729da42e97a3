"""Statistics collected together in one pass over the rows give what each gives collected alone.

A float64 tiny Llama, so the only differences are rounding: a pass with the attention Gram runs eager
attention, whose softmax transformers takes in float32 (the fused kernel stays in float64), so what the
Gram and the output Fisher read after the first layer differs from their own passes by float32 rounding
(measured: 5e-8 relative); the gradient statistics take their loss on float32 logits either way. The
attention Gram runs eager attention alone too. Sampled targets are compared as well as data labels: on this
model no draw moves (on a float32 model one at a boundary could).
"""

from __future__ import annotations

import pytest
import torch

from lrkv_core.conversion import pipeline
from lrkv_core.conversion.convert import CompressionConfig, plan_conversion
from lrkv_core.conversion.steps import conversion_steps, joint_step, statistic_step
from lrkv_core.statistics import STATISTICS, gradients, load_statistic, read_header
from lrkv_core.statistics.joint import collect_joint
from tests.support.inputs import max_relative_gap
from tests.support.models import tiny_model_dir, token_parquet

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, T, BATCH = 6, 12, 2
JOINED = ("attention_gram", "gram", "output_fisher")
TOLERANCE = {"attention_gram": 1e-10, "gram": 1e-6, "output_fisher": 1e-5}


def _setup(make_tiny):
    model = make_tiny("llama", 2).double()  # L=2, Hkv=2, D=8, d=32
    rows = torch.randint(3, 61, (ROWS, T), generator=torch.Generator().manual_seed(1))
    return model, rows


def _layer_calls(model):
    """A counter of the first decoder layer's forward calls (a checkpointed layer's recomputation calls its
    forward function, not the module: uncounted), and the hook's handle."""
    calls = [0]
    layer = model.model.layers[0]
    handle = layer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls, handle


@pytest.mark.parametrize("labels", ["data", "sampled"])
@pytest.mark.parametrize("long_rows", [False, True], ids=["rows", "checkpointed-rows"])
def test_one_pass_gives_each_statistics_own_values(make_tiny, monkeypatch, labels, long_rows) -> None:
    """The Gram, the attention Gram and the output Fisher from one pass equal each collected alone (and
    their metadata), in a third of the forward passes; with every row checkpointed (its layers recomputed
    in the backward pass) the forward statistics still count each row once."""
    if long_rows:
        monkeypatch.setattr(gradients, "CHECKPOINT_TOKENS", 1)
    model, rows = _setup(make_tiny)
    stats = [STATISTICS.create(n) for n in ("attention_gram", "gram")]
    stats.append(STATISTICS.create({"name": "output_fisher", "labels": labels}))
    calls, handle = _layer_calls(model)
    alone = [s.collect(model, rows, batch_size=BATCH) for s in stats]
    separate_calls, calls[0] = calls[0], 0
    joint = collect_joint(stats, model, rows, batch_size=BATCH)
    handle.remove()
    batches = ROWS // BATCH
    assert separate_calls == 3 * batches and calls[0] == batches
    for s, (values, meta), (want, want_meta) in zip(stats, joint, alone, strict=True):
        assert meta == want_meta, s.name
        assert max_relative_gap(values, want) <= TOLERANCE[s.name], s.name
    assert model.config._attn_implementation != "eager"  # the pass's eager attention is undone


def test_forward_statistics_alone_share_one_forward_pass(make_tiny) -> None:
    model, rows = _setup(make_tiny)
    stats = [STATISTICS.create(n) for n in ("gram", "attention_gram")]
    calls, handle = _layer_calls(model)
    joint = collect_joint(stats, model, rows, batch_size=BATCH)
    handle.remove()
    assert calls[0] == ROWS // BATCH
    for s, (values, _) in zip(stats, joint, strict=True):
        assert max_relative_gap(values, s.collect(model, rows, batch_size=BATCH)[0]) <= TOLERANCE[s.name]


@pytest.mark.parametrize(
    "rows_of",
    [{"output_fisher": 2}, {"gram": 4, "attention_gram": 2}, {"output_fisher": 4, "attention_gram": 2}],
    ids=["fewer-gradient-rows", "fewer-forward-rows", "three-stretches"],
)
def test_statistics_on_different_rows_share_the_rows_they_have_in_common(make_tiny, rows_of) -> None:
    """Statistics on different numbers of rows (``n_samples``) in one joint pass: each gets what it gets
    collected alone, every row runs through the layers once, and the backward pass runs only over the rows
    a gradient statistic reads."""
    model, rows = _setup(make_tiny)
    stats = [STATISTICS.create({"name": n, "n_samples": rows_of.get(n)}) for n in JOINED]
    alone = [s.collect(model, rows, batch_size=BATCH) for s in stats]
    calls, handle = _layer_calls(model)
    backward = [0]  # backward passes through the first layer's k_proj

    def count_backward(_module, _args, out) -> None:
        if out.requires_grad:
            out.register_hook(lambda _g: backward.__setitem__(0, backward[0] + 1))

    hook = model.model.layers[0].self_attn.k_proj.register_forward_hook(count_backward)
    seen: list[tuple[int, int]] = []
    joint = collect_joint(stats, model, rows, batch_size=BATCH, progress=lambda d, n: seen.append((d, n)))
    handle.remove()
    hook.remove()
    assert calls[0] == ROWS // BATCH  # the stretches' batches: 2 + 2 + 2 rows
    gradient_rows = rows_of.get("output_fisher", ROWS)
    assert backward[0] == -(-gradient_rows // BATCH)
    assert seen[-1] == (ROWS, ROWS) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    for s, (values, meta), (want, want_meta) in zip(stats, joint, alone, strict=True):
        assert meta == want_meta, s.name
        assert max_relative_gap(values, want) <= TOLERANCE[s.name], s.name


def test_a_joint_pass_refuses_what_it_cannot_share(make_tiny) -> None:
    model, rows = _setup(make_tiny)
    gram = STATISTICS.create("gram")
    with pytest.raises(ValueError, match="fisher cannot share a pass"):
        collect_joint([gram, STATISTICS.create("fisher")], model, rows)
    with pytest.raises(ValueError, match="asks for 8 calibration rows, the calibration has 6"):
        collect_joint([STATISTICS.create({"name": "gram", "n_samples": 8})], model, rows)
    with pytest.raises(ValueError, match="each statistic once"):
        collect_joint([gram, gram], model, rows)
    with pytest.raises(ValueError, match="at least one"):
        collect_joint([], model, rows)


def test_the_graph_collects_the_shareable_statistics_in_one_step() -> None:
    """The default decomposition's three statistics: one joint step and a pick step each, named as their
    own collection would be, also when they read different numbers of rows; the allocator's KL response (it
    reads the factors) and a weight Fisher (its own passes) stay steps of their own; statistics in shards
    are not joined."""
    config = CompressionConfig(allocator="fisher-greedy", group_size=1, rank_multiple=1).for_model(_config())
    graph = conversion_steps(config, 2)
    joint = graph[joint_step(JOINED)]
    assert joint.kind == "statistics" and [r["name"] for r in joint.params["statistics"]] == list(JOINED)
    for name in JOINED:
        assert graph[statistic_step(name)].kind == "pick"
        assert graph[statistic_step(name)].inputs == (joint.name,)
    assert graph[statistic_step("fisher")].kind == "statistic"
    sharded = conversion_steps(config, 2, shards=2, rows=8, batch_size=2)
    assert "statistics" not in {s.kind for s in sharded}
    apart = CompressionConfig(
        group_size=1, rank_multiple=1, statistics=[{"name": "output_fisher", "n_samples": 4}]
    ).for_model(_config())
    kinds = {s.name: s.kind for s in conversion_steps(apart, 2)}
    assert kinds[joint_step(JOINED)] == "statistics" and kinds[statistic_step("output_fisher")] == "pick"


def test_plan_conversion_runs_the_joint_step(make_tiny) -> None:
    """In memory, the joint step's statistics are the ones collected alone: the same plan and factors."""
    model, rows = _setup(make_tiny)
    config = CompressionConfig(ratio=0.5, group_size=1, rank_multiple=1, refine={"steps": 0})
    alone = {n: STATISTICS.create(n).collect(model, rows, batch_size=BATCH)[0] for n in JOINED}
    joint = plan_conversion(model, rows, config, batch_size=BATCH)
    given = plan_conversion(model, rows, config, statistics=alone, batch_size=BATCH)
    assert joint.graph[joint_step(JOINED)].kind == "statistics"
    assert joint.plan.ranks == given.plan.ranks
    for a, b in zip(joint.factors, given.factors, strict=True):
        pairs = [(x, y) for kind in ("k", "v") for x, y in zip(a.groups[kind], b.groups[kind], strict=True)]
        for x, y in pairs:
            assert torch.allclose(x.up, y.up, atol=1e-6) and torch.allclose(x.down, y.down, atol=1e-6)


def test_statistics_files_write_each_statistics_file(tmp_path) -> None:
    """Through files: each statistic's file holds the header and values ``statistic_file`` writes for it."""
    model_dir = tiny_model_dir(tmp_path)
    calib = token_parquet(tmp_path / "calib.parquet", rows=4, seq_len=16)
    specs = [{"name": "attention_gram"}, {"name": "gram"}, {"name": "output_fisher", "labels": "data"}]
    outs = [str(tmp_path / f"{n}.safetensors") for n in JOINED]
    metas = pipeline.statistics_files(str(model_dir), str(calib), specs, outs, batch_size=2)
    for spec, out, meta in zip(specs, outs, metas, strict=True):
        alone = str(tmp_path / f"alone-{spec['name']}.safetensors")
        assert meta == pipeline.statistic_file(str(model_dir), str(calib), spec, alone, batch_size=2)
        assert read_header(out) == read_header(alone)
        gap = max_relative_gap(load_statistic(out), load_statistic(alone))
        assert gap <= 1e-4, spec  # a float32 model: rounding of eager against fused attention
    with pytest.raises(ValueError, match="as many files"):
        pipeline.statistics_files(str(model_dir), str(calib), specs, outs[:1])


def _config():
    from tests.support.models import tiny_config

    return tiny_config("llama", 2)
