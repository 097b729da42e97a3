"""Every registered statistic as a map over shards of its rows and a reduce: the merged partial sums of 1, 2
or 3 shards give the values and metadata of one ``collect`` over all rows, in memory and through the files.

Tolerance: the shards add the same per-row terms in another order, and rows meet other rows in their
batches (batches of 3 here, so that one-pass and shard batches differ), so the results differ by rounding
only. It is taken relative to each tensor's largest entry (entries such as a curve's uncut end hold only
rounding noise): 1e-10 in float64, far above its ~1e-16 rounding per operation over a few hundred additions
and far below what one misplaced or misweighted row moves (≥ 1e-2 here). The gradient statistics (fisher,
output_fisher, kl_response) round through float32 by design, whatever the model's dtype: the loss is taken
on float32 logits (transformers' loss upcasts them, and so do the passes for sampled targets), the weight
Fisher accumulates in float32 and kl_response's latent products are float32; for them 1e-5, ~100 times
float32's rounding (measured: ≤ 5e-7). One shard is exact.
"""

from __future__ import annotations

import pytest
import torch

from lrkv_core.conversion import pipeline
from lrkv_core.conversion.convert import CompressionConfig, decompose_model
from lrkv_core.statistics import (
    STATISTICS,
    load_partial,
    load_statistic,
    read_header,
    shard_span,
)
from tests.support.inputs import max_relative_gap, statistic_tensors
from tests.support.models import SHARED

pytestmark = pytest.mark.usefixtures("one_thread")

STORIES = SHARED / "models" / "stories260k"
STORIES_CALIB = SHARED / "data" / "stories260k" / "calib.parquet"
ROWS, T, BATCH = 10, 12, 3
GRADIENT_STATISTICS = ("fisher", "output_fisher", "kl_response")
# besides every statistic's defaults: a per-batch Fisher (shards cut between batches), two label draws per
# row, data labels, and n_samples (the rows are selected before they are split)
VARIANTS = [
    {"name": "fisher", "per_row": False},
    {"name": "kl_response", "draws": 2},
    {"name": "output_fisher", "labels": "data"},
    {"name": "gram", "n_samples": 5},
]
SPECS = [{"name": name} for name in STATISTICS.names()] + [v for v in VARIANTS if v["name"] in STATISTICS]


def _id(spec: dict) -> str:
    return "-".join(f"{k}={v}" if k != "name" else v for k, v in spec.items())


def _setup(make_tiny):
    """A float64 tiny Llama, 10 calibration rows, and every layer's plain factors (for kl_response, ...)."""
    model = make_tiny("llama", 2).double()  # L=2, Hkv=2, D=8, d=32
    rows = torch.randint(3, 61, (ROWS, T), generator=torch.Generator().manual_seed(1))
    config = CompressionConfig(group_size=1, rank_multiple=1, decomposition="plain")
    return model, rows, decompose_model(model, rows, config)[0]


def _extra(stat, factors) -> dict:
    return {"factors": factors} if stat.uses_factors else {}


def _tolerance(stat) -> float:
    """1e-5 for the gradient statistics, which round through float32 (see the module docstring), or 1e-10."""
    return 1e-5 if stat.name in GRADIENT_STATISTICS else 1e-10


@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_merged_shards_equal_one_collect(make_tiny, spec) -> None:
    """1, 2 and 3 shards (3 uneven: 4/3/3 rows, a per-batch Fisher 2/1/1 batches), merged in any order,
    give collect's values and metadata; sampled labels are drawn per row, so sharding changes no draw."""
    model, rows, factors = _setup(make_tiny)
    stat = STATISTICS.create(spec)
    extra = _extra(stat, factors)
    if not stat.shardable:  # none is now; one that is not must say so
        with pytest.raises(ValueError, match="cannot be collected in shards"):
            stat.collect_shard(model, rows, shard=(0, 1), batch_size=BATCH, **extra)
        return
    values, meta = stat.collect(model, rows, batch_size=BATCH, **extra)
    n = stat.rows(rows).shape[0]
    for count in (1, 2, 3):
        parts = [
            stat.collect_shard(model, rows, shard=(i, count), batch_size=BATCH, **extra) for i in range(count)
        ]
        assert [p.span for p in parts] == [shard_span(n, (i, count), stat.unit(BATCH)) for i in range(count)]
        assert parts[0].span[0] == 0 and parts[-1].span[1] == n
        merged, merged_meta = stat.merge(parts[::-1])
        assert merged_meta == meta
        if count == 1:
            assert max_relative_gap(merged, values) == 0.0
        else:
            assert max_relative_gap(merged, values) <= _tolerance(stat)
    sizes = [b - a for a, b in (p.span for p in parts)]
    assert len(set(sizes)) > 1, sizes  # the 3 shards are uneven


