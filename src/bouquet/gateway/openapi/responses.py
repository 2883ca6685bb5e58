"""The response bodies: what each route answers with a 200."""

from __future__ import annotations

from bouquet.gateway.api.fields import ENCODING_FORMATS
from bouquet.gateway.openapi.pieces import (
    ALWAYS_NULL,
    BOOLEAN,
    COUNT,
    FLOATS,
    INTEGER,
    NUMBER,
    STRING,
    TEI_ENCODING_FORMATS,
    Schema,
    array_of,
    json_object,
    named,
    nullable,
    response_schema,
    row_schema,
)

# Response bodies: what the handlers in gateway/api/ answer

USAGE = named("Usage", response_schema({"prompt_tokens": COUNT, "total_tokens": COUNT}))


def _embeddings(formats: tuple[str, ...]) -> Schema:
    embedding = {"object": {"type": "string", "enum": ["embedding"]}, "index": COUNT, "embedding": row_schema(formats)}
    return array_of(response_schema(embedding), description="one per input, in order")


OPENAI_EMBEDDINGS = named("EmbeddingList", response_schema({
    "id": {**STRING, "description": "vLLM's and Infinity's: embd-..."}, "created": {**COUNT, "description": "unix"},
    "object": {"type": "string", "enum": ["list"]}, "data": _embeddings(ENCODING_FORMATS), "model": STRING,
    "usage": named("EmbeddingUsage", response_schema(
        {"prompt_tokens": COUNT, "total_tokens": COUNT, "completion_tokens": {"type": "integer", "enum": [0]}}
    )),
}))  # fmt: skip
CONTEXTUAL = named("ContextualizedEmbeddingList", response_schema({
    "object": {"type": "string", "enum": ["list"]},
    "data": array_of(response_schema({
        "object": {"type": "string", "enum": ["list"]}, "index": COUNT, "data": _embeddings(ENCODING_FORMATS)
    }), description="one per document, its chunks in order"),
    "model": STRING,
    "usage": USAGE,
}))  # fmt: skip
TEI_ROWS = named("TEIEmbeddings", array_of(row_schema(TEI_ENCODING_FORMATS), description="one row per input, in order"))
SIMILARITIES = named(
    "Similarities", array_of(NUMBER, description="the cosine of source_sentence with each sentence, in order")
)
TOKEN_STATES = named(
    "TokenStates",
    array_of(array_of(FLOATS), description="per input, every token's last hidden state, special tokens too"),
)
SPARSE_ROWS = named("SparseRows", array_of(
    array_of(response_schema({"index": {**COUNT, "description": "a vocabulary id"}, "value": NUMBER}),
           description="an input's nonzero weights, by ascending index"),
    description="one per input, in order",
))  # fmt: skip
TEI_TOKENS = named("TEITokens", array_of(
    array_of(
        response_schema({
            "id": COUNT, "text": STRING, "special": BOOLEAN,
            "start": nullable({**COUNT, "description": "null for a special token"}), "stop": nullable(COUNT),
        })
    ),
    description="per input, its tokens with their character spans",
))  # fmt: skip
VLLM_TOKENS = named("VLLMTokens", response_schema({
    "count": COUNT, "max_model_len": COUNT, "tokens": array_of(COUNT),
    "token_strs": nullable(
        {**array_of(nullable(STRING)), "description": "the vocabulary's token strings; null unless return_token_strs"}
    ),
}))  # fmt: skip
DECODED = named("Decoded", array_of(STRING))
_PREDICTIONS = array_of(json_object({"score": NUMBER, "label": STRING}, ("score", "label")), 1)
PREDICTIONS = named(
    "Predictions", {"anyOf": [_PREDICTIONS, array_of(_PREDICTIONS)], "description": "every label, best first"}
)
DETOKENIZED = named("Detokenized", response_schema({"prompt": STRING}))
TEI_RANKING = named(
    "TEIRanking",
    array_of(
        json_object({"index": COUNT, "score": NUMBER, "text": STRING}, ("index", "score")),
        description="every text, best first; `text` with return_text",
    ),
)
COHERE_RANKING = named("CohereRanking", response_schema({
    "id": STRING,
    "model": STRING,
    "results": array_of(
        json_object({"index": COUNT, "relevance_score": NUMBER, "document": response_schema({"text": STRING})},
                ("index", "relevance_score"))
    ),
    "usage": USAGE,
}))  # fmt: skip
_COHERE_META = named("CohereMeta", response_schema({
    "api_version": response_schema({"version": {"type": "string", "enum": ["2"]}}),
    "billed_units": json_object({"input_tokens": COUNT, "search_units": COUNT}),
}))  # fmt: skip
_INTEGERS = array_of(array_of(INTEGER))
COHERE_V2_EMBEDDINGS = named("CohereV2Embeddings", response_schema({
    "id": STRING,
    "embeddings": json_object({"float": array_of(array_of(NUMBER)), "int8": _INTEGERS, "uint8": _INTEGERS,
                           "binary": _INTEGERS, "ubinary": _INTEGERS, "base64": array_of(STRING)},
                          description="the types asked for (embedding_types)"),
    "texts": array_of(STRING),
    "meta": _COHERE_META,
    "response_type": {"type": "string", "enum": ["embeddings_by_type"]},
}))  # fmt: skip
COHERE_V2_RANKING = named("CohereV2Ranking", response_schema({
    "id": STRING,
    "results": array_of(response_schema({"index": COUNT, "relevance_score": NUMBER})),
    "meta": _COHERE_META,
}))  # fmt: skip
SCORES = named("Scores", response_schema({
    "id": STRING, "object": {"type": "string", "enum": ["list"]}, "created": COUNT, "model": STRING,
    "data": array_of(
        response_schema({"index": COUNT, "object": {"type": "string", "enum": ["score"]}, "score": NUMBER})
    ),
    "usage": USAGE,
}))  # fmt: skip
TASK: Schema = {
    "type": "string", "enum": ["embed", "score", "sparse", "multi_vector"],
    "description": "sparse: a SPLADE model; multi_vector: a ColBERT model (per-token vectors)",
}  # fmt: skip
SPARSE: Schema = {**BOOLEAN, "description": "whether /embed_sparse serves it (SPLADE, or bge-m3's sparse head)"}
MODEL_CARD = named("Model", response_schema({
    "id": STRING, "object": {"type": "string", "enum": ["model"]}, "created": INTEGER, "owned_by": STRING,
    "root": {**STRING, "description": "the model's own name; id is one of its --served-model-name where given"},
    "family": STRING, "task": TASK, "sparse": SPARSE, "architecture": STRING,
    "pooling": STRING, "normalize": BOOLEAN, "dimension": COUNT, "max_input_length": COUNT, "dtype": STRING,
    "replicas": {**COUNT, "description": "healthy replicas serving it"},
    "stats": response_schema({"healthy_replicas": COUNT, "max_batch_tokens": COUNT}, description="Infinity's"),
}))  # fmt: skip
MODELS = named(
    "ModelList", response_schema({"object": {"type": "string", "enum": ["list"]}, "data": array_of(MODEL_CARD)})
)
_CLASSIFIER = response_schema(
    {
        "id2label": {"type": "object", "additionalProperties": STRING},
        "label2id": {"type": "object", "additionalProperties": COUNT},
        "activation": STRING,
    }
)  # TEI's: a reranker has one label, a classifier several
INFO = named("Info", response_schema({
    "model_id": STRING, "model_dtype": STRING,
    "model_type": {"oneOf": [response_schema({"embedding": response_schema({"pooling": STRING})}),
                             response_schema({"reranker": _CLASSIFIER}), response_schema({"classifier": _CLASSIFIER})]},
    "task": TASK, "sparse": SPARSE, "family": STRING, "architecture": STRING,
    "normalize": BOOLEAN, "dimension": COUNT, "max_input_length": COUNT, "max_batch_tokens": COUNT,
    "max_client_batch_size": COUNT, "prompts": {"type": "object", "additionalProperties": STRING},
    "default_prompt_name": nullable(STRING), "replicas": COUNT, "version": STRING,
    "model_sha": ALWAYS_NULL, "served_model_name": STRING, "max_concurrent_requests": COUNT,
    "max_batch_requests": ALWAYS_NULL, "auto_truncate": BOOLEAN, "tokenization_workers": COUNT,
    "sha": ALWAYS_NULL, "docker_label": ALWAYS_NULL,
}))  # fmt: skip
HEALTH = named("Health", response_schema({
    "status": {"type": "string", "enum": ["ok"]}, "unix": {**NUMBER, "description": "Infinity's: the server's clock"}
}))  # fmt: skip
