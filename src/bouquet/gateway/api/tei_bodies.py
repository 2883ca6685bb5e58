"""text-embeddings-inference's request and answer bodies (tei.py's routes; tei_scores.py's requests), each declared
once: requests decoded into these structs, answers written from them, both documented from them. TEI's field names,
plus bouquet's `model` on every route."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from bouquet.gateway.api.fields import (
    ROW_ENCODINGS,
    Count,
    Dimensions,
    EmbedDtype,
    EncodingFormat,
    Endianness,
    Input,
    Instruction,
    LongInput,
    Model,
    ModeWeights,
    PromptName,
    RawScores,
    Text,
    Texts,
    Truncate,
    TruncationDirection,
    described,
)
from bouquet.gateway.api.openai import Sparse, Task
from bouquet.gateway.http.decode import BodyDecoder, RequestBody, ResponseBody
from bouquet.gateway.replicas.tokenization import TokenSpan


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
    weights_for_different_modes: ModeWeights = None


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


# Answers

TEIEmbeddings = Annotated[
    Any, described("one row per input, in order", type="array", items={"anyOf": list(ROW_ENCODINGS.values())})
]  # fmt: skip  (numpy's rows, or base64 strings)
Similarities = Annotated[list[float], described("the cosine of source_sentence with each sentence, in order")]
TokenStates = Annotated[
    list[Any],
    described(
        "per input, every token's last hidden state, special tokens too",
        items={"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
    ),
]  # fmt: skip  (numpy's [tokens, hidden] arrays)
Decoded = list[str]
TEITokens = Annotated[list[list[TokenSpan]], described("per input, its tokens with their character spans")]


class SparseEntry(ResponseBody):
    index: Annotated[Count, described("a vocabulary id")]
    value: float


SparseEntries = Annotated[
    list[Annotated[list[SparseEntry], described("an input's nonzero weights, by ascending index")]],
    described("one per input, in order"),
]


class Pooling(ResponseBody):
    pooling: str


class Classifier(ResponseBody):
    """A reranker's (one label) or a classifier's labels, and its activation."""

    id2label: dict[str, str]
    label2id: dict[str, Count]
    activation: str


_REF = "#/components/schemas/{}"
_MODEL_TYPES = [
    {"type": "object", "properties": {name: {"$ref": _REF.format(kind)}}, "required": [name],
     "additionalProperties": False}
    for name, kind in (("embedding", "Pooling"), ("reranker", "Classifier"), ("classifier", "Classifier"))
]  # fmt: skip


class Info(ResponseBody):
    model_id: str
    model_dtype: str
    model_type: Annotated[dict[str, Any], Meta(extra_json_schema={"oneOf": _MODEL_TYPES})]
    task: Task
    sparse: Sparse
    family: str
    architecture: str
    normalize: bool
    dimension: Count
    max_input_length: Count
    max_batch_tokens: Count
    max_client_batch_size: Count
    prompts: dict[str, str]
    default_prompt_name: str | None
    replicas: Count
    version: str
    # TEI's router fields, for clients that read them
    served_model_name: str
    max_concurrent_requests: Count
    tokenization_workers: Count
    auto_truncate: bool = True
    model_sha: None = None
    max_batch_requests: None = None
    sha: None = None
    docker_label: None = None


class Health(ResponseBody):
    unix: Annotated[float, described("Infinity's: the server's clock")]
    status: Literal["ok"] = "ok"
