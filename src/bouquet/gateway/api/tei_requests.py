"""text-embeddings-inference's request bodies (tei.py's and tei_scores.py's routes), each declared once: decoded
into these structs and documented from them. TEI's field names, plus bouquet's `model` on every route."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from bouquet.gateway.api.fields import (
    Dimensions,
    EmbedDtype,
    EncodingFormat,
    Endianness,
    Input,
    Instruction,
    LongInput,
    Model,
    PromptName,
    RawScores,
    Text,
    Texts,
    Truncate,
    TruncationDirection,
    described,
)
from bouquet.gateway.http.decode import BodyDecoder, RequestBody


class EmbedAllRequest(RequestBody):
    """TEI's EmbedAllRequest. Other fields are refused by name (422 on TEI's routes) unless the server runs with
    --allow-unknown-fields."""

    inputs: Input
    truncate: Truncate = None
    truncation_direction: TruncationDirection = None
    prompt_name: PromptName = None
    model: Model = None


class EmbedSparseRequest(EmbedAllRequest):
    """TEI's EmbedSparseRequest: one kind of input a request (texts, or lists of token ids). Other fields are
    refused by name (422 on TEI's routes) unless the server runs with --allow-unknown-fields."""


class TEIEmbedRequest(EmbedAllRequest):
    """TEI's EmbedRequest, with vLLM's encodings. Other fields are refused by name (422 on TEI's routes) unless the
    server runs with --allow-unknown-fields."""

    normalize: Annotated[bool, described("default: as the model's Normalize module says")] | None = None
    dimensions: Dimensions = None
    encoding_format: EncodingFormat = None
    embed_dtype: EmbedDtype = None
    endianness: Endianness = None
    long_input: LongInput = None


class SimilarityInputs(msgspec.Struct):
    """The sentence compared, and those it is compared with (other fields are ignored, as TEI does)."""

    source_sentence: Text
    sentences: Texts


class SimilarityParameters(RequestBody):
    truncate: Truncate = None
    truncation_direction: TruncationDirection = None
    prompt_name: PromptName = None


class SimilarityRequest(RequestBody):
    """TEI's SimilarityRequest (the Hugging Face Inference API's sentence-similarity body)."""

    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None
    model: Model = None


class _LenientParameters(SimilarityParameters, forbid_unknown_fields=False):
    pass


class _LenientSimilarity(SimilarityRequest, forbid_unknown_fields=False):
    parameters: _LenientParameters | None = None  # --allow-unknown-fields reaches into the parameters too


class TEITokenizeRequest(RequestBody):
    """TEI's TokenizeRequest. Other fields are refused by name (422 on TEI's routes) unless the server runs with
    --allow-unknown-fields."""

    inputs: Text | Texts
    add_special_tokens: bool = True
    prompt_name: PromptName = None
    model: Model = None


_IDS_SCHEMA = {
    "anyOf": [{"type": "array", "items": {"type": "integer"}},
              {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}, "minItems": 1}],
}  # fmt: skip


class DecodeRequest(RequestBody):
    ids: Annotated[
        list[int | list[int]], Meta(description="one sequence, or a list of them", extra_json_schema=_IDS_SCHEMA)
    ]
    skip_special_tokens: Annotated[bool, Meta(extra_json_schema={"default": True})] | None = None
    model: Model = None


class TEIRerankRequest(RequestBody):
    query: Text
    texts: Texts
    model: Model = None
    raw_scores: RawScores = None
    return_text: Annotated[bool, Meta(extra_json_schema={"default": False})] | None = None
    truncate: Truncate = None
    truncation_direction: Annotated[
        str, described("right only: the longer part of a pair is cut from its end", pattern="^([Rr][Ii][Gg][Hh][Tt])?$")
    ] | None = None  # fmt: skip
    instruction: Instruction = None


# One text, or a pair: the route checks the count (422 otherwise, a body of the wrong shape).
_PAIR_SCHEMA = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 2}
_PAIR = Annotated[list[Text], Meta(extra_json_schema={"minItems": 1, "maxItems": 2})]
_PREDICT_SCHEMA = {
    "anyOf": [{"type": "string", "minLength": 1}, _PAIR_SCHEMA, {"type": "array", "items": _PAIR_SCHEMA, "minItems": 1}]
}


class PredictRequest(RequestBody):
    inputs: Annotated[
        Text | list[Text | _PAIR],
        described("a text, [text], [first, second] (a pair), or a batch of [text] / [first, second]"),
        Meta(extra_json_schema=_PREDICT_SCHEMA),
    ]
    truncate: Truncate = None
    truncation_direction: TruncationDirection = None  # left: texts only
    raw_scores: RawScores = None
    model: Model = None
    instruction: Instruction = None


EMBED = BodyDecoder(TEIEmbedRequest)
EMBED_ALL = BodyDecoder(EmbedAllRequest)
EMBED_SPARSE = BodyDecoder(EmbedSparseRequest)
SIMILARITY = BodyDecoder(SimilarityRequest, _LenientSimilarity)
TOKENIZE = BodyDecoder(TEITokenizeRequest)
DECODE = BodyDecoder(DecodeRequest)
RERANK = BodyDecoder(TEIRerankRequest)
PREDICT = BodyDecoder(PredictRequest)
