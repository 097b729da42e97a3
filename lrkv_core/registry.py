"""Registries: one per kind of method, so that adding a method is one file plus its registration.

A method is a frozen dataclass whose fields are its options and whose class attribute ``name`` is the name
recipes use (``allocator: {name: lorc, skip_threshold: 3.0}``). Its class declares what it needs and
implements what it does; a :class:`Registry` maps names to classes::

    @ALLOCATORS.register
    @dataclass(frozen=True)
    class Uniform(Allocator):
        name: ClassVar[str] = "uniform"

        def allocate(self, problem): ...

Recipe validation, CLI choices and help text are read from the registries, so nothing else lists the
methods. Tests and plugins register their own methods the same way, from their own modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Generic, TypeVar


@dataclasses.dataclass(frozen=True)
class Method:
    """Base of every registered method: a frozen dataclass whose fields are the method's options."""

    name: ClassVar[str] = ""
    # strict validation when a recipe (pydantic, in lrkv_tasks) validates the options: unknown keys fail
    __pydantic_config__: ClassVar[dict] = {"extra": "forbid"}

    def options(self) -> dict[str, Any]:
        """The option fields and their values."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_dict(self) -> dict[str, Any]:
        """``{"name": ..., **options}``: the recipe form, and what the model-format section records."""
        return {"name": self.name, **self.options()}

    @classmethod
    def summary(cls) -> str:
        """First line of the class docstring (CLI help)."""
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else cls.name


def _describe_fields(schema: dict[str, Any], cls: type) -> None:
    """A recipe's JSON schema (the Prefect UI's form) takes each field's ``help`` as its description."""
    for f in dataclasses.fields(cls):
        if "help" in f.metadata and f.name in schema.get("properties", {}):
            schema["properties"][f.name]["description"] = f.metadata["help"]


@dataclasses.dataclass(frozen=True)
class Section:
    """Base of a config section that is one set of options rather than a choice among registered methods
    (a conversion's ``refine`` and ``rotation``): a frozen dataclass whose fields are the options, with
    each field's ``help`` in its metadata. A recipe validates the class itself, strictly, and shows the
    helps in its form; a new option is a field of the subclass and the code that reads it."""

    # the name errors give the section ("refine options must be a mapping")
    label: ClassVar[str] = ""
    __pydantic_config__: ClassVar[dict] = {"extra": "forbid", "json_schema_extra": _describe_fields}

    @classmethod
    def create(cls, value: Any) -> Any:
        """The section itself, its defaults for None, or one from its mapping form (``{"steps": 2}``)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"{cls.label} options must be a mapping, got {value!r}")
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown {cls.label} option(s) {', '.join(sorted(unknown))}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


M = TypeVar("M", bound=Method)


class Registry(Generic[M]):
    """Name → method class for one kind of method (``kind`` names it in messages)."""

    def __init__(self, kind: str, base: type[M]) -> None:
        self.kind = kind
        self.base = base
        self._classes: dict[str, type[M]] = {}

    def register(self, cls: type[M]) -> type[M]:
        """Class decorator: register ``cls`` under ``cls.name`` (re-registering the same class is a no-op)."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"a {self.kind} must subclass {self.base.__name__}, got {cls!r}")
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise TypeError(f"{cls.__name__}: a {self.kind} must be a frozen dataclass")
        if not isinstance(cls.name, str) or not cls.name:
            raise TypeError(f"{cls.__name__}: a {self.kind} needs a class attribute `name`")
        other = self._classes.get(cls.name)
        if other is not None and other.__qualname__ != cls.__qualname__:
            raise ValueError(f"{self.kind} {cls.name!r} is already registered by {other.__qualname__}")
        self._classes[cls.name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove a method (tests that register a toy one clean up with this)."""
        self._classes.pop(name, None)

    def names(self) -> list[str]:
        return list(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[type[M]]:
        return iter(list(self._classes.values()))

    def get(self, name: str) -> type[M]:
        """The class registered as ``name``; an error listing the registered names otherwise."""
        if name not in self._classes:
            raise ValueError(f"unknown {self.kind} {name!r}; choose from {', '.join(sorted(self._classes))}")
        return self._classes[name]

    def resolve(self, spec: str | Mapping[str, Any]) -> tuple[type[M], dict[str, Any]]:
        """The class a name or recipe form ``{"name": ..., **options}`` names, and the options given."""
        if isinstance(spec, str):
            spec = {"name": spec}
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise ValueError(
                f"a {self.kind} is one of {self.names()} or a mapping with a 'name' key, got {spec!r}"
            )
        return self.get(spec["name"]), {k: v for k, v in spec.items() if k != "name"}

    def create(self, spec: str | Mapping[str, Any] | M) -> M:
        """A method from its name, its recipe form ``{"name": ..., **options}``, or an instance (returned).

        Unknown option names fail; values are checked by the method's own ``__post_init__``. Recipes
        additionally validate option types (pydantic, in ``lrkv_tasks.recipes.convert_recipe``).
        """
        if isinstance(spec, self.base):
            return spec
        cls, options = self.resolve(spec)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"{self.kind} {cls.name!r} has no option(s) {unknown}; it takes {sorted(known) or 'none'}"
            )
        return cls(**options)

    def help(self) -> str:
        """One line per method: ``name: summary`` (CLI help)."""
        return "; ".join(f"{cls.name}: {cls.summary()}" for cls in self)
