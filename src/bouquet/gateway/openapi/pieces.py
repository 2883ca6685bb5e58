"""Pieces of JSON Schema the response bodies share, and the named schemas (components/schemas); the request
bodies' schemas are generated from their structs (structs.py)."""

from __future__ import annotations

import copy
from typing import Any

Schema = dict[str, Any]

# JSON pieces


def nullable(schema: Schema) -> Schema:
    """`schema`, or null (the parser reads null as the field left out); an enum lists null too, as OpenAPI 3.0.3
    asks for an enum that is nullable."""
    schema = copy.deepcopy(schema)
    schema["nullable"] = True
    if "enum" in schema and None not in schema["enum"]:
        schema["enum"].append(None)
    return schema


def json_object(
    properties: dict[str, Schema], required: tuple[str, ...] = (), closed: bool = True, **more: Any
) -> Schema:
    """An object with these properties. A request object is `closed` where its parser refuses other fields by name
    (400 unsupported_parameter; 422 on TEI's routes); a response object is closed so the document lists every field."""
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    return {**schema, **more}


def array_of(items: Schema, min_items: int = 0, **more: Any) -> Schema:
    return {"type": "array", "items": items, **({"minItems": min_items} if min_items else {}), **more}


def response_schema(properties: dict[str, Schema], **more: Any) -> Schema:
    """A response object: every field always there, no other."""
    return json_object(properties, tuple(properties), **more)


# Named schemas, under components/schemas: the request and response bodies, and the error shapes.
COMPONENTS: dict[str, Schema] = {}


def named(name: str, schema: Schema) -> Schema:
    """A reference to `schema`, kept under components/schemas as `name`."""
    assert COMPONENTS.get(name, schema) == schema, f"two schemas named {name}"
    COMPONENTS[name] = schema
    return {"$ref": f"#/components/schemas/{name}"}


STRING: Schema = {"type": "string"}
TEXT: Schema = {"type": "string", "minLength": 1}  # an empty text is 400 empty_input
BOOLEAN: Schema = {"type": "boolean"}
INTEGER: Schema = {"type": "integer"}
NUMBER: Schema = {"type": "number"}
COUNT: Schema = {"type": "integer", "minimum": 0}
ALWAYS_NULL: Schema = nullable({"type": "string", "enum": [], "description": "TEI's field; always null here"})
FLOATS: Schema = array_of(NUMBER)
