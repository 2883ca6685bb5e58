"""The response bodies: what each route answers with a 200, generated from the types its handler answers with
(gateway/api/; TEI's tokens are the tokenizer's TokenSpan, replicas/tokenization.py)."""

from __future__ import annotations

from bouquet.gateway.api.cohere_answers import CohereRanking, CohereV2Embeddings, CohereV2Ranking
from bouquet.gateway.api.flag_embedding import Encoded, ModeScores
from bouquet.gateway.api.jina import MultiVectorList
from bouquet.gateway.api.kserve import (
    KServeInferResponse,
    KServeLive,
    KServeModelMetadata,
    KServeModelReady,
    KServeReady,
    KServeServerMetadata,
)
from bouquet.gateway.api.openai import EmbeddingList, ModelCard, ModelList
from bouquet.gateway.api.perplexity import ContextualizedEmbeddingList
from bouquet.gateway.api.tei_bodies import (
    Classifier,
    Decoded,
    Health,
    Info,
    Pooling,
    Similarities,
    SparseEntries,
    TEIEmbeddings,
    TEITokens,
    TokenStates,
)
from bouquet.gateway.api.tei_scores import Prediction, Predictions, TEIRanking
from bouquet.gateway.api.vllm import Detokenized, Scores, VLLMTokens
from bouquet.gateway.openapi.pieces import named
from bouquet.gateway.openapi.structs import struct_schemas

# Answers that are lists, named as the document names them; structs by their class's name.
_LISTS = {
    "TEIEmbeddings": TEIEmbeddings, "Similarities": Similarities, "TokenStates": TokenStates,
    "SparseRows": SparseEntries, "Decoded": Decoded, "TEITokens": TEITokens, "Predictions": Predictions,
    "TEIRanking": TEIRanking,
}  # fmt: skip
_STRUCTS = (
    EmbeddingList, ContextualizedEmbeddingList, ModelCard, ModelList, MultiVectorList, Scores, VLLMTokens,
    Detokenized, CohereRanking, CohereV2Embeddings, CohereV2Ranking, Info, Health, Pooling, Classifier, Prediction,
    Encoded, ModeScores, KServeInferResponse, KServeLive, KServeReady, KServeServerMetadata, KServeModelMetadata,
    KServeModelReady,
)  # fmt: skip
_schemas, _components = struct_schemas((*_LISTS.values(), *_STRUCTS))
REFS = {name: named(name, schema) for name, schema in _components.items()}
REFS.update({name: named(name, schema) for name, schema in zip(_LISTS, _schemas, strict=False)})

OPENAI_EMBEDDINGS = REFS["EmbeddingList"]
CONTEXTUAL = REFS["ContextualizedEmbeddingList"]
TEI_ROWS = REFS["TEIEmbeddings"]
SIMILARITIES = REFS["Similarities"]
TOKEN_STATES = REFS["TokenStates"]
SPARSE_ROWS = REFS["SparseRows"]
TEI_TOKENS = REFS["TEITokens"]
VLLM_TOKENS = REFS["VLLMTokens"]
DECODED = REFS["Decoded"]
PREDICTIONS = REFS["Predictions"]
DETOKENIZED = REFS["Detokenized"]
TEI_RANKING = REFS["TEIRanking"]
COHERE_RANKING = REFS["CohereRanking"]
COHERE_V2_EMBEDDINGS = REFS["CohereV2Embeddings"]
COHERE_V2_RANKING = REFS["CohereV2Ranking"]
SCORES = REFS["Scores"]
MODEL_CARD = REFS["ModelCard"]
MODELS = REFS["ModelList"]
INFO = REFS["Info"]
HEALTH = REFS["Health"]
MULTI_VECTOR_RESPONSE = REFS["MultiVectorList"]
ENCODED = REFS["Encoded"]
MODE_SCORES = REFS["ModeScores"]
KSERVE_INFER_RESPONSE = REFS["KServeInferResponse"]
KSERVE_LIVE = REFS["KServeLive"]
KSERVE_READY = REFS["KServeReady"]
KSERVE_SERVER_METADATA = REFS["KServeServerMetadata"]
KSERVE_MODEL_METADATA = REFS["KServeModelMetadata"]
KSERVE_MODEL_READY = REFS["KServeModelReady"]
