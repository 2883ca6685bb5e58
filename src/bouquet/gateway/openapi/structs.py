"""The request bodies' schemas, generated from the structs the routes decode them into (gateway/api/), so the
document states what the decoder takes: each field's type, bounds, default and description, and the fields a body
may hold. msgspec writes JSON Schema 2020-12; the document is OpenAPI 3.0.3 (the bundled Swagger UI renders no 3.1),
so a null alternative becomes `nullable` here, as 3.0.3 spells it."""

from __future__ import annotations

from typing import Any

import msgspec

from bouquet.gateway.openapi.pieces import Schema

REF = "#/components/schemas/{name}"
_NULL = {"type": "null"}


def struct_schemas(kinds: tuple[type[msgspec.Struct], ...]) -> dict[str, Schema]:
    """Each struct's schema (and those of the structs it holds) by its class name, as components/schemas keeps
    them. A struct may add what its types cannot say (one of two fields required) in a class variable
    `__openapi__`."""
    _, components = msgspec.json.schema_components(kinds, ref_template=REF)
    for kind in kinds:
        components[kind.__name__].update(getattr(kind, "__openapi__", {}))
    return {name: openapi_30(schema) for name, schema in components.items()}


def openapi_30(schema: Any) -> Any:
    """`schema` in OpenAPI 3.0.3's dialect: `anyOf` with null as `nullable` (a reference wrapped in `allOf`, which
    3.0.3 lets stand beside it), no empty `required`, no `title` (the component's name says it)."""
    if isinstance(schema, list):
        return [openapi_30(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if schema == _NULL:
        return {"nullable": True, "enum": [None]}
    choices = schema.get("anyOf") or []
    converted = {key: openapi_30(value) for key, value in schema.items() if key != "title"}
    if converted.get("required") == []:
        del converted["required"]
    if _NULL not in choices:
        return converted
    rest = [openapi_30(choice) for choice in choices if choice != _NULL]
    del converted["anyOf"]
    base = {"anyOf": rest} if len(rest) > 1 else {"allOf": rest} if "$ref" in rest[0] else rest[0]
    nullable = {**converted, **base, "nullable": True}  # the inner default (encoding_format's "float") wins
    if "enum" in nullable and None not in nullable["enum"]:
        nullable["enum"] = [*nullable["enum"], None]
    return nullable
