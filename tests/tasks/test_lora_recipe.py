"""The recipe's ``lora:`` section, the CLI's flags for it, its preflight checks and its loss-curve figure."""

from __future__ import annotations

import dataclasses
import typing

import matplotlib.image
import pytest
from pydantic import ValidationError

from lrkv_core.lora import ROLES, RecoveryConfig
from lrkv_flows.commands.convert import lora_overrides
from lrkv_tasks.recipes.convert_recipe import LoraRecipe, Role, load_recipe
from lrkv_tasks.recipes.preflight import prepare
from lrkv_tasks.tracking.plots import plot_loss_curve
from tests.support.models import tiny_model_dir, token_parquet


def test_lora_is_off_by_default_and_its_defaults_are_the_cores():
    assert load_recipe(None).lora is None
    recipe = LoraRecipe()
    core = RecoveryConfig()
    for f in dataclasses.fields(RecoveryConfig):  # one set of defaults, whichever entry point is used
        assert getattr(recipe.to_config(), f.name) == getattr(core, f.name), f.name
    assert (core.r, core.alpha, core.lr, core.scheduler) == (32, 32.0, 2e-4, "cosine")  # Palu's
    core_fields = {f.name for f in dataclasses.fields(RecoveryConfig)}
    assert set(LoraRecipe.model_fields) == core_fields | {"dataset", "eval_dataset"}  # built from the core's
    help_r = RecoveryConfig.__dataclass_fields__["r"].metadata["help"]
    assert LoraRecipe.model_fields["r"].description == help_r
    assert set(typing.get_args(Role)) == set(ROLES)


@pytest.mark.parametrize(
    "section",
    [
        {"stpes": 10},  # typo
        {"targets": ["k_proj"]},  # not a role of the latent attention
        {"targets": ["k_down", "k_down"]},
        {"targets": []},
        {"scheduler": "step"},
        {"steps": 0},
        {"dropout": 1.0},
    ],
)
def test_strict_lora_sections_fail_loudly(section):
    with pytest.raises(ValidationError):
        load_recipe(None, {"lora": section})


def test_cli_flags_turn_lora_on_and_off():
    assert lora_overrides(None, None, {}) == {}
    assert lora_overrides(True, None, {}) == {"lora": {}}
    assert lora_overrides(True, 7, {"lora": {"r": 8}}) == {"lora.steps": 7}  # keeps the recipe's section
    assert lora_overrides(None, 7, {}) == {"lora": {}, "lora.steps": 7}
    assert lora_overrides(False, None, {"lora": {"r": 8}}) == {"lora": None}
    recipe = load_recipe(None, lora_overrides(None, 7, {}))
    assert recipe.lora.steps == 7 and recipe.lora.r == 32


def test_preflight_resolves_the_lora_data_and_checks_targets(tmp_path):
    data = token_parquet(tmp_path / "data.parquet", rows=20, seq_len=32)
    base = {"calibration.dataset": f"parquet:{data}", "compression.group_size": 2, "lora": {}}
    prepared = prepare(load_recipe(None, {**base, "model": str(tiny_model_dir(tmp_path))}))
    lora = prepared.recipe.lora
    assert lora.dataset == f"parquet:{data}[:90%]" and lora.eval_dataset == f"parquet:{data}[90%:]"
    assert any("LoRA trains on" in note for note in prepared.notes)
    assert prepare(prepared.recipe).recipe == prepared.recipe  # idempotent
    opt = str(tiny_model_dir(tmp_path, "opt"))
    with pytest.raises(ValueError, match="'k_up' needs a RoPE model"):
        prepare(load_recipe(None, {**base, "model": opt, "compression.group_size": 4,
                                   "lora": {"targets": ["k_up"]}}))  # fmt: skip
    with pytest.raises(ValueError, match="'k_up' cannot adapt latents of rotated keys"):
        rotated = {"compression.rank_multiple": 2, "compression.key_latents": "rotated"}
        prepare(load_recipe(None, {**base, **rotated, "model": str(tiny_model_dir(tmp_path)),
                                   "lora": {"targets": ["k_up"]}}))  # fmt: skip
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        prepare(load_recipe(None, {**base, "model": opt, "compression.group_size": 4,
                                   "lora": {"dataset": f"text:{tmp_path / 'missing.txt'}"}}))  # fmt: skip


def test_preflight_makes_local_paths_absolute(tmp_path, monkeypatch):
    """A recipe written with paths relative to where the user is runs the same on a Dask worker elsewhere."""
    tiny_model_dir(tmp_path)
    token_parquet(tmp_path / "data.parquet", rows=20, seq_len=32)
    monkeypatch.chdir(tmp_path)
    model = next(p.name for p in tmp_path.iterdir() if (p / "config.json").is_file())
    recipe = load_recipe(
        None,
        {"model": f"./{model}", "calibration.dataset": "parquet:data.parquet", "compression.group_size": 2}
        | {"out": "out", "store": "store", "lora": {"eval_dataset": "parquet:data.parquet[:10%]"}},
    )
    prepared = prepare(recipe).recipe
    assert prepared.model == str(tmp_path / model)
    assert prepared.calibration.dataset == f"parquet:{tmp_path}/data.parquet[:90%]"  # the held-out split
    assert prepared.eval.dataset == f"parquet:{tmp_path}/data.parquet[90%:]"
    assert prepared.lora.dataset == prepared.calibration.dataset
    assert prepared.lora.eval_dataset == f"parquet:{tmp_path}/data.parquet[:10%]"
    assert (prepared.out, prepared.store) == (str(tmp_path / "out"), str(tmp_path / "store"))
    assert prepare(recipe.model_copy(update={"store": "s3://lrkv/store"})).recipe.store == "s3://lrkv/store"


def test_loss_curve_png(tmp_path):
    history = [{"step": s, "loss": 3.0 - 0.01 * s + 0.1 * (s % 3), "lr": 1e-3} for s in range(1, 101)]
    evals = [{"step": s, "eval_loss": 3.0 - 0.008 * s} for s in (0, 50, 100)]
    out = plot_loss_curve(history, evals, tmp_path / "curve.png")
    image = matplotlib.image.imread(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.shape[0] > 200
    assert image[..., :3].std() > 0.05  # not a blank canvas
