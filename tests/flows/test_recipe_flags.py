"""Command-line flags generated from the recipe's schema (lrkv_flows.recipe_flags)."""

from __future__ import annotations

from typing import Annotated, Any

import pytest
import typer
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from lrkv_core.allocation import ALLOCATORS
from lrkv_core.conversion.refine import RefineConfig
from lrkv_flows.commands.convert import CONVERT_FLAGS
from lrkv_flows.commands.search import SEARCH_FLAGS
from lrkv_flows.options import parse_group_size
from lrkv_flows.recipe_flags import RecipeFlag, flag_help, recipe_flags, schema_field
from lrkv_tasks.recipes.convert_recipe import ConvertRecipe
from lrkv_tasks.recipes.registered import RegisteredMethod
from lrkv_tasks.recipes.search_recipe import SearchRecipe


class _Inner(BaseModel):
    seq_len: int = Field(64, description="tokens per window")
    group: int | str = Field("auto", description="a number or auto")


class _Root(BaseModel):
    ratio: float = Field(0.5, description="kept width")
    inner: _Inner = _Inner()
    other: _Inner = _Inner()


def _app(flags, seen: list) -> typer.Typer:
    @recipe_flags(_Root, flags, after="model")
    def cmd(
        model: Annotated[str | None, typer.Option(help="a model")] = None,
        verbose: bool = False,
        recipe_flags: dict | None = None,
    ) -> None:
        seen.append((model, verbose, recipe_flags))

    app = typer.Typer()
    app.command()(cmd)
    app.command("noop")(lambda: None)  # two commands, so the first is addressed by name
    return app


WIDE = {"COLUMNS": "200", "NO_COLOR": "1"}  # one-line usage errors

FLAGS = (
    RecipeFlag("ratio"),
    RecipeFlag("inner.seq_len", also=("other.seq_len",)),
    RecipeFlag("inner.group", name="group-size", parse=parse_group_size),
)


def test_given_flags_become_overrides_by_recipe_key_and_the_rest_are_absent():
    seen: list = []
    app = _app(FLAGS, seen)
    res = CliRunner(env=WIDE).invoke(
        app, ["cmd", "--model", "m", "--ratio", "0.25", "--seq-len", "32", "--verbose"]
    )
    assert res.exit_code == 0, res.output
    assert seen == [("m", True, {"ratio": 0.25, "inner.seq_len": 32, "other.seq_len": 32})]
    res = CliRunner(env=WIDE).invoke(app, ["cmd", "--group-size", "auto"])
    assert res.exit_code == 0, res.output
    assert seen[-1] == (None, False, {"inner.group": "auto"})
    res = CliRunner(env=WIDE).invoke(app, ["cmd", "--group-size", "2"])
    assert seen[-1][2] == {"inner.group": 2}


def test_flag_types_come_from_the_schema_and_bad_values_are_usage_errors():
    seen: list = []
    app = _app(FLAGS, seen)
    res = CliRunner(env=WIDE).invoke(app, ["cmd", "--seq-len", "many"])
    assert res.exit_code == 2 and not seen
    assert "--seq-len" in res.output and "integer" in res.output
    res = CliRunner(env=WIDE).invoke(app, ["cmd", "--group-size", "two"])
    assert res.exit_code == 2 and not seen
    assert "--group-size" in res.output and "'two'" in res.output


def test_help_is_the_schema_description_with_key_and_default():
    app = _app(FLAGS, [])
    params = {p.name: p for p in typer.main.get_command(app).commands["cmd"].params}
    assert list(params) == ["model", "ratio", "seq_len", "group_size", "verbose"]  # placed after --model
    assert params["ratio"].help == "kept width (recipe: ratio; default 0.5)"
    assert params["seq_len"].help == "tokens per window (recipe: inner.seq_len, other.seq_len; default 64)"


def test_a_key_the_schema_lacks_fails_when_the_command_is_defined():
    with pytest.raises(KeyError, match="inner.nope"):
        _app((RecipeFlag("inner.nope"),), [])
    with pytest.raises(KeyError, match="nope"):
        _app((RecipeFlag("ratio", also=("nope",)),), [])
    with pytest.raises(ValueError, match="already has model"):
        _app((RecipeFlag("ratio", name="model"),), [])


def test_schema_fields_reach_core_sections_and_registries():
    steps = schema_field(ConvertRecipe, "compression.refine.steps")
    assert steps.description == RefineConfig.__dataclass_fields__["steps"].metadata["help"]
    allocator = schema_field(ConvertRecipe, "compression.allocator")
    assert allocator.registry is ALLOCATORS
    assert all(name in flag_help(allocator) for name in ALLOCATORS.names())
    assert schema_field(SearchRecipe, "base.calibration.n_samples").default == 256


@pytest.mark.parametrize(
    "command,flags,root,prefix",
    [
        ("convert", CONVERT_FLAGS, ConvertRecipe, ""),
        ("search", SEARCH_FLAGS, SearchRecipe, "base."),
    ],
)
def test_the_commands_flags_say_what_the_schema_says(command, flags, root, prefix):
    from lrkv_flows.cli import load_command

    params = {p.name: p for p in load_command(command).params}
    for flag in flags:
        field = schema_field(root, prefix + flag.key)
        assert field.description or field.registry, f"{flag.key} has no description in the schema"
        also = [prefix + k for k in flag.also]
        assert params[flag.param].help == flag_help(field, also)


def test_derived_keys_take_a_function_of_the_value():
    seen: list = []
    app = _app((RecipeFlag("inner.seq_len", derived=(("other.seq_len", lambda n: n // 2),)),), seen)
    res = CliRunner(env=WIDE).invoke(app, ["cmd", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    assert seen == [(None, False, {"inner.seq_len": 32, "other.seq_len": 16})]
    with pytest.raises(KeyError, match="nope"):
        _app((RecipeFlag("ratio", derived=(("nope", str),)),), [])


class _Methods(BaseModel):
    allocator: Annotated[Any, RegisteredMethod(ALLOCATORS)] = "kl"


def test_a_registered_method_flag_takes_a_name_or_its_recipe_form_and_checks_its_options():
    seen: list = []

    @recipe_flags(_Methods, (RecipeFlag("allocator"),), after="model")
    def cmd(model: Annotated[str | None, typer.Option()] = None, recipe_flags: dict | None = None) -> None:
        seen.append(recipe_flags)

    app = typer.Typer()
    app.command()(cmd)
    app.command("noop")(lambda: None)
    run = CliRunner(env=WIDE).invoke
    assert run(app, ["cmd", "--allocator", "uniform"]).exit_code == 0
    res = run(app, ["cmd", "--allocator", "{name: eigen, rule: layerwise}"])
    assert res.exit_code == 0, res.output
    assert seen == [{"allocator": "uniform"}, {"allocator": {"name": "eigen", "rule": "layerwise"}}]
    for bad, says in (
        ("{name: eigen, rule: bogus}", "rule: Input should be"),
        ("{name: eigen, nope: 1}", "nope"),
        ("nothing", "unknown allocator 'nothing'"),
        ("{name: eigen", "not valid YAML"),
    ):
        res = run(app, ["cmd", "--allocator", bad])
        assert res.exit_code == 2 and "--allocator" in res.output and says in res.output, res.output
    assert len(seen) == 2
    params = {p.name: p for p in typer.main.get_command(app).commands["cmd"].params}
    assert params["allocator"].metavar == "NAME|{name: NAME, ...}"
