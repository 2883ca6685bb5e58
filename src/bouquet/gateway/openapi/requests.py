"""The request bodies: each route's struct (gateway/api/), its schema generated from it (structs.py), and the bodies
a route takes in one of two shapes."""

from __future__ import annotations

from bouquet.gateway.api.cohere import CohereRerankRequest, CohereV2EmbedRequest, CohereV2RerankRequest
from bouquet.gateway.api.flag_embedding import ComputeScoreRequest, EncodeRequest
from bouquet.gateway.api.jina import MultiVectorRequest
from bouquet.gateway.api.kserve import KServeInferRequest
from bouquet.gateway.api.multimodal import ChatEmbeddingsRequest, ImageEmbeddingsRequest
from bouquet.gateway.api.openai import EmbeddingsRequest
from bouquet.gateway.api.perplexity import ContextualizedEmbeddingsRequest
from bouquet.gateway.api.tei_bodies import (
    DecodeRequest,
    EmbedAllRequest,
    EmbedSparseRequest,
    PredictRequest,
    SimilarityRequest,
    TEIEmbedRequest,
    TEIRerankRequest,
    TEITokenizeRequest,
)
from bouquet.gateway.api.vllm import DetokenizeRequest, ScoreRequest, VLLMTokenizeRequest
from bouquet.gateway.openapi.pieces import Schema, named
from bouquet.gateway.openapi.structs import struct_schemas

REQUESTS = (
    EmbeddingsRequest, TEIEmbedRequest, SimilarityRequest, EmbedSparseRequest, EmbedAllRequest,
    ContextualizedEmbeddingsRequest, TEITokenizeRequest, VLLMTokenizeRequest, DecodeRequest, PredictRequest,
    DetokenizeRequest, TEIRerankRequest, CohereRerankRequest, CohereV2EmbedRequest, CohereV2RerankRequest,
    ScoreRequest, MultiVectorRequest, EncodeRequest, ChatEmbeddingsRequest, ImageEmbeddingsRequest,
    ComputeScoreRequest, KServeInferRequest,
)  # fmt: skip
REFS = {name: named(name, schema) for name, schema in struct_schemas(REQUESTS)[1].items()}

OPENAI_EMBEDDINGS_REQUEST: Schema = {
    "description": '`input` (texts, token ids; images with Infinity\'s `"modality": "image"`), or vLLM\'s chat '
    "form: `messages` holding one text or one image",
    "oneOf": [REFS["EmbeddingsRequest"], REFS["ChatEmbeddingsRequest"]],
}
IMAGE_EMBEDDINGS_REQUEST = REFS["ImageEmbeddingsRequest"]
TEI_EMBED_REQUEST = REFS["TEIEmbedRequest"]
SIMILARITY_REQUEST = REFS["SimilarityRequest"]
TEI_ROOT_REQUEST: Schema = {
    "description": "an embedding request, or (`inputs` an object) a similarity request, as the Hugging Face "
    "Inference API takes both at one URL",
    "oneOf": [TEI_EMBED_REQUEST, SIMILARITY_REQUEST],
}
EMBED_SPARSE_REQUEST = REFS["EmbedSparseRequest"]
EMBED_ALL_REQUEST = REFS["EmbedAllRequest"]
CONTEXTUAL_REQUEST = REFS["ContextualizedEmbeddingsRequest"]
TOKENIZE_REQUEST: Schema = {
    "description": "TEI's body (`inputs`; TEI's errors), or vLLM's (`prompt` and no `inputs`; OpenAI's errors)",
    "anyOf": [REFS["TEITokenizeRequest"], REFS["VLLMTokenizeRequest"]],
}
DECODE_REQUEST = REFS["DecodeRequest"]
PREDICT_REQUEST = REFS["PredictRequest"]
DETOKENIZE_REQUEST = REFS["DetokenizeRequest"]
COHERE_RERANK_REQUEST = REFS["CohereRerankRequest"]
COHERE_V2_EMBED_REQUEST = REFS["CohereV2EmbedRequest"]
COHERE_V2_RERANK_REQUEST = REFS["CohereV2RerankRequest"]
RERANK_REQUEST: Schema = {
    "description": "TEI's body (`texts`; TEI's answer and errors), or Cohere's and Jina's (`documents`; theirs)",
    "oneOf": [REFS["TEIRerankRequest"], COHERE_RERANK_REQUEST],
}
SCORE_REQUEST = REFS["ScoreRequest"]
MULTI_VECTOR_REQUEST = REFS["MultiVectorRequest"]
ENCODE_REQUEST = REFS["EncodeRequest"]
COMPUTE_SCORE_REQUEST = REFS["ComputeScoreRequest"]
KSERVE_INFER_REQUEST = REFS["KServeInferRequest"]
