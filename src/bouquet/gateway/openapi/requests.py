"""The request bodies: each route's fields, as its parser reads them."""

from __future__ import annotations

from typing import Any

from bouquet.gateway.api.fields import ENCODING_FORMATS
from bouquet.gateway.openapi.pieces import (
    BOOLEAN,
    DIMENSIONS,
    EMBED_DTYPE,
    ENDIANNESS_FIELD,
    INPUT,
    INTEGER,
    LONG_INPUT,
    MODEL,
    PROMPT_NAME,
    STRING,
    TEI_ENCODING_FORMATS,
    TEXT,
    TEXTS,
    TRUNCATION_DIRECTION,
    Schema,
    any_case,
    array_of,
    encoding_format_schema,
    json_object,
    named,
    nullable,
)

# Request bodies: each route's fields, as its parser reads them

OPENAI_EMBEDDINGS_FIELDS: dict[str, Schema] = {
    "input": INPUT,
    "model": MODEL,
    "encoding_format": encoding_format_schema(ENCODING_FORMATS),
    "dimensions": DIMENSIONS,
    "user": nullable(STRING),
    "normalize": nullable({**BOOLEAN, "description": "vLLM's; default: as the model's Normalize module says"}),
    "truncate_prompt_tokens": nullable(
        {
            "type": "integer",
            "minimum": -1,
            "not": {"enum": [0]},
            "description": "vLLM's: the first k tokens, specials kept; -1: the model's limit; over the limit: 400",
        }
    ),
    "add_special_tokens": nullable({**BOOLEAN, "enum": [True], "description": "vLLM's; only true is done here"}),
    "embed_dtype": EMBED_DTYPE,
    "endianness": ENDIANNESS_FIELD,
    "use_activation": nullable(
        {**BOOLEAN, "description": "vLLM's newer name for normalize; given both, they must agree (else 400)"}
    ),
    "priority": nullable({**INTEGER, "description": "vLLM's hint; requests are served first come here"}),
    "request_id": nullable(STRING),
    "modality": nullable({"type": "string", "enum": ["text"], "description": "Infinity's"}),
    "long_input": LONG_INPUT,
}
TEI_EMBED_FIELDS: dict[str, Schema] = {
    "inputs": INPUT,
    "normalize": nullable({**BOOLEAN, "description": "default: as the model's Normalize module says"}),
    "truncate": nullable({**BOOLEAN, "default": True, "description": "false: an over-long input is a 413"}),
    "truncation_direction": TRUNCATION_DIRECTION,
    "prompt_name": PROMPT_NAME,
    "dimensions": DIMENSIONS,
    "model": MODEL,
    "encoding_format": encoding_format_schema(TEI_ENCODING_FORMATS),
    "embed_dtype": EMBED_DTYPE,
    "endianness": ENDIANNESS_FIELD,
    "long_input": LONG_INPUT,
}
EMBED_ALL_FIELDS: dict[str, Schema] = {
    name: TEI_EMBED_FIELDS[name] for name in ("inputs", "truncate", "truncation_direction", "prompt_name", "model")
}
EMBED_SPARSE_FIELDS: dict[str, Schema] = {
    name: TEI_EMBED_FIELDS[name] for name in ("inputs", "truncate", "truncation_direction", "prompt_name", "model")
}
SIMILARITY_PARAMETERS: dict[str, Schema] = {
    name: TEI_EMBED_FIELDS[name] for name in ("truncate", "truncation_direction", "prompt_name")
}
SIMILARITY_FIELDS: dict[str, Schema] = {
    "inputs": json_object(
        {"source_sentence": TEXT, "sentences": array_of(TEXT, 1)}, ("source_sentence", "sentences"), closed=False
    ),
    "parameters": nullable(json_object(SIMILARITY_PARAMETERS)),
    "model": MODEL,
}
CONTEXTUAL_FIELDS: dict[str, Schema] = {
    "input": array_of(
        array_of(TEXT, 1), 1, description="documents, each a list of its chunks in order (docs/contextual.md)"
    ),
    "model": MODEL,
    "dimensions": DIMENSIONS,
    "encoding_format": encoding_format_schema(ENCODING_FORMATS),
    "embed_dtype": EMBED_DTYPE,
    "endianness": ENDIANNESS_FIELD,
}
TEI_TOKENIZE_FIELDS: dict[str, Schema] = {
    "inputs": TEXTS,
    "add_special_tokens": {**BOOLEAN, "default": True},
    "prompt_name": PROMPT_NAME,
    "model": MODEL,
}
VLLM_DETOKENIZE_FIELDS: dict[str, Schema] = {
    "tokens": array_of(INTEGER, description="token ids; one outside the vocabulary is a 400"),
    "model": MODEL,
}
VLLM_TOKENIZE_FIELDS: dict[str, Schema] = {
    "prompt": TEXT,
    "model": MODEL,
    "add_special_tokens": nullable({**BOOLEAN, "default": True}),
    "return_token_strs": nullable({**BOOLEAN, "default": False}),
}
DECODE_FIELDS: dict[str, Schema] = {
    "ids": {
        "anyOf": [array_of(INTEGER), array_of(array_of(INTEGER), 1)],
        "description": "one sequence, or a list of them",
    },
    "skip_special_tokens": nullable({**BOOLEAN, "default": True}),
    "model": MODEL,
}
TEI_RERANK_FIELDS: dict[str, Schema] = {
    "query": TEXT,
    "texts": array_of(TEXT, 1),
    "model": MODEL,
    "raw_scores": nullable({**BOOLEAN, "default": False, "description": "the logits, no activation"}),
    "return_text": nullable({**BOOLEAN, "default": False}),
    "truncate": nullable({**BOOLEAN, "default": True}),
    "truncation_direction": nullable(
        {**any_case(("right",), empty=True), "description": "right only: a pair's longer part is cut from its end"}
    ),
}
INSTRUCTION = nullable({**TEXT, "description": "a decoder reranker's instruction (Qwen3-Reranker); refused by others"})
TEI_RERANK_FIELDS["instruction"] = INSTRUCTION
# vLLM's `activation` (older) and `use_activation`: false for the logits (TEI's raw_scores); given both, they agree
ACTIVATION_FIELDS: dict[str, Schema] = {
    name: nullable({**BOOLEAN, "default": True, "description": "vLLM's: false for the logits, no activation"})
    for name in ("activation", "use_activation")
}
COHERE_RERANK_FIELDS: dict[str, Schema] = {
    "query": TEXT,
    "documents": array_of({"anyOf": [TEXT, json_object({"text": TEXT}, ("text",), closed=False)]}, 1),
    "model": MODEL,
    "top_n": nullable({"type": "integer", "minimum": 1, "description": "default: every document"}),
    "return_documents": nullable({**BOOLEAN, "default": True}),
    "instruction": INSTRUCTION,
    **ACTIVATION_FIELDS,
}
_COHERE_TEXTS = array_of(TEXT, 1)
COHERE_V2_EMBED_FIELDS: dict[str, Schema] = {
    "model": MODEL,
    "texts": {**_COHERE_TEXTS, "description": "the texts (or `inputs`)"},
    "inputs": array_of(
        json_object(
            {
                "content": array_of(
                    json_object({"type": {"type": "string", "enum": ["text"]}, "text": STRING}, ("type", "text")), 1
                )
            },
            ("content",),
        ),
        1,
        description="each input's text content, joined (images are refused)",
    ),
    "images": nullable({**array_of(STRING), "maxItems": 0, "description": "refused unless empty: no image model"}),
    "input_type": nullable(
        {
            "type": "string",
            "enum": ["search_query", "search_document", "classification", "clustering"],
            "description": "the model's prompt of that role (query, document / passage, ...)",
        }
    ),
    "embedding_types": nullable(
        array_of(
            {"type": "string", "enum": ["float", "int8", "uint8", "binary", "ubinary", "base64"]},
            1,
            description="default: float",
        )
    ),
    "output_dimension": nullable({"type": "integer", "minimum": 1}),
    "max_tokens": nullable({"type": "integer", "minimum": 1, "description": "keep each input's first N tokens"}),
    "truncate": nullable({"type": "string", "enum": ["NONE", "START", "END"], "default": "END"}),
    "priority": {"nullable": True, "enum": [None], "description": "refused: first come, first served"},
}
COHERE_V2_RERANK_FIELDS: dict[str, Schema] = {
    "model": MODEL,
    "query": TEXT,
    "documents": array_of(TEXT, 1),
    "top_n": nullable({"type": "integer", "minimum": 1, "description": "default: every document"}),
    "max_tokens_per_doc": {"nullable": True, "enum": [None], "description": "refused: pairs are cut to the limit"},
    "priority": {"nullable": True, "enum": [None], "description": "refused: first come, first served"},
}
SCORE_FIELDS: dict[str, Schema] = {
    "text_1": {**TEXTS, "description": "one text scored against each text_2, or as many as text_2, pair by pair"},
    "text_2": TEXTS,
    "model": MODEL,
    "truncate": nullable({**BOOLEAN, "default": True}),
    "instruction": INSTRUCTION,
    **ACTIVATION_FIELDS,
}
_PAIR = array_of(TEXT, 1, maxItems=2)
_PREDICT_INPUT = {"anyOf": [TEXT, _PAIR]}
PREDICT_FIELDS: dict[str, Schema] = {
    "inputs": {"anyOf": [_PREDICT_INPUT, array_of(_PAIR, 1)],
               "description": "a text, [text], [first, second] (a pair), or a batch of [text] / [first, second]"},
    "truncate": nullable({**BOOLEAN, "default": True}),
    "truncation_direction": nullable({**any_case(("right", "left"), empty=True), "description": "left: texts only"}),
    "raw_scores": nullable({**BOOLEAN, "default": False, "description": "the logits, no activation"}),
    "model": MODEL,
    "instruction": INSTRUCTION,
}  # fmt: skip
# vLLM's newer names for /score's two sides: each side is given by exactly one of its names (else 400)
SCORE_SIDES: dict[str, tuple[str, ...]] = {
    "text_1": ("text_1", "queries", "data_1"),
    "text_2": ("text_2", "documents", "items", "data_2"),
}
for _side, _names in SCORE_SIDES.items():
    SCORE_FIELDS.update({alias: {**SCORE_FIELDS[_side], "description": f"vLLM's: {_side}"} for alias in _names[1:]})

