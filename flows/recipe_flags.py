"""Command-line flags generated from the recipe's schema.

A command lists the recipe keys it offers as flags (:class:`RecipeFlag`, one line each); the option's name,
type, help and default come from the recipe model itself (a pydantic field's ``description``, a core
section's ``help`` metadata, a registered method's registry), so a flag restates nothing the schema says.
:func:`recipe_flags` adds the generated options to a typer command and hands it the values the user gave,
keyed by recipe key, as overrides (``--ratio 0.3`` → ``{"compression.ratio": 0.3}``). Every other key is
reachable with ``--set KEY=VALUE``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer
from pydantic import BaseModel

from lrkv_tasks.recipes.registered import RegisteredMethod

from .options import method_value

_SCALARS = (int, float)  # typed options; any other value is passed as the string typed (the recipe parses it)


@dataclasses.dataclass(frozen=True)
class RecipeFlag:
    """One flag of a command: the recipe ``key`` it sets (dotted, e.g. ``compression.refine.steps``).

    ``name``: the option's name without dashes (default: the key's last part, ``_`` as ``-``); ``also``:
    further keys set to the same value; ``derived``: further keys set to a function of it (``--set`` still
    overrides them); ``parse``: the typed string → the recipe value (its ``ValueError`` is a usage error);
    ``metavar``: shown in the help instead of the type.
    """

    key: str
    name: str = ""
    also: tuple[str, ...] = ()
    derived: tuple[tuple[str, Callable[[Any], Any]], ...] = ()
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None

    @property
    def option(self) -> str:
        return "--" + (self.name or self.key.rsplit(".", 1)[-1].replace("_", "-"))

    @property
    def param(self) -> str:
        return self.option[2:].replace("-", "_")


@dataclasses.dataclass(frozen=True)
class SchemaField:
    """What the schema says of one recipe key: its type, default and description."""

    key: str
    annotation: Any
    default: Any
    description: str | None
    registry: Any | None  # the registry of a registered method's field


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """``Annotated[T, *meta]`` and ``T | None`` as (T, meta)."""
    meta: list[Any] = []
    while typing.get_origin(annotation) is Annotated:
        meta.extend(annotation.__metadata__)
        annotation = annotation.__origin__
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            inner, inner_meta = _unwrap(args[0])
            return inner, meta + inner_meta
    return annotation, meta


def schema_field(root: type, key: str) -> SchemaField:
    """The field of ``root`` (a pydantic model; sections may be core dataclasses) at the dotted ``key``."""
    node, meta = root, []
    parts = key.split(".")
    for i, part in enumerate(parts):
        node, _ = _unwrap(node)
        if isinstance(node, type) and issubclass(node, BaseModel) and part in node.model_fields:
            info = node.model_fields[part]
            annotation, meta = _unwrap(info.annotation)
            meta += info.metadata  # pydantic keeps a field's Annotated metadata here
            default, description = info.get_default(call_default_factory=True), info.description
        elif dataclasses.is_dataclass(node) and part in {f.name for f in dataclasses.fields(node)}:
            f = next(f for f in dataclasses.fields(node) if f.name == part)
            annotation, meta = _unwrap(typing.get_type_hints(node, include_extras=True)[part])
            default = f.default if f.default is not dataclasses.MISSING else None
            description = f.metadata.get("help")
        else:
            raise KeyError(f"the recipe has no key {'.'.join(parts[: i + 1])!r}")
        node = annotation
    registry = next((m.registry for m in meta if isinstance(m, RegisteredMethod)), None)
    return SchemaField(key, node, default, description, registry)


def flag_help(field: SchemaField, also: Sequence[str] = ()) -> str:
    """The option's help: the schema's description (for a registered method: its registry's names and
    summaries), its recipe key (and the others it sets) and its default."""
    parts = []
    if field.registry is not None:
        parts.append(
            f"{' | '.join(sorted(field.registry.names()))}, by name or as a YAML mapping of its options. "
            f"{field.registry.help()}"
        )
    if field.description:
        parts.append(field.description)
    default = None if field.default is None else str(field.default)
    keys = ", ".join((field.key, *also))
    tail = f"recipe: {keys}" + (f"; default {default}" if default is not None else "")
    return " ".join(parts + [f"({tail})"])


def _option_type(field: SchemaField, flag: RecipeFlag) -> type:
    if flag.parse is not None:
        return str
    kind = field.annotation
    return kind if kind in _SCALARS else str


def _parser(flag: RecipeFlag, field: SchemaField) -> Callable[[str], Any] | None:
    """What turns the typed string into the recipe value: the flag's own ``parse``; for a registered method,
    its name or its recipe form as YAML, checked as ``--cache`` is; else nothing (typer or the recipe)."""
    if flag.parse is not None or field.registry is None:
        return flag.parse
    return functools.partial(method_value, flag.option, field.registry)


def _parameter(root: type, flag: RecipeFlag, prefix: str) -> inspect.Parameter:
    field = schema_field(root, prefix + flag.key)
    also = [schema_field(root, prefix + key).key for key in flag.also]  # a typo fails at import
    for key, _ in flag.derived:
        schema_field(root, prefix + key)
    kind = _option_type(field, flag)
    metavar = flag.metavar or ("NAME|{name: NAME, ...}" if field.registry is not None else None)
    option = typer.Option(flag.option, help=flag_help(field, also), metavar=metavar)
    return inspect.Parameter(
        flag.param, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind | None, option]
    )


def recipe_flags(root: type, flags: Sequence[RecipeFlag], *, prefix: str = "", after: str) -> Callable:
    """Add ``flags`` (keys of ``root`` under ``prefix``) to a typer command, after its parameter ``after``.

    The command takes a keyword ``recipe_flags``: the given flags' values by recipe key (with ``prefix``),
    parsed; flags left out are absent."""

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command)
        hints = typing.get_type_hints(command, include_extras=True)  # the command's, read in its module
        params = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in signature.parameters.values()
            if p.name != "recipe_flags"
        ]
        names = [p.name for p in params]
        if after not in names:
            raise ValueError(f"{command.__name__} has no parameter {after!r}")
        generated = [_parameter(root, f, prefix) for f in flags]
        clash = {p.name for p in generated} & set(names)
        if clash:
            raise ValueError(f"{command.__name__} already has {', '.join(sorted(clash))}")
        at = names.index(after) + 1
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]
        by_param = {f.param: f for f in flags}
        parsers = {f.param: _parser(f, schema_field(root, prefix + f.key)) for f in flags}

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            given = {}
            for param, flag in by_param.items():
                value = kwargs.pop(param)
                if value is None:
                    continue
                if parsers[param] is not None:
                    try:
                        value = parsers[param](value)
                    except (ValueError, typer.BadParameter) as err:  # parsed after click: name the flag
                        raise typer.BadParameter(str(err), param_hint=flag.option) from None
                for key in (flag.key, *flag.also):
                    given[prefix + key] = value
                for key, derive in flag.derived:
                    given[prefix + key] = derive(value)
            return command(recipe_flags=given, **kwargs)

        params = params[:at] + generated + params[at:]
        run.__signature__ = signature.replace(parameters=params, return_annotation=None)
        run.__annotations__ = {p.name: p.annotation for p in params}  # typer reads both
        del run.__wrapped__
        return run

    return decorate
