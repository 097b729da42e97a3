from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from lrkv_core.allocation import DEFAULT_ALLOCATOR, Allocator
from lrkv_core.conversion.convert import CompressionConfig
from lrkv_core.decompositions import Decomposition
from lrkv_core.quant.rotation import RotationConfig
from lrkv_tasks.recipes.convert_recipe import (
    ConvertRecipe,
    apply_overrides,
    flatten,
    load_recipe,
    method_label,
)
from tests.support.models import tiny_config

RECIPES = Path(__file__).resolve().parents[2] / "docs" / "recipes"  # the recipes the docs offer


def test_defaults_are_the_embedded_quickstart():
    r = ConvertRecipe()
    assert r.model == "builtin:pydoc-llama"
    assert r.calibration.dataset is None and r.eval.dataset == "heldout"  # chosen per model by preflight
    assert r.compression.name == "palu" and r.compression.ratio == 0.5 and r.compression.group_size == "auto"
    assert isinstance(r.compression.decomposition, Decomposition) and isinstance(
        r.compression.allocator, Allocator
    )
    # the measured defaults (docs/allocation.md), the same in a recipe and in memory
    assert r.compression.allocator.name == CompressionConfig().allocator.name == DEFAULT_ALLOCATOR == "kl"
    assert r.compression.allocator.solver == "exact" and r.calibration.n_samples == 256
    config = r.compression.to_config()
    assert (config.refine.steps, config.refine.rows, config.refine.radius) == (3, 32, 4)
    assert config.refine.accept_rows is None and config.refine.split(256) == (32, 32)
    assert config.refine.objective == CompressionConfig().refine.objective == "nll"
    assert r.compression.decomposition.to_dict() == {
        "name": "whitened",
        "values": "attention",
        "keys": "fisher",
    }


def test_methods_come_from_the_registries_with_strict_options():
    r = load_recipe(None, {"compression.allocator": {"name": "lorc", "skip_threshold": "5"}})
    assert r.compression.allocator.skip_threshold == 5.0  # options are typed from the method's dataclass
    assert r.model_dump(mode="json")["compression"]["allocator"] == {
        "name": "lorc",
        "skip_threshold": 5.0,
        "schedule": "progressive",
    }
    assert load_recipe(None, {"compression.decomposition": "pca"}).compression.decomposition.name == "pca"
    output = load_recipe(None, {"compression.decomposition": {"name": "whitened", "values": "output"}})
    assert output.compression.decomposition.values == "output"
    with pytest.raises(
        ValidationError, match="values: Input should be 'projection', 'output' or 'attention'"
    ):
        load_recipe(None, {"compression.decomposition": {"name": "whitened", "values": "o"}})
    with pytest.raises(ValidationError, match="unknown allocator 'typo'; choose from"):
        load_recipe(None, {"compression.allocator": "typo"})
    with pytest.raises(ValidationError, match=r"allocator 'lorc': skip: Unexpected keyword argument"):
        load_recipe(None, {"compression.allocator": {"name": "lorc", "skip": 5}})
    with pytest.raises(ValidationError, match="skip_threshold must be > 0"):
        load_recipe(None, {"compression.allocator": {"name": "lorc", "skip_threshold": -1}})
    with pytest.raises(ValidationError, match="statistic 'fisher': per_rows"):
        load_recipe(None, {"compression.statistics": [{"name": "fisher", "per_rows": False}]})


def test_method_labels_name_the_options_that_differ_from_the_defaults():
    """Table and tag labels: ``whitened`` for the default, ``whitened(values=projection)`` otherwise; a plain
    dict (no defaults known) shows every option."""
    palu = load_recipe(None, {"compression.decomposition": {"name": "whitened", "values": "projection"}})
    assert method_label(palu.compression.decomposition) == "whitened(values=projection)"
    assert method_label(ConvertRecipe().compression.decomposition) == "whitened"
    lorc = load_recipe(None, {"compression.allocator": {"name": "lorc", "skip_threshold": 5}}).compression
    assert method_label(lorc.allocator) == "lorc(skip_threshold=5.0)"
    assert method_label({"name": "whitened", "values": "attention"}) == "whitened(values=attention)"


