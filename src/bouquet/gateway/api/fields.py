"""The field types several APIs' request structs share, each declared once with what the OpenAPI document says of
it, and the checks of what a type cannot say (a value among names the encodings module defines, inputs of one kind),
each error naming the offending field in `param`. An API's own fields are declared in its router module."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any

from msgspec import Meta

from bouquet.encodings import EMBED_DTYPES, ENDIANNESS, FORMATS, ResponseFormat
from bouquet.gateway.errors import InvalidRequest, Unprocessable
from bouquet.tokenizer import TRUNCATION_DIRECTIONS

if TYPE_CHECKING:
    from bouquet.gateway.service import Service

ENCODING_FORMATS = tuple(FORMATS)  # encoding_format's values, in the documented order
LONG_INPUTS = ("truncate", "chunk")


def strict(service: Service) -> bool:
    """Whether a field a route does not read is refused by name (the default) rather than ignored
    (--allow-unknown-fields)."""
    return not service.config.allow_unknown_fields


def described(text: str, **schema: Any) -> Meta:
    return Meta(description=text, extra_json_schema=schema or None)


def one_of(names: tuple[str, ...] | list[str], **schema: Any) -> Meta:
    """A string among `names`, checked by the route (which answers 400 invalid_value naming them all), or "" or null
    for the default."""
    return Meta(extra_json_schema={"enum": [*names, ""], **schema})


Text = Annotated[str, Meta(min_length=1)]  # an empty text is 400 empty_input
Texts = Annotated[list[Text], Meta(min_length=1)]
TokenIds = Annotated[list[int], Meta(min_length=1)]
Input = Annotated[
    Text | Annotated[list[Text | int | TokenIds], Meta(min_length=1)],
    described(
        "a text, a list of texts, a list of token ids, or a list of texts and lists of token ids; never empty. "
        "Token ids are refused with --no-token-id-input (400 token_ids_refused)."
    ),
]
Model = Annotated[str, described("a served model's id (GET /v1/models); default: the first found")] | None
EncodingFormat = Annotated[str, one_of(ENCODING_FORMATS, default="float")] | None
EmbedDtype = Annotated[str, one_of(list(EMBED_DTYPES), default="float32", description="vLLM's; base64 only")] | None
Endianness = Annotated[str, one_of(list(ENDIANNESS), default="native", description="vLLM's; base64 only")] | None
Dimensions = (
    Annotated[int, described("keep the first N values, renormalised; at most the model's width", minimum=1)] | None
)
LongInput = (
    Annotated[str, described("chunk: embed an over-long input whole, in windows", enum=list(LONG_INPUTS))] | None
)
PromptName = Annotated[str, described("one of the model's sentence-transformers prompts")] | None
ModeWeights = (
    Annotated[
        list[float],
        Meta(min_length=3, max_length=3),
        described(
            "bge-m3's weights of its dense, sparse and ColBERT scores (FlagEmbedding's compute_score); the score is "
            "their weighted mean. Default [1, 1, 1]; only for a model with bge-m3's heads"
        ),
    ]
    | None
)


# How one embedding row is answered for each `encoding_format` (docs/encodings.md defines them); tests/test_openapi.py
# checks that every accepted format has one.
_BASE64 = {"type": "string", "format": "byte"}
_BITS = "bits packed 8 a byte, the first value in the most significant bit (sentence-transformers' quantize_embeddings)"
ROW_ENCODINGS: dict[str, dict[str, Any]] = {
    "float": {"type": "array", "items": {"type": "number"}},
    "base64": {**_BASE64, "description": "base64 of the row's float32 bytes (embed_dtype, endianness: little)"},
    "int8": {"type": "array", "items": {"type": "integer", "minimum": -127, "maximum": 127},
             "description": "round(127 x / |x|)"},
    "uint8": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 255}, "description": "int8 + 128"},
    "binary": {"type": "array", "items": {"type": "integer", "minimum": -128, "maximum": 127},
               "description": f"{_BITS}, less 128"},
    "ubinary": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}, "description": _BITS},
    "base64_int8": {**_BASE64, "description": "base64 of the int8 row's bytes"},
    "base64_binary": {**_BASE64, "description": "base64 of the row's bits, the first value in the least significant"},
}  # fmt: skip
# A row in a response: numpy's array (orjson writes its numbers) or a base64 string, as its format answers it.
Row = Annotated[Any, Meta(extra_json_schema={"anyOf": list(ROW_ENCODINGS.values())})]
Count = Annotated[int, Meta(ge=0)]


def _any_case(words: tuple[str, ...]) -> str:
    """A pattern of `words` in any case, or "": the route lower-cases before it compares (TEI spells "Right")."""
    spelled = "|".join("".join(f"[{c.upper()}{c.lower()}]" for c in word) for word in words)
    return f"^({spelled})?$"


TruncationDirection = (
    Annotated[
        str,
        described(
            "right (the default) or left, in any case", pattern=_any_case(TRUNCATION_DIRECTIONS), example="right"
        ),
    ]
    | None
)
Truncate = Annotated[bool, described("false: an over-long input is an error", default=True)] | None
_INSTRUCTION = "a decoder reranker's instruction (Qwen3-Reranker), a chat reranker's system message; refused by others"
Instruction = Annotated[str, described(_INSTRUCTION)] | None
RawScores = Annotated[bool, described("the logits, no activation", default=False)] | None


def choice(value: str | None, name: str, choices: tuple[str, ...] | dict[str, Any], default: str) -> str:
    """`value` if among `choices`; null or "" for `default`."""
    value = value or default
    if value not in choices:
        raise InvalidRequest(f"{name} must be one of {', '.join(choices)}; got {value!r}", "invalid_value", name)
    return value


def long_input(value: str | None) -> str | None:
    if value is not None and value not in LONG_INPUTS:
        raise InvalidRequest(f"'long_input' must be one of {LONG_INPUTS}, got {value!r}", "invalid_value", "long_input")
    return value


def response_format(encoding_format: str | None, embed_dtype: str | None, endianness: str | None) -> ResponseFormat:
    """`encoding_format` (bouquet/encodings.py FORMATS), and for base64 vLLM's `embed_dtype` and `endianness`.
    Those two change only base64's bytes: with another format, a value other than their default is refused
    rather than ignored."""
    name = choice(encoding_format, "encoding_format", FORMATS, "float")
    dtype = _base64_only(embed_dtype, "embed_dtype", EMBED_DTYPES, "float32", name)
    big_endian = _base64_only(endianness, "endianness", ENDIANNESS, "native", name)
    if name != "base64":
        return FORMATS[name]
    return ResponseFormat(dtype, base64=True, big_endian=big_endian)


def _base64_only(value: str | None, field: str, choices: dict[str, Any], default: str, encoding_format: str) -> Any:
    value = choice(value, field, choices, default)
    if value != default and encoding_format != "base64":
        raise InvalidRequest(
            f"{field} applies to encoding_format 'base64' only, not {encoding_format!r}",
            "unsupported_parameter",
            field,
        )
    return choices[value]


def truncation_direction(value: str | None) -> str:
    return choice((value or "right").lower(), "truncation_direction", TRUNCATION_DIRECTIONS, "right")


def refuse_unless(value: Any, name: str, accepted: Any, why: str) -> None:
    """A field taken only at one value (or null): any other, of any type, is refused by name."""
    if value is not None and (value != accepted or type(value) is not type(accepted)):  # 1 == True, yet no bool
        raise InvalidRequest(f"'{name}' = {value!r} is not supported: {why}", "unsupported_parameter", name)


def parse_inputs(value: str | list[Any], param: str) -> tuple[list[str] | None, list[list[int]] | None]:
    """A decoded `Input` (its types, and that nothing is empty, already checked) as its texts and lists of token
    ids: one list of ids, texts, lists of ids, or (as TEI takes) texts and lists of ids mixed; then both come back,
    and `text_positions` tells where each text goes."""
    if isinstance(value, str):
        return [value], None
    if type(value[0]) is int:
        if not all(type(item) is int for item in value):
            raise Unprocessable(f"'{param}' mixes token ids with texts or lists", "invalid_type", param)
        return None, [value]
    if all(type(item) is str for item in value):
        return value, None
    texts: list[str] = []
    token_ids: list[list[int]] = []
    for index, item in enumerate(value):
        if type(item) not in (str, list):  # an int among texts, or an object where only texts and ids go
            raise Unprocessable(f"'{param}[{index}]' must be a text or a list of token ids", "invalid_type", param)
        (texts if type(item) is str else token_ids).append(item)
    return texts or None, token_ids


def text_positions(
    value: str | list[Any], texts: list[str] | None, token_ids: list[list[int]] | None
) -> tuple[int, ...] | None:
    if texts is None or token_ids is None:
        return None
    return tuple(index for index, item in enumerate(value) if type(item) is str)


def mode_weights(value: list[float] | None) -> tuple[float, float, float] | None:
    """`weights_for_different_modes` checked: three finite weights, none negative, not all zero."""
    if value is None:
        return None
    if not all(math.isfinite(weight) and weight >= 0 for weight in value) or sum(value) <= 0:
        message = f"weights_for_different_modes {value}: three weights >= 0 (dense, sparse, colbert), not all zero"
        raise InvalidRequest(message, "invalid_value", "weights_for_different_modes")
    return value[0], value[1], value[2]
