"""A recipe field naming a registered method: ``allocator: lorc`` or ``{name: lorc, skip_threshold: 3}``.

The field validates against the registry at validation time, so a method registered later (by a plugin or
a test module) is accepted with no change here; its options are validated strictly (unknown keys and wrong
types fail) by pydantic from the method's own dataclass. It serialises to the recipe form
``{"name": ..., **options}``, which is what MLflow params, cache keys and the model-format section record.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler, TypeAdapter, ValidationError
from pydantic_core import core_schema

from lrkv_core.registry import Method, Registry


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


class RegisteredMethod:
    """Pydantic annotation: a name, ``{"name": ..., **options}`` or an instance → a registry's method."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def validate(self, value: Any) -> Method:
        registry = self.registry
        if isinstance(value, registry.base):
            return value
        cls, options = registry.resolve(value)  # unknown names list the registered ones
        try:
            return _adapter(cls).validate_python(options)
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'options'}: {e['msg']}" for e in err.errors()
            )
            raise ValueError(f"{registry.kind} {cls.name!r}: {problems}") from None

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            self.validate,
            serialization=core_schema.plain_serializer_function_ser_schema(lambda m: m.to_dict()),
        )

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        names = self.registry.names()
        return {
            "title": self.registry.kind,
            "description": self.registry.help(),
            "anyOf": [
                {"type": "string", "enum": names},
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": names}},
                    "required": ["name"],
                    "additionalProperties": True,
                },
            ],
        }


def registered(registry: Registry) -> Any:
    """The annotated type of a recipe field holding one of ``registry``'s methods."""
    return Annotated[registry.base, RegisteredMethod(registry)]
