"""A request body decoded straight from its bytes into its route's typed struct, in one pass: msgspec parses the
JSON and checks every field's type, bounds and the field names together, so a route reads typed values and the
OpenAPI document is generated from the same declaration (openapi/structs.py). What msgspec reports ("Expected `str`,
got `int` - at `$.input[3]`") is answered as the route's own error: its status, a code, and the offending field in
`param`, the same as the hand-written checks answer.

Each struct refuses a field it does not declare; `--allow-unknown-fields` decodes with a lenient twin instead (a
subclass that ignores them), so the strict path pays nothing for the option."""

from __future__ import annotations

import re
from typing import Any, Generic, TypeVar, cast

import msgspec

from bouquet.gateway.errors import ApiError, InvalidRequest, Unprocessable


class RequestBody(msgspec.Struct, forbid_unknown_fields=True):
    """A request body: every field it takes declared, any other refused by name."""


class ResponseBody(msgspec.Struct, forbid_unknown_fields=True):
    """An answer's body (or a part of one), written by http/endpoint.json_response: every field is always there but
    one whose default is `msgspec.UNSET`, left out where it is unset (TEI's `text` without return_text)."""


T = TypeVar("T", bound=msgspec.Struct)
Bytes = bytes | bytearray | memoryview


class BodyDecoder(Generic[T]):
    """`kind`'s strict decoder and its lenient twin's (`lenient`, by default `kind` ignoring unknown fields)."""

    def __init__(self, kind: type[T], lenient: type[T] | None = None) -> None:
        self.kind = kind
        self._strict = msgspec.json.Decoder(kind)
        self._lenient = msgspec.json.Decoder(lenient or lenient_twin(kind))

    def decode(self, body: Bytes, strict: bool = True) -> T:
        try:
            return (self._strict if strict else self._lenient).decode(body)
        except msgspec.ValidationError as error:
            raise api_error(str(error), self.kind) from None
        except msgspec.DecodeError as error:
            raise unreadable(str(error)) from None


def lenient_twin(kind: type[T]) -> type[T]:
    """`kind`, but ignoring a field it does not declare (its own fields are checked as strictly)."""
    namespace = {"__doc__": kind.__doc__, "__module__": kind.__module__}
    meta: Any = type(kind)  # msgspec's StructMeta, which takes the struct's options as keywords
    return cast(type[T], meta(kind.__name__, (kind,), namespace, forbid_unknown_fields=False))


def unreadable(message: str) -> InvalidRequest:
    if "UTF-8" in message:
        return InvalidRequest("the body is not valid UTF-8", "invalid_utf8")
    return InvalidRequest(f"the body is not valid JSON: {message}", "invalid_json")


_UNKNOWN = re.compile(r"Object contains unknown field `(.*)`")
_MISSING = re.compile(r"Object missing required field `(.*)`")
_WRONG_TYPE = re.compile(r"Expected `(.*)`, got `(.*)`")
_TOO_SHORT = re.compile(r"Expected `(.*)` of length >= 1")
_BOUND = re.compile(r"Expected `(.*)` ((?:of length )?[<>]=? .*)")
_WORDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "array": "a list",
          "object": "an object", "null": "null"}  # fmt: skip


def api_error(report: str, kind: type[msgspec.Struct]) -> ApiError:
    """msgspec's report as the error the route answers: `param` is the offending field's path below the body
    (`input[3]`, `inputs.sentences`), a field left out or not taken is named as such."""
    message, _, at = report.partition(" - at `")
    where = at.rstrip("`").removeprefix("$").lstrip(".")
    if match := _UNKNOWN.fullmatch(message):
        name = _join(where, match[1])
        takes = "" if where else f"; it takes {', '.join(sorted(field_names(kind)))}"
        return InvalidRequest(f"'{name}' is not a parameter of this route{takes}", "unsupported_parameter", name)
    if match := _MISSING.fullmatch(message):
        name = _join(where, match[1])
        return InvalidRequest(f"'{name}' is required", "missing_required_parameter", name)
    if not where:
        return Unprocessable("the body must be a JSON object", "invalid_type")
    if match := _WRONG_TYPE.fullmatch(message):
        return Unprocessable(
            f"'{where}' must be {_describe(match[1])}, got {_describe(match[2])}", "invalid_type", where
        )
    if match := _TOO_SHORT.fullmatch(message):
        empty = "is an empty string" if match[1] == "str" else "must not be empty"
        return InvalidRequest(f"'{where}' {empty}", "empty_input", where)
    if match := _BOUND.fullmatch(message):
        return InvalidRequest(f"'{where}' must be {match[2]}", "invalid_value", where)
    return InvalidRequest(f"'{where}': {message}", "invalid_value", where)


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _describe(types: str) -> str:
    words = [_WORDS.get(name, name) for name in types.split(" | ")]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def field_names(kind: type[msgspec.Struct]) -> tuple[str, ...]:
    """The body's field names, as a client spells them."""
    return tuple(field.encode_name for field in msgspec.structs.fields(kind))


class _Present(msgspec.Struct):
    """Which of some fields a body holds, read without decoding their values (a route whose body takes one of two
    shapes picks its struct by them)."""

    inputs: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    prompt: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    documents: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    messages: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


_PRESENT = BodyDecoder(_Present, _Present)


def present(body: Bytes) -> dict[str, bytes]:
    """The first bytes of `inputs`, `prompt`, `documents` and `messages` where the body holds them (`{` for an
    object)."""
    found = _PRESENT.decode(body)
    raw = {"inputs": found.inputs, "prompt": found.prompt, "documents": found.documents, "messages": found.messages}
    return {name: bytes(value)[:1] for name, value in raw.items() if len(value)}
