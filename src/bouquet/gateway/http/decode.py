"""A request body decoded straight from its bytes into its route's typed struct, in one pass: msgspec parses the
JSON and checks every field's type, bounds and the field names together, so a route reads typed values and the
OpenAPI document is generated from the same declaration (openapi/structs.py). What msgspec reports ("Expected `str`,
got `int` - at `$.input[3]`") is answered as the route's own error: its status, a code, and the offending field in
`param`, the same as the hand-written checks answer.

Each struct refuses a field it does not declare; `--allow-unknown-fields` decodes with a lenient twin instead (a
subclass that ignores them), so the strict path pays nothing for the option."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, Generic, TypeVar, Union, cast

import msgspec

from bouquet.gateway.errors import ApiError, InvalidRequest, Unprocessable


class RequestBody(msgspec.Struct, forbid_unknown_fields=True):
    """A request body: every field it takes declared, any other refused by name."""


class ResponseBody(msgspec.Struct, forbid_unknown_fields=True):
    """An answer's body (or a part of one), written by http/endpoint.json_response: every field is always there but
    one whose default is `msgspec.UNSET`, left out where it is unset (TEI's `text` without return_text)."""


T = TypeVar("T", bound=msgspec.Struct)
U = TypeVar("U", bound=msgspec.Struct)
Bytes = bytes | bytearray | memoryview


class BodyDecoder(Generic[T]):
    """`kind`'s strict decoder and its lenient twin's (`lenient`, by default `kind` ignoring unknown fields)."""

    def __init__(self, kind: type[T], lenient: type[T] | None = None) -> None:
        self.kind = kind
        self.lenient_kind = lenient or lenient_twin(kind)
        self._strict = msgspec.json.Decoder(kind)
        self._lenient = msgspec.json.Decoder(self.lenient_kind)

    def decode(self, body: Bytes, strict: bool = True) -> T:
        try:
            return (self._strict if strict else self._lenient).decode(body)
        except msgspec.ValidationError as error:
            raise api_error(str(error), self.kind) from None
        except msgspec.DecodeError as error:
            raise unreadable(str(error)) from None


class EitherDecoder(Generic[T, U]):
    """A body in one of two shapes, each a struct (TEI's `/rerank` takes TEI's and Cohere's), decoded in one pass:
    into a struct holding the fields of both (a field both name takes either's type), then handed out as the struct
    of its shape, which `is_second` picks from the decoded values, each field moved over as it is (no second pass
    over the body). A field only the other shape takes is refused by name as an unknown field is (ignored with
    --allow-unknown-fields); a field the shape requires and the body left out is refused as a missing one."""

    def __init__(self, first: BodyDecoder[T], second: BodyDecoder[U], is_second: Callable[[Any], bool]) -> None:
        self._is_second = is_second
        self._decoders: dict[bool, msgspec.json.Decoder[Any]] = {}
        self._both: dict[bool, type[msgspec.Struct]] = {}
        self._shapes: dict[bool, tuple[_Shape, _Shape]] = {}
        for strict, kinds in ((True, (first.kind, second.kind)), (False, (first.lenient_kind, second.lenient_kind))):
            both = _both(*kinds, strict)
            self._both[strict], self._decoders[strict] = both, msgspec.json.Decoder(both)
            self._shapes[strict] = (_Shape(both, kinds[0], strict), _Shape(both, kinds[1], strict))

    def decode(self, body: Bytes, strict: bool = True) -> T | U:
        try:
            both = self._decoders[strict].decode(body)
        except msgspec.ValidationError as error:
            raise api_error(str(error), self._both[strict]) from None
        except msgspec.DecodeError as error:
            raise unreadable(str(error)) from None
        return cast("T | U", self._shapes[strict][1 if self._is_second(both) else 0].take(both))


def _both(first: type[msgspec.Struct], second: type[msgspec.Struct], strict: bool) -> type[msgspec.Struct]:
    """A struct of both's fields, each left UNSET when the body leaves it out; where both name a field with different
    types, either's (their union), which the shape picked checks again (`_Shape`)."""
    types: dict[str, Any] = {}
    names: dict[str, str] = {}
    for kind in (first, second):
        for field in msgspec.structs.fields(kind):
            known = types.get(field.name, field.type)
            types[field.name] = known if known == field.type else Union[known, field.type]  # noqa: UP007
            names[field.name] = field.encode_name
    fields = [(name, Union[kind, msgspec.UnsetType], msgspec.field(default=msgspec.UNSET, name=names[name]))  # noqa: UP007
              for name, kind in types.items()]  # fmt: skip
    return msgspec.defstruct(f"{first.__name__}Or{second.__name__}", fields, forbid_unknown_fields=strict)


class _Shape:
    """How a decoded `both` becomes one shape's struct, worked out once: each field moved, checked again (both
    shapes take it, with different types), or refused (the other shape's only; ignored when not strict)."""

    def __init__(self, both: type[msgspec.Struct], kind: type[msgspec.Struct], strict: bool) -> None:
        self.kind = kind
        own = {field.name: field for field in msgspec.structs.fields(kind)}
        self.fields = []
        for field in msgspec.structs.fields(both):
            mine = own.get(field.name)
            if mine is None and not strict:
                continue
            check = mine is not None and field.type != Union[mine.type, msgspec.UnsetType]  # noqa: UP007
            self.fields.append((field.name, field.encode_name, mine, check))
        self.required = [(field.name, field.encode_name) for field in own.values() if field.required]

    def take(self, both: msgspec.Struct) -> msgspec.Struct:
        values: dict[str, Any] = {}
        for name, encode_name, mine, check in self.fields:
            value = getattr(both, name)
            if value is msgspec.UNSET:
                continue
            if mine is None:
                raise InvalidRequest(
                    f"'{encode_name}' is not a parameter of this body's shape", "unsupported_parameter", encode_name
                )
            values[name] = _checked(value, mine, self.kind) if check else value
        for name, encode_name in self.required:
            if name not in values:
                raise InvalidRequest(f"'{encode_name}' is required", "missing_required_parameter", encode_name)
        return self.kind(**values)


def _checked(value: Any, field: msgspec.structs.FieldInfo, kind: type[msgspec.Struct]) -> Any:
    """A field both shapes take, decoded as either's type, checked as the picked shape's."""
    try:
        return msgspec.convert(value, field.type, strict=True)
    except msgspec.ValidationError as error:
        message, _, at = str(error).partition(" - at `")
        where = at.rstrip("`").removeprefix("$")
        raise api_error(f"{message} - at `$.{field.encode_name}{where}`", kind) from None


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


@functools.cache  # msgspec.structs.fields resolves the struct's type hints on every call
def field_names(kind: type[msgspec.Struct]) -> tuple[str, ...]:
    """The body's field names, as a client spells them."""
    return tuple(field.encode_name for field in msgspec.structs.fields(kind))


class _Present(msgspec.Struct):
    """Which of some fields a body holds, read without decoding their values: only where a body of two shapes already
    failed to decode, to answer in its shape's error body (a second pass a good body never pays)."""

    inputs: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    prompt: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    documents: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


_PRESENT = BodyDecoder(_Present, _Present)


def present(body: Bytes) -> dict[str, bytes]:
    """The first bytes of `inputs`, `prompt` and `documents` where the body holds them (`{` for an object)."""
    found = _PRESENT.decode(body)
    raw = {"inputs": found.inputs, "prompt": found.prompt, "documents": found.documents}
    return {name: bytes(value)[:1] for name, value in raw.items() if len(value)}
