"""The bodies of Cohere's answers (api/cohere.py writes them), as its SDK reads them: v1's rerank (also Jina's and
vLLM's), v2's embed (EmbedByTypeResponse, with the images' facts) and rerank."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from bouquet.gateway.api.fields import Count
from bouquet.gateway.api.openai import Usage
from bouquet.gateway.http.decode import ResponseBody


class RankedDocument(ResponseBody):
    text: str


class RankedResult(ResponseBody):
    index: Count
    relevance_score: float
    document: RankedDocument | UnsetType = UNSET  # with return_documents


class CohereRanking(ResponseBody):
    id: str
    model: str
    results: list[RankedResult]
    usage: Usage  # vLLM's both, Jina's total


class ApiVersion(ResponseBody):
    version: Literal["2"] = "2"


class BilledUnits(ResponseBody):
    input_tokens: Count | UnsetType = UNSET
    search_units: Count | UnsetType = UNSET


class CohereMeta(ResponseBody):
    billed_units: BilledUnits
    api_version: ApiVersion = msgspec.field(default_factory=ApiVersion)


# Aliases, as the fields' names (float, base64) would shadow the builtins in the class's own annotations.
_Floats = list[list[float]] | UnsetType
_Ints = list[list[int]] | UnsetType
_Strings = list[str] | UnsetType


class EmbeddingsByType(ResponseBody):
    """The types asked for (embedding_types)."""

    float: _Floats = UNSET
    int8: _Ints = UNSET
    uint8: _Ints = UNSET
    binary: _Ints = UNSET
    ubinary: _Ints = UNSET
    base64: _Strings = UNSET


class CohereImageFacts(ResponseBody):
    """Cohere's Image: an image embedded, as its file has it (gateway/image_facts.py)."""

    width: Count
    height: Count
    format: str
    bit_depth: Count


class CohereV2Embeddings(ResponseBody):
    id: str
    embeddings: EmbeddingsByType
    texts: list[str]
    meta: CohereMeta
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"
    images: list[CohereImageFacts] | UnsetType = UNSET  # each image embedded, in input order; none: left out


class V2RankedResult(ResponseBody):
    index: Count
    relevance_score: float


class CohereV2Ranking(ResponseBody):
    id: str
    results: list[V2RankedResult]
    meta: CohereMeta
