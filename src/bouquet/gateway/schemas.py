"""The OpenAI and TEI request bodies, checked by hand (a schema library costs more than the check on the hot
path), into one `EmbedJob`; and the response bodies. Each error names the offending field in `param`."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from bouquet.encodings import EMBED_DTYPES, ENDIANNESS, FORMATS, ResponseFormat
from bouquet.gateway.errors import InvalidRequest, Unprocessable
from bouquet.tokenizer import TRUNCATION_DIRECTIONS

ENCODING_FORMATS = tuple(FORMATS)  # encoding_format's values, in the documented order
# What each route reads; anything else is refused by name (400 unsupported_parameter) unless the server runs with
# --allow-unknown-fields, so a client never gets other vectors than it asked for without being told.
OPENAI_FIELDS = frozenset(
    {"input", "model", "encoding_format", "dimensions", "user",
     # vLLM's extensions: honoured as vLLM does, or refused below when a value asks for what is not done here
     "normalize", "truncate_prompt_tokens", "add_special_tokens", "embed_dtype", "endianness", "use_activation",
     "priority", "request_id",
     "modality",  # Infinity's (text only)
     "long_input"}  # bouquet's: "chunk" embeds an over-long input whole
)  # fmt: skip
TEI_FIELDS = frozenset(
    {
        "inputs",
        "normalize",
        "truncate",
        "truncation_direction",
        "prompt_name",
        "dimensions",
        "model",
        "encoding_format",
        "embed_dtype",
        "endianness",
        "long_input",
    }
)

T = TypeVar("T")


@dataclass(frozen=True)
class EmbedJob:
    """One embedding request, whichever API it came through; exactly one of texts and token_ids is set."""

    model: str | None
    texts: list[str] | None
    token_ids: list[list[int]] | None
    dimensions: int | None = None
    normalize: bool | None = None  # None: as the model's Normalize module says
    truncate: bool = True
    truncation_direction: str = "right"
    prompt_name: str | None = None
    response_format: ResponseFormat = FORMATS["float"]  # encoding_format, embed_dtype and endianness
    truncate_tokens: int | None = None  # vLLM's truncate_prompt_tokens: keep the first this many tokens
    long_input: str | None = None  # "truncate" or "chunk" (long_inputs.py); None: the server's --long-input

    text_positions: tuple[int, ...] | None = None  # texts and token ids mixed: where each text is in the input
    sparse: bool = False  # each input's sparse row (TEI's /embed_sparse), not its embedding

    @property
    def num_inputs(self) -> int:
        return len(self.texts or ()) + len(self.token_ids or ())


def parse_openai(body: dict[str, Any], strict: bool = True) -> EmbedJob:
    if strict:
        refuse_unknown(body, OPENAI_FIELDS)
    optional_field(body, "user", str)
    response_format = parse_response_format(body)
    if "input" not in body:
        raise InvalidRequest("'input' is required", "missing_required_parameter", "input")
    _refuse_unless(body, "add_special_tokens", True, "special tokens are always added, as the model was trained")
    _refuse_unless(body, "modality", "text", "only text is embedded here")
    optional_field(body, "priority", int)  # vLLM's scheduling hint: requests here are served first come
    optional_field(body, "request_id", str)
    texts, token_ids = parse_inputs(body["input"], "input")
    positions = _text_positions(body["input"], texts, token_ids)
    return EmbedJob(
        model=optional_field(body, "model", str),
        texts=texts,
        token_ids=token_ids,
        dimensions=_dimensions(body),
        normalize=_normalize(body),
        response_format=response_format,
        truncate_tokens=_truncate_prompt_tokens(body),
        text_positions=positions,
        long_input=long_input(body),
    )


def _normalize(body: dict[str, Any]) -> bool | None:
    """vLLM's `normalize`, or `use_activation`, its newer name for the same switch on an embedding model."""
    normalize, use_activation = optional_field(body, "normalize", bool), optional_field(body, "use_activation", bool)
    if normalize is not None and use_activation is not None and normalize != use_activation:
        raise InvalidRequest(
            "'normalize' and 'use_activation' are the same switch here; they disagree",
            "invalid_value",
            "use_activation",
        )
    return normalize if normalize is not None else use_activation