def test_the_quantized_cache_and_the_rotation_are_recipe_fields():
    r = load_recipe(
        None,
        {
            "compression.cache": {"name": "quantized", "bits": "3", "quant_group_size": 8},
            "compression.rotation": "auto",
        },
    )
    assert r.compression.cache.bits == 3 and r.compression.cache.quant_group_size == 8  # typed options
    dumped = r.model_dump(mode="json")["compression"]
    assert dumped["cache"] == {"name": "quantized", "bits": 3, "quant_group_size": 8, "residual": 0}
    assert dumped["rotation"] == {"name": "auto", "seed": 0}
    config = r.compression.to_config()
    assert config.rotation.name == "auto" and config.cache.to_dict() == dumped["cache"]
    with pytest.raises(ValidationError, match="quantized cache bits must be one of"):
        load_recipe(None, {"compression.cache": {"name": "quantized", "bits": 5}})
    with pytest.raises(ValidationError, match=r"cache storage 'quantized': group_size: Unexpected keyword"):
        load_recipe(None, {"compression.cache": {"name": "quantized", "group_size": 8}})
    with pytest.raises(ValidationError, match="rotation"):
        load_recipe(None, {"compression.rotation": "random"})


def test_the_rotation_is_a_section_written_as_a_name_a_mapping_or_flat_keys(tmp_path):
    def rotation(data, overrides=None):
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump({"compression": data}))
        rotation = load_recipe(path, overrides).compression.to_config().rotation
        assert isinstance(rotation, RotationConfig)
        return rotation.name, rotation.seed

    assert rotation({}) == ("none", 0)
    assert rotation({"rotation": {"name": "auto", "seed": 2}}) == ("auto", 2)
    assert rotation({"rotation": "auto", "rotation_seed": 3}) == ("auto", 3)  # older recipes
    # a key set inside a section written as a name: the name is kept
    assert rotation({"rotation": "hadamard"}, {"compression.rotation.seed": 5}) == ("hadamard", 5)
    assert rotation({"rotation": {"seed": 4}}, {"compression.rotation.name": "auto"}) == ("auto", 4)
    with pytest.raises(ValidationError, match="spin"):
        rotation({"rotation": {"name": "spin"}})
    with pytest.raises(ValidationError, match="angle"):
        rotation({"rotation": {"name": "auto", "angle": 1}})
    quantized = load_recipe(None, {"compression.cache": "quantized", "compression.cache.bits": 3})
    assert quantized.compression.cache.to_dict()["bits"] == 3
    with pytest.raises(ValueError, match="ratio is 0.5, not a section"):
        apply_overrides({"compression": {"ratio": 0.5}}, {"compression.ratio.value": 1})


def test_the_gear_cache_is_a_recipe_field_checked_against_the_rank_multiple():
    r = load_recipe(None, {"compression.cache": {"name": "gear", "bits": 2, "rank": "4"}})
    assert r.model_dump(mode="json")["compression"]["cache"] == {
        "name": "gear", "bits": 2, "quant_group_size": None, "outlier_share": 0.02, "outliers": None,
        "rank": 4, "rank_share": None, "solver": "power", "iterations": 3, "mode": "whole", "buffer": 20,
    }  # fmt: skip
    with pytest.raises(ValidationError, match="gear cache buffer must be ≥ 0"):
        load_recipe(None, {"compression.cache": {"name": "gear", "buffer": -1}})
    too_many = load_recipe(  # rank multiple 8
        None, {"compression.cache": {"name": "gear", "outliers": 8, "outlier_share": 0}}
    )
    with pytest.raises(ValueError, match="leave nothing to quantize in a group of 8"):
        too_many.compression.to_config().for_model(tiny_config("llama", 2))


