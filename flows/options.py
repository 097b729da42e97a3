"""Parsers of the CLI's options: paths, recipe overrides, comma lists, group sizes, the quantized cache.

Path options are parsed from the string the user typed: a ``Path``-typed option would fold
``s3://bucket/prefix`` into ``s3:/bucket/prefix`` before any check, and a local directory
``./s3:/bucket/prefix`` would then be created silently. ``--store`` keeps an ``s3://`` URI as it is; every
option that takes a local path refuses anything that looks like a URI (``SCHEME:/...``; ``./s3:/x`` names
such a local path on purpose).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer
import yaml

from lrkv_tasks.store.artifacts import STORE_FORMS, is_s3, local_dir

from .report import fail


def local_path(flag: str, accepts: str = "a local path") -> Callable[[str], Path]:
    """A typer ``parser`` for ``flag``: the value as a local ``Path`` (refusing what looks like a URI)."""

    def parse(value: str) -> Path:
        try:
            return local_dir(value, flag, accepts)
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None

    return parse


def path_option(flag: str, help: str, metavar: str) -> typer.models.OptionInfo:
    """A typer option taking a local path (``metavar`` FILE or DIR), refusing what looks like a URI."""
    accepts = "a local directory" if metavar == "DIR" else "a local path"
    return typer.Option(help=help, parser=local_path(flag, accepts), metavar=metavar)


def store_root(value: str) -> str:
    """A typer ``parser`` for ``--store``: ``s3://bucket/prefix`` as given, else a local directory."""
    return value if is_s3(value) else str(local_path("--store", STORE_FORMS)(value))


def yaml_value(flag: str, text: str):
    """``text`` parsed as YAML, or a usage error naming ``flag`` and where the YAML breaks."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at column {where.column + 1}" if where is not None else ""
        raise typer.BadParameter(
            f"{flag} {text!r} is not valid YAML ({getattr(err, 'problem', None) or err}{at})"
        ) from None


def parse_set(values: list[str]) -> dict:
    """``--set a.b=VALUE`` pairs as recipe overrides (values parsed as YAML)."""
    out = {}
    for item in values:
        if "=" not in item:
            raise typer.BadParameter(f"--set takes key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k] = yaml_value("--set", v)
    return out


def flag_overrides(flags: dict, eval_key: str) -> dict:
    """The flags the user gave, as recipe overrides; ``--eval-dataset none`` turns evaluation off."""
    out = {k: v for k, v in flags.items() if v is not None}
    if out.get(eval_key) == "none":
        out[eval_key] = None
    return out


def quantized_cache(
    bits: int | None, group_size: int | None, residual: int | None, cache: str | dict | None = None
) -> str | dict | None:
    """``--bits 3 [--quant-group-size 16] [--residual-length 32]`` as the recipe's cache storage
    ``{name: quantized, bits: 3, quant_group_size: 16, residual: 32}``, or ``--cache`` as given (not both);
    None when no flag is given."""
    if cache is not None:
        if (bits, group_size, residual) != (None, None, None):
            raise typer.BadParameter(
                "--cache names the whole storage: give its options there, not --bits etc."
            )
        return cache
    if bits is None:
        if group_size is not None or residual is not None:
            raise typer.BadParameter("--quant-group-size and --residual-length need --bits")
        return None
    options = {"quant_group_size": group_size, "residual": residual}
    return {"name": "quantized", "bits": bits} | {k: v for k, v in options.items() if v is not None}


def cache_storage(value: str) -> str | dict:
    """A typer ``parser`` for ``--cache``: a storage's name or its YAML recipe form ``{name: gear, bits: 2}``,
    checked as a recipe's ``cache`` field is, option types included (a usage error names the storages and
    their options)."""
    from lrkv_core.cache import CACHE_STORAGES

    return method_value("--cache", CACHE_STORAGES, value)


def method_value(flag: str, registry, text: str) -> str | dict:
    """A registered method's name or its YAML recipe form (``{name: eigen, rule: layerwise}``), checked as
    the recipe checks it; a usage error naming ``flag`` (and the registered names or options) otherwise."""
    from lrkv_tasks.recipes.registered import RegisteredMethod

    spec = yaml_value(flag, text)
    try:
        RegisteredMethod(registry).validate(spec)
    except (TypeError, ValueError) as err:
        raise typer.BadParameter(str(err)) from None
    return spec


def dask_option(value: str) -> str:
    """A typer ``parser`` for ``--dask``: checked here (a usage error names the forms), started later."""
    from .cluster import parse_dask

    try:
        parse_dask(value)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    return value


def device_option(value: str) -> str:
    """A typer ``parser`` for ``--device``: a name torch knows and a device it can use here, or a usage
    error."""
    return _device(value, here=True)


def device_name_option(value: str) -> str:
    """A typer ``parser`` for a ``--device`` used on another host (deployments' runs): the name only."""
    return _device(value, here=False)


def _device(value: str, here: bool) -> str:
    from lrkv_core.model.loading import parse_device

    try:
        parse_device(value, here=here)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    return value


def parse_group_size(value: str | None, flag: str = "--group-size") -> int | str | None:
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"{flag} takes a positive integer or 'auto', got {value!r}") from None


KINDS = {int: "integers", float: "numbers"}


def csv_list(value: str | None, cast=str, flag: str = "the option") -> list | None:
    """A comma list's items, each through ``cast``; for numbers, a ValueError names ``flag`` and the item."""
    if value is None:
        return None
    out = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        try:
            out.append(cast(item))
        except ValueError:
            if cast not in KINDS:
                raise
            raise ValueError(f"{flag} takes a comma list of {KINDS[cast]}, got {item!r}") from None
    return out


def list_option(value: str | None, cast: Callable, flag: str) -> list | None:
    """:func:`csv_list` of a command's ``flag``: an item that does not parse ends the command with one line
    naming the flag (exit code 2)."""
    try:
        return csv_list(value, cast, flag)
    except (ValueError, typer.BadParameter) as err:
        raise fail(f"invalid option: {err}", 2) from None