def refuse_unknown(body: dict[str, Any], allowed: frozenset[str] | set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequest(
            f"'{unknown[0]}' is not a parameter of this route; it takes {', '.join(sorted(allowed))}",
            "unsupported_parameter",
            unknown[0],
        )


def _refuse_unless(body: dict[str, Any], name: str, accepted: Any, why: str) -> None:
    value = body.get(name, accepted)
    if value is not None and (value != accepted or type(value) is not type(accepted)):  # 1 == True, yet no bool
        raise InvalidRequest(f"'{name}' = {value!r} is not supported: {why}", "unsupported_parameter", name)


def _truncate_prompt_tokens(body: dict[str, Any]) -> int | None:
    """vLLM's: each input cut to k tokens as its tokenizer truncates (vLLM 0.32: the first k, special tokens kept,
    for these models' tokenizers, whose truncation side is the right); -1: the model's limit."""
    value = optional_field(body, "truncate_prompt_tokens", int)
    if value is None or value == -1:
        return None
    if value < 1:
        raise InvalidRequest(
            f"'truncate_prompt_tokens' must be -1 or at least 1, got {value}", "invalid_value", "truncate_prompt_tokens"
        )
    return value


def parse_tei(body: dict[str, Any], strict: bool = True) -> EmbedJob:
    if strict:
        refuse_unknown(body, TEI_FIELDS)
    if "inputs" not in body:
        raise InvalidRequest("'inputs' is required", "missing_required_parameter", "inputs")
    texts, token_ids = parse_inputs(body["inputs"], "inputs")
    positions = _text_positions(body["inputs"], texts, token_ids)
    normalize = optional_field(body, "normalize", bool)
    truncate = optional_field(body, "truncate", bool)
    return EmbedJob(
        model=optional_field(body, "model", str),
        texts=texts,
        token_ids=token_ids,
        dimensions=_dimensions(body),
        normalize=normalize,
        truncate=True if truncate is None else truncate,
        truncation_direction=truncation_direction(body),
        prompt_name=optional_field(body, "prompt_name", str),
        response_format=parse_response_format(body),
        text_positions=positions,
        # truncate=false stays an error for an over-long input, as on TEI, unless the request asks to chunk it
        long_input=long_input(body) or ("truncate" if truncate is False else None),
    )


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
    if _is_int(first):
        return None, [_check_ids(value, param, None)]
    if isinstance(first, list | str):
        return _mixed(value, param)
    raise Unprocessable(f"'{param}[0]' has an unsupported type {type(first).__name__}", "invalid_type", param)


def _text_positions(value: Any, texts: list[str] | None, token_ids: list[list[int]] | None) -> tuple[int, ...] | None:
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
    if not isinstance(ids, list) or not all(map(_is_int, ids)):
        raise Unprocessable(f"'{where}' must be a list of integer token ids", "invalid_type", param)
    if not ids:
        raise InvalidRequest(f"'{where}' is an empty list of token ids", "empty_input", param)
    return ids


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dimensions(body: dict[str, Any]) -> int | None:
    dimensions = body.get("dimensions")
    if dimensions is None:
        return None
    if not _is_int(dimensions):
        raise Unprocessable("'dimensions' must be an integer", "invalid_type", "dimensions")
    return int(dimensions)


def optional_field(body: dict[str, Any], name: str, kind: type[T]) -> T | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise Unprocessable(f"'{name}' must be of type {kind.__name__}", "invalid_type", name)
    return value


def openai_response(
    rows: np.ndarray, model: str, prompt_tokens: int, response_format: ResponseFormat
) -> dict[str, Any]:
    """rows: [N, elements] in the format's encoding, each answered as a list of numbers (orjson writes numpy rows
    itself) or as base64 of its bytes: little-endian float32 for plain base64, as OpenAI's clients decode."""
    embeddings = response_format.answer(rows)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(embeddings)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def with_response_id(response: dict[str, Any], prefix: str = "embd") -> dict[str, Any]:
    """vLLM's and Infinity's fields beside OpenAI's: the response's `id` and `created`, and `completion_tokens`."""
    response["usage"].setdefault("completion_tokens", 0)
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), **response}
