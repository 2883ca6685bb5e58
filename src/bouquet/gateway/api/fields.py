"""Checks of request fields that several APIs share, each error naming the offending field in `param`: unknown
fields refused by name, optional fields of one type, the forms of `input`, the response format, truncation. An
API's own fields are checked in its router module (gateway/api/)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from bouquet.encodings import EMBED_DTYPES, ENDIANNESS, FORMATS, ResponseFormat
from bouquet.gateway.errors import InvalidRequest, Unprocessable
from bouquet.tokenizer import TRUNCATION_DIRECTIONS

if TYPE_CHECKING:
    from bouquet.gateway.service import Service

ENCODING_FORMATS = tuple(FORMATS)  # encoding_format's values, in the documented order

T = TypeVar("T")


def strict(service: Service) -> bool:
    """Whether a field a route does not read is refused by name (the default) rather than ignored
    (--allow-unknown-fields)."""
    return not service.config.allow_unknown_fields


def refuse_unknown(body: dict[str, Any], allowed: frozenset[str] | set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequest(
            f"'{unknown[0]}' is not a parameter of this route; it takes {', '.join(sorted(allowed))}",
            "unsupported_parameter",
            unknown[0],
        )


def refuse_unless(body: dict[str, Any], name: str, accepted: Any, why: str) -> None:
    value = body.get(name, accepted)
    if value is not None and (value != accepted or type(value) is not type(accepted)):  # 1 == True, yet no bool
        raise InvalidRequest(f"'{name}' = {value!r} is not supported: {why}", "unsupported_parameter", name)


LONG_INPUTS = ("truncate", "chunk")


def long_input(body: dict[str, Any]) -> str | None:
    value = optional_field(body, "long_input", str)
    if value is not None and value not in LONG_INPUTS:
        raise InvalidRequest(f"'long_input' must be one of {LONG_INPUTS}, got {value!r}", "invalid_value", "long_input")
    return value


def parse_response_format(body: dict[str, Any]) -> ResponseFormat:
    """`encoding_format` (bouquet/encodings.py FORMATS), and for base64 vLLM's `embed_dtype` and `endianness`.
    Those two change only base64's bytes: with another format, a value other than their default is refused
    rather than ignored."""
    name = optional_field(body, "encoding_format", str) or "float"
    if name not in FORMATS:
        raise InvalidRequest(
            f"encoding_format must be one of {', '.join(FORMATS)}; got {name!r}", "invalid_value", "encoding_format"
        )
    embed_dtype = _choice(body, "embed_dtype", EMBED_DTYPES, "float32", name)
    big_endian = _choice(body, "endianness", ENDIANNESS, "native", name)
    if name != "base64":
        return FORMATS[name]
    return ResponseFormat(embed_dtype, base64=True, big_endian=big_endian)


def _choice(body: dict[str, Any], field: str, choices: dict[str, Any], default: str, encoding_format: str) -> Any:
    value = optional_field(body, field, str) or default
    if value not in choices:
        raise InvalidRequest(f"{field} must be one of {', '.join(choices)}; got {value!r}", "invalid_value", field)
    if value != default and encoding_format != "base64":
        raise InvalidRequest(
            f"{field} applies to encoding_format 'base64' only, not {encoding_format!r}",
            "unsupported_parameter",
            field,
        )
    return choices[value]


def truncation_direction(body: dict[str, Any]) -> str:
    direction = (optional_field(body, "truncation_direction", str) or "right").lower()  # TEI spells it "Right"
    if direction not in TRUNCATION_DIRECTIONS:
        raise InvalidRequest(
            f"truncation_direction must be one of {TRUNCATION_DIRECTIONS}, got {direction!r}",
            "invalid_value",
            "truncation_direction",
        )
    return direction


def parse_inputs(value: Any, param: str) -> tuple[list[str] | None, list[list[int]] | None]:
    """A string, a list of strings, a list of token ids or a list of lists of them; never empty."""
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise Unprocessable(
            f"'{param}' must be a string, a list of strings, a list of token ids or a list of lists of token ids",
            "invalid_type",
            param,
        )
    if not value:
        raise InvalidRequest(f"'{param}' must not be empty", "empty_input", param)
    first = value[0]
    if isinstance(first, str) and all(isinstance(item, str) for item in value):
        return _check_texts(value, param), None
    if is_int(first):
        return None, [_check_ids(value, param, None)]
    if isinstance(first, list | str):
        return _mixed(value, param)
    raise Unprocessable(f"'{param}[0]' has an unsupported type {type(first).__name__}", "invalid_type", param)


def text_positions(value: Any, texts: list[str] | None, token_ids: list[list[int]] | None) -> tuple[int, ...] | None:
    if texts is None or token_ids is None:
        return None
    return tuple(index for index, item in enumerate(value) if isinstance(item, str))


def _mixed(value: list[Any], param: str) -> tuple[list[str] | None, list[list[int]] | None]:
    """A batch of lists of token ids, or (as TEI takes) of texts and lists of ids mixed: then both come back, and
    `mixed_order` tells where each text goes."""
    texts: list[str] = []
    token_ids: list[list[int]] = []
    for index, item in enumerate(value):
        if isinstance(item, str):
            texts.append(_check_texts([item], f"{param}[{index}]")[0])
        else:
            token_ids.append(_check_ids(item, param, index))
    return texts or None, token_ids


def _check_texts(texts: list[Any], param: str) -> list[str]:
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise Unprocessable(f"'{param}[{index}]' must be a string like the others", "invalid_type", param)
        if not text:
            raise InvalidRequest(f"'{param}[{index}]' is an empty string", "empty_input", param)
    return texts


def _check_ids(ids: Any, param: str, index: int | None) -> list[int]:
    where = param if index is None else f"{param}[{index}]"
    if not isinstance(ids, list) or not all(map(is_int, ids)):
        raise Unprocessable(f"'{where}' must be a list of integer token ids", "invalid_type", param)
    if not ids:
        raise InvalidRequest(f"'{where}' is an empty list of token ids", "empty_input", param)
    return ids


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_dimensions(body: dict[str, Any]) -> int | None:
    dimensions = body.get("dimensions")
    if dimensions is None:
        return None
    if not is_int(dimensions):
        raise Unprocessable("'dimensions' must be an integer", "invalid_type", "dimensions")
    return int(dimensions)


def optional_field(body: dict[str, Any], name: str, kind: type[T]) -> T | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise Unprocessable(f"'{name}' must be of type {kind.__name__}", "invalid_type", name)
    return value


def required_text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise InvalidRequest(f"'{name}' is required", "missing_required_parameter", name)
    if not isinstance(value, str):
        raise Unprocessable(f"'{name}' must be a string", "invalid_type", name)
    if not value:
        raise InvalidRequest(f"'{name}' is an empty string", "empty_input", name)
    return value


def required_list(body: dict[str, Any], name: str) -> list[Any]:
    value = body.get(name)
    if value is None:
        raise InvalidRequest(f"'{name}' is required", "missing_required_parameter", name)
    if not isinstance(value, list):
        raise Unprocessable(f"'{name}' must be a list", "invalid_type", name)
    if not value:
        raise InvalidRequest(f"'{name}' is an empty list", "empty_input", name)
    return value


def required_texts(value: Any, name: str) -> list[str]:
    texts = required_list({name: value}, name)
    for index, text in enumerate(texts):
        required_text({f"{name}[{index}]": text}, f"{name}[{index}]")
    return texts


def document_text(document: Any, index: int) -> str:
    if isinstance(document, dict):
        return required_text(document, "text") if "text" in document else required_text({}, f"documents[{index}].text")
    return required_text({f"documents[{index}]": document}, f"documents[{index}]")