@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_shards_own_values_averaged_unweighted_are_not_the_statistic(make_tiny, spec) -> None:
    """Uneven shards make the previous test sensitive to the weighting: the plain mean of the 3 shards'
    own values (each shard finished alone, its mean over its own rows) is far from collect's values, while
    the merge (sums and counts added, divided once) matches them."""
    model, rows, factors = _setup(make_tiny)
    stat = STATISTICS.create(spec)
    if not stat.shardable:
        pytest.skip(f"{stat.name} is not shardable")
    extra = _extra(stat, factors)
    values, _ = stat.collect(model, rows, batch_size=BATCH, **extra)
    parts = [stat.collect_shard(model, rows, shard=(i, 3), batch_size=BATCH, **extra) for i in range(3)]
    own = [statistic_tensors(stat.finish(p.sums, p.counts)[0]) for p in parts]
    unweighted = [sum(ts) / len(ts) for ts in zip(*own)]
    gap = max(
        float((u - v).abs().max() / v.abs().max()) for u, v in zip(unweighted, statistic_tensors(values))
    )
    assert gap > 1e3 * _tolerance(stat), gap
    assert max_relative_gap(stat.merge(parts)[0], values) <= _tolerance(stat)


def test_shard_spans_cover_the_rows_in_order_and_refuse_empty_shards() -> None:
    assert [shard_span(7, (i, 3)) for i in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [shard_span(7, (i, 3), 2) for i in range(3)] == [(0, 4), (4, 6), (6, 7)]  # batches 2/1/1
    assert [shard_span(3, (i, 3)) for i in range(3)] == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="cannot cut 3 rows into 4 shards: a shard may not be empty"):
        shard_span(3, (0, 4))
    with pytest.raises(ValueError, match="cannot cut 2 batches of 4 rows into 3 shards"):
        shard_span(7, (0, 3), 4)
    for bad in ((3, 3), (-1, 3), (0, 0)):
        with pytest.raises(ValueError, match="needs 0 ≤ index < count"):
            shard_span(7, bad)