def test_the_tale_cache_is_a_recipe_field_and_refuses_a_fused_rotation():
    r = load_recipe(None, {"compression.cache": {"name": "tale", "keep": "0.1"}})
    assert r.model_dump(mode="json")["compression"]["cache"] == {
        "name": "tale", "rule": "recency", "low": 0.5, "value_low": None, "keep": 0.1, "recent": None,
        "sink": 4, "buffer": 32, "low_bits": None, "full_bits": None, "bits": None,
    }  # fmt: skip
    split = load_recipe(None, {"compression.cache": {"name": "tale", "low": "0.2", "value_low": "0.4"}})
    assert split.compression.to_config().cache.create_store((8,), (8,)).lows == {"k": (1,), "v": (3,)}
    counted = load_recipe(None, {"compression.cache": {"name": "tale", "recent": "256"}}).compression
    assert (counted.to_config().cache.recent, counted.to_config().cache.share) == (256, None)
    with pytest.raises(ValidationError, match="tale cache low must be between 0 and 1"):
        load_recipe(None, {"compression.cache": {"name": "tale", "low": 2}})
    with pytest.raises(ValidationError, match="tale cache value_low must be between 0 and 1"):
        load_recipe(None, {"compression.cache": {"name": "tale", "value_low": 2}})
    with pytest.raises(ValidationError, match="never both"):
        load_recipe(None, {"compression.cache": {"name": "tale", "recent": 256, "keep": 0.1}})
    with pytest.raises(ValidationError, match="needs them in spectral order"):  # the core's check, at load
        load_recipe(None, {"compression.cache": "tale", "compression.rotation": "hadamard"})


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model: some/model\ncompression:\n  ratio: 0.7\n  group_size: 2\n")
    over = {"compression.ratio": 0.3, "eval.max_windows": 4, "compression.refine.radius": 2}
    r = load_recipe(p, over | {"compression.refine.objective": "kl"})
    assert (r.compression.to_config().refine.radius, r.compression.to_config().refine.objective) == (2, "kl")
    assert (r.model, r.compression.ratio, r.compression.group_size, r.eval.max_windows) == (
        "some/model",
        0.3,
        2,
        4,
    )


@pytest.mark.parametrize(
    "text",
    [
        "modle: x\n",  # typo at top level
        "compression:\n  ratoi: 0.5\n",  # typo in a section
        "compression:\n  name: gear\n",  # unknown method
        "compression:\n  group_size: 0\n",  # not a group
        "compression:\n  decomposition: {name: plain, rank: 3}\n",  # an option plain does not take
        "compression:\n  ratio: 1.5\n",  # out of range
        "compression:\n  refine: {radius: 0}\n",  # a refinement step that may move nothing
        "compression:\n  refine: {objective: ppl}\n",  # not an objective the refinement has
        "compression:\n  refine: {step: 1}\n",  # not a refinement option
        "compression:\n  refine_radius: 0\n",  # the flat form is checked the same way
        "eval:\n  seq_len: 64\n  decode_prefix: 64\n",  # prefix outside the window
    ],
)
def test_strict_recipes_fail_loudly(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(ValidationError):
        load_recipe(p)


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}


def test_store_and_out_refuse_what_looks_like_a_uri():
    """store takes a directory or s3:// (not ``s3:/`` or gs://), out a local directory (not a URI)."""
    assert load_recipe(None, {"store": "s3://lrkv/store"}).store == "s3://lrkv/store"
    assert load_recipe(None, {"store": "./s3:/lrkv", "out": "./models:/m"}).out == "./models:/m"
    for key, value in [("store", "s3:/lrkv/store"), ("store", "gs://b/x"), ("out", "s3://lrkv/m")]:
        with pytest.raises(ValidationError, match=f"{key} '{value}' looks like a URI"):
            load_recipe(None, {key: value})


@pytest.mark.parametrize(
    ("name", "low"), [("long-context", 0.4375), ("long-context-half", 0.875)], ids=["0.30", "0.47"]
)
def test_the_long_context_recipes_in_the_docs_are_valid_recipes(name, low):
    recipe = load_recipe(RECIPES / f"{name}.yaml", {"model": "some/model"})
    cache = recipe.compression.to_config().cache
    assert (cache.name, cache.rule, cache.keep, cache.low, cache.low_bits, cache.full_bits) == (
        "tale", "recency", 0.2, low, 8, 8,
    )  # fmt: skip
    assert recipe.compression.ratio == 1.0 and recipe.eval.long.lengths == [1024, 2048]


def test_the_tenth_of_the_bytes_recipe_calibrates_on_long_rows_and_keeps_the_newest_tokens_at_8_bits():
    recipe = load_recipe(RECIPES / "long-context-tenth.yaml", {"model": "some/model"})
    config = recipe.compression.to_config()
    cache = config.cache
    assert (cache.name, cache.rule, cache.low, cache.share, cache.level_bits) == (
        "tale", "recency", 1.0, 0.03, (3, 8),
    )  # fmt: skip
    assert (recipe.calibration.n_samples, recipe.calibration.seq_len) == (64, 2048)
    assert config.ratio == 0.5 and config.rotation.name == "none"  # tale cuts latents in spectral order