_STRICT = (
    "Other fields are refused by name (400 unsupported_parameter; 422 on TEI's routes) unless the server runs with "
    "--allow-unknown-fields."
)


def _request(
    fields: dict[str, Schema],
    required: tuple[str, ...],
    closed: bool = True,
    description: str | None = None,
    **more: Any,
) -> Schema:
    return json_object(fields, required, closed, **({"description": description} if description else {}), **more)


OPENAI_EMBEDDINGS_REQUEST = named(
    "EmbeddingsRequest", _request(OPENAI_EMBEDDINGS_FIELDS, ("input",), description=_STRICT)
)
TEI_EMBED_REQUEST = named("TEIEmbedRequest", _request(TEI_EMBED_FIELDS, ("inputs",), description=_STRICT))
SIMILARITY_REQUEST = named("SimilarityRequest", _request(SIMILARITY_FIELDS, ("inputs",)))
TEI_ROOT_REQUEST: Schema = {
    "description": "an embedding request, or (`inputs` an object) a similarity request, as the Hugging Face "
    "Inference API takes both at one URL",
    "oneOf": [TEI_EMBED_REQUEST, SIMILARITY_REQUEST],
}
EMBED_SPARSE_REQUEST = named("EmbedSparseRequest", _request(EMBED_SPARSE_FIELDS, ("inputs",), description=_STRICT))
EMBED_ALL_REQUEST = named("EmbedAllRequest", _request(EMBED_ALL_FIELDS, ("inputs",), description=_STRICT))
CONTEXTUAL_REQUEST = named(
    "ContextualizedEmbeddingsRequest", _request(CONTEXTUAL_FIELDS, ("input",), description=_STRICT)
)
TOKENIZE_REQUEST: Schema = {
    "description": "TEI's body (`inputs`; TEI's errors), or vLLM's (`prompt` and no `inputs`; OpenAI's errors)",
    "anyOf": [
        named("TEITokenizeRequest", _request(TEI_TOKENIZE_FIELDS, ("inputs",), description=_STRICT)),
        named("VLLMTokenizeRequest", _request(VLLM_TOKENIZE_FIELDS, ("prompt",))),
    ],
}
DECODE_REQUEST = named("DecodeRequest", _request(DECODE_FIELDS, ("ids",)))
PREDICT_REQUEST = named("PredictRequest", _request(PREDICT_FIELDS, ("inputs",)))
DETOKENIZE_REQUEST = named("DetokenizeRequest", _request(VLLM_DETOKENIZE_FIELDS, ("tokens",)))
TEI_RERANK_REQUEST = named("TEIRerankRequest", _request(TEI_RERANK_FIELDS, ("query", "texts")))
COHERE_RERANK_REQUEST = named("CohereRerankRequest", _request(COHERE_RERANK_FIELDS, ("query", "documents")))
COHERE_V2_EMBED_REQUEST = named("CohereV2EmbedRequest", _request(
    COHERE_V2_EMBED_FIELDS, (), description="exactly one of texts and inputs",
    oneOf=[{"required": ["texts"]}, {"required": ["inputs"]}],
))  # fmt: skip
COHERE_V2_RERANK_REQUEST = named("CohereV2RerankRequest", _request(COHERE_V2_RERANK_FIELDS, ("query", "documents")))
RERANK_REQUEST: Schema = {
    "description": "TEI's body (`texts`; TEI's answer and errors), or Cohere's and Jina's (`documents`; theirs)",
    "oneOf": [TEI_RERANK_REQUEST, COHERE_RERANK_REQUEST],
}
SCORE_REQUEST = named("ScoreRequest", _request(
    SCORE_FIELDS, (), description="each side by exactly one of its names: text_1, queries or data_1; text_2, "
    "documents, items or data_2",
    allOf=[{"oneOf": [{"required": [name]} for name in names]} for names in SCORE_SIDES.values()],
))  # fmt: skip