@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_max_shards_is_the_most_a_statistic_splits_into(spec) -> None:
    stat = STATISTICS.create(spec)
    if not stat.shardable:
        assert stat.max_shards(ROWS, BATCH) == 1
        return
    n = min(stat.n_samples or ROWS, ROWS)  # a cap (kl_response) reads all of fewer rows
    most = stat.max_shards(ROWS, BATCH)
    assert most == (-(-n // BATCH) if spec == {"name": "fisher", "per_row": False} else n)
    assert shard_span(n, (most - 1, most), stat.unit(BATCH))[1] == n
    with pytest.raises(ValueError, match="a shard may not be empty"):
        shard_span(n, (0, most + 1), stat.unit(BATCH))


def test_shards_and_merges_are_checked(make_tiny) -> None:
    model, rows, _ = _setup(make_tiny)
    gram = STATISTICS.create({"name": "gram", "n_samples": 3})
    with pytest.raises(ValueError, match="cannot cut 3 rows into 4 shards"):  # n_samples selects first
        gram.collect_shard(model, rows, shard=(0, 4))
    per_batch = STATISTICS.create({"name": "fisher", "per_row": False})
    with pytest.raises(ValueError, match="cannot cut 4 batches of 3 rows into 5 shards"):
        per_batch.collect_shard(model, rows, shard=(0, 5), batch_size=3)
    parts = [gram.collect_shard(model, rows, shard=(i, 3)) for i in range(3)]
    for bad, match in (
        ([], "no shards given"),
        (parts[:2], r"need each of the 3 shards once, got shards \[0, 1\]"),
        ([parts[0], parts[0], parts[2]], r"got shards \[0, 0, 2\]"),
        (parts[:1] + [gram.collect_shard(model, rows, shard=(1, 2))], "shards of different splits"),
    ):
        with pytest.raises(ValueError, match=match):
            gram.merge(bad)
    with pytest.raises(ValueError, match="a shard holds"):
        STATISTICS.create("gram").merge(parts)
    other_rows = gram.collect_shard(model, rows.flip(0), shard=(1, 3))
    with pytest.raises(ValueError, match="shards of different calibration rows"):
        gram.merge([parts[0], other_rows, parts[2]])


def test_sampled_draws_depend_on_the_row_not_on_the_batch(make_tiny) -> None:
    """Each row's labels are drawn from a generator seeded by (seed, row index): batch sizes 1 and 3 give
    the same sampled statistic, another seed another one."""
    model, rows, factors = _setup(make_tiny)
    for spec in ({"name": "output_fisher"}, {"name": "kl_response", "draws": 2}):
        stat = STATISTICS.create(spec)
        extra = _extra(stat, factors)
        one, _ = stat.collect(model, rows, batch_size=1, **extra)
        three, _ = stat.collect(model, rows, batch_size=3, **extra)
        other, _ = STATISTICS.create({**spec, "seed": 1}).collect(model, rows, batch_size=3, **extra)
        assert max_relative_gap(three, one) <= _tolerance(stat)
        assert max_relative_gap(other, one) > 1e-3


# ---------------------------------------------------------------------------------------------- files


@pytest.fixture(scope="module")
def stories_factors(tmp_path_factory) -> list[str]:
    """stories260k's plain factors files (every layer, groups of 2 KV heads), for kl_response and
    layer_output_error."""
    if not (STORIES.exists() and STORIES_CALIB.exists()):
        pytest.skip("shared stories260k model or calibration absent")
    out = tmp_path_factory.mktemp("factors")
    paths = []
    for layer in range(5):
        path = str(out / f"layer{layer}.safetensors")
        pipeline.decompose_file(str(STORIES), {}, layer, path, group_size=2, decomposition="plain")
        paths.append(path)
    return paths


@pytest.mark.parametrize("name", STATISTICS.names())
def test_shard_files_merge_into_the_statistic_file(tmp_path, stories_factors, name) -> None:
    """stories260k, the first 5 calibration rows (256 tokens) in float64: 3 shard files merged are the file
    statistic_file writes (same header, same summary, values within the tolerance)."""
    spec = {"name": name, "n_samples": 5}
    if not STATISTICS.create(spec).shardable:
        pytest.skip(f"{name} is not shardable")
    kw = dict(dtype="float64", batch_size=BATCH)
    factors = stories_factors if STATISTICS.create(spec).uses_factors else ()
    whole = tmp_path / "whole.safetensors"
    summary = pipeline.statistic_file(
        str(STORIES), str(STORIES_CALIB), spec, str(whole), factors=factors, **kw
    )
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"part{i}.safetensors"))
        info = pipeline.statistic_shard_file(
            str(STORIES), str(STORIES_CALIB), spec, paths[-1], shard=i, count=3, factors=factors, **kw
        )
        assert info["shard"] == [i, 3] and info["span"] == list(shard_span(5, (i, 3)))
    merged = tmp_path / "merged.safetensors"
    assert pipeline.merge_statistic_files(paths[::-1], str(merged)) == summary
    assert read_header(merged) == read_header(whole)
    assert max_relative_gap(load_statistic(merged), load_statistic(whole)) <= _tolerance(
        STATISTICS.create(spec)
    )
    assert load_partial(paths[1]).span == shard_span(5, (1, 3))
    with pytest.raises(ValueError, match="partial sums of .*: merge the shards"):
        load_statistic(paths[0])
    with pytest.raises(ValueError, match="is a whole statistic, not one shard's partial sums"):
        load_partial(whole)


def test_shard_file_refuses_a_bad_shard_before_loading_the_model(tmp_path) -> None:
    if not STORIES_CALIB.exists():
        pytest.skip("shared stories260k calibration absent")
    missing = str(tmp_path / "no-model")  # never opened: the shard is checked first
    out = str(tmp_path / "part.safetensors")
    with pytest.raises(ValueError, match="cannot cut 5 rows into 6 shards: a shard may not be empty"):
        pipeline.statistic_shard_file(
            missing, str(STORIES_CALIB), {"name": "gram", "n_samples": 5}, out, shard=0, count=6
        )
    with pytest.raises(ValueError, match="needs 0 ≤ index < count"):
        pipeline.statistic_shard_file(missing, str(STORIES_CALIB), "gram", out, shard=2, count=2)
    with pytest.raises(ValueError, match="partial file of every shard"):
        pipeline.merge_statistic_files([], out)
