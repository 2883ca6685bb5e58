"""The bodies' schemas, generated from the structs the routes decode requests into and write answers from
(gateway/api/), so the document states what the decoder takes and the handler answers: each field's type, bounds,
default and description, and the fields a body may hold. msgspec writes JSON Schema 2020-12; the document is
OpenAPI 3.0.3 (the bundled Swagger UI renders no 3.1), so a null alternative becomes `nullable` here, as 3.0.3
spells it."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET

from bouquet.gateway.http.decode import ResponseBody
from bouquet.gateway.openapi.pieces import Schema

REF = "#/components/schemas/{name}"
_NULL = {"type": "null"}


def struct_schemas(kinds: tuple[Any, ...]) -> tuple[list[Schema], dict[str, Schema]]:
    """Each of `kinds`' schemas (a reference for a struct), and those of the structs they hold by class name, as
    components/schemas keeps them. A struct may add what its types cannot say (one of two fields required) in a
    class variable `__openapi__`; an answer's struct (ResponseBody) requires every field not left unset."""
    schemas, components = msgspec.json.schema_components(kinds, ref_template=REF)
    for name, kind in _structs(kinds).items():
        components[name].update(getattr(kind, "__openapi__", {}))
        if issubclass(kind, ResponseBody):
            fields = msgspec.structs.fields(kind)
            components[name]["required"] = [field.encode_name for field in fields if field.default is not UNSET]
    return openapi_30(list(schemas)), {name: openapi_30(schema) for name, schema in components.items()}


def _structs(kinds: tuple[Any, ...]) -> dict[str, type[msgspec.Struct]]:
    """Every struct `kinds` hold, by name."""
    found: dict[str, type[msgspec.Struct]] = {}
    pending: list[Any] = list(msgspec.inspect.multi_type_info(kinds))
    while pending:
        info = pending.pop()
        if isinstance(info, msgspec.inspect.StructType):
            if info.cls.__name__ in found:
                continue
            found[info.cls.__name__] = info.cls
            pending.extend(field.type for field in info.fields)
        for name in ("type", "item_type", "key_type", "value_type"):
            if isinstance(getattr(info, name, None), msgspec.inspect.Type):
                pending.append(getattr(info, name))
        pending.extend(getattr(info, "types", None) or getattr(info, "item_types", None) or ())
    return found


def openapi_30(schema: Any) -> Any:
    """`schema` in OpenAPI 3.0.3's dialect: `anyOf` with null as `nullable` (a reference wrapped in `allOf`, which
    3.0.3 lets stand beside it), no empty `required`, no `title` (the component's name says it)."""
    if isinstance(schema, list):
        return [openapi_30(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if schema.get("type") == "null":  # a field that is always null (TEI's model_sha)
        return {**{key: value for key, value in schema.items() if key != "type"}, "nullable": True, "enum": [None]}
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
