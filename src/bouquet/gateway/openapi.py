"""The OpenAPI 3.0.3 description of the gateway's routes, written out as data (the routes check their bodies by
hand), and the interactive docs page that renders it, with Swagger UI's files served by the gateway itself.

It states what the parsers take and what the handlers answer: each request field a route reads, with `nullable`
where null counts as left out and every spelling the parser accepts (TEI's "Right"); each route's 200 body; and
only the error statuses that route can answer, in its error shape (TEI's on TEI's routes). 3.0.3 rather than 3.1:
the bundled Swagger UI (4.15) renders no 3.1 document. tests/test_openapi.py validates the document, matches it
to the app's routes and parsers, and runs schemathesis against a real server with it.

To document a new value or field: an `encoding_format` is one entry in ROW_ENCODINGS (how its rows are answered;
the accepted names come from the parser), a request field one entry in its route's `*_FIELDS` table, a route one
`Operation` in OPERATIONS."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from swagger_ui_bundle import swagger_ui_path

from bouquet.encodings import EMBED_DTYPES, ENDIANNESS
from bouquet.gateway import errors
from bouquet.gateway.schemas import ENCODING_FORMATS, LONG_INPUTS
from bouquet.tokenizer import TRUNCATION_DIRECTIONS

Schema = dict[str, Any]

# Swagger UI's own files, from the swagger-ui-bundle package and served by the gateway under /docs/: the machines
# it runs on may have no internet, so the page loads nothing from a CDN. Only these names are served.
DOCS_ASSETS = {"swagger-ui.css": "text/css", "swagger-ui-bundle.js": "text/javascript"}
DOCS_HTML = """<!doctype html>
<html><head><title>bouquet API</title><meta charset="utf-8">
<link rel="stylesheet" href="/docs/swagger-ui.css"></head>
<body><div id="ui"></div>
<script src="/docs/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui"});</script>
</body></html>
"""

# JSON pieces


def nullable(schema: Schema) -> Schema:
    """`schema`, or null (the parser reads null as the field left out); an enum lists null too, as OpenAPI 3.0.3
    asks for an enum that is nullable."""
    schema = copy.deepcopy(schema)
    schema["nullable"] = True
    if "enum" in schema and None not in schema["enum"]:
        schema["enum"].append(None)
    return schema


def _any_case(words: tuple[str, ...], empty: bool = False) -> Schema:
    """A string the parser lower-cases before it compares (TEI spells "Right"; any case is taken), or "" when the
    parser takes an empty string as left out."""
    spelled = "|".join("".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in word) for word in words)
    pattern = f"^({spelled}){'?' if empty else ''}$"
    return {"type": "string", "pattern": pattern, "example": words[0]}


def _object(properties: dict[str, Schema], required: tuple[str, ...] = (), closed: bool = True, **more: Any) -> Schema:
    """An object with these properties. A request object is `closed` where its parser refuses other fields by name
    (400 unsupported_parameter; 422 on TEI's routes); a response object is closed so the document lists every field."""
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    return {**schema, **more}


def _array(items: Schema, min_items: int = 0, **more: Any) -> Schema:
    return {"type": "array", "items": items, **({"minItems": min_items} if min_items else {}), **more}


def _response(properties: dict[str, Schema], **more: Any) -> Schema:
    """A response object: every field always there, no other."""
    return _object(properties, tuple(properties), **more)


# Named schemas, under components/schemas: the request and response bodies, and the error shapes.
COMPONENTS: dict[str, Schema] = {}


def _named(name: str, schema: Schema) -> Schema:
    """A reference to `schema`, kept under components/schemas as `name`."""
    assert COMPONENTS.get(name, schema) == schema, f"two schemas named {name}"
    COMPONENTS[name] = schema
    return {"$ref": f"#/components/schemas/{name}"}


STRING: Schema = {"type": "string"}
TEXT: Schema = {"type": "string", "minLength": 1}  # an empty text is 400 empty_input
BOOLEAN: Schema = {"type": "boolean"}
INTEGER: Schema = {"type": "integer"}
NUMBER: Schema = {"type": "number"}
COUNT: Schema = {"type": "integer", "minimum": 0}
ALWAYS_NULL: Schema = nullable({"type": "string", "enum": [], "description": "TEI's field; always null here"})
FLOATS: Schema = _array(NUMBER)
TOKEN_IDS: Schema = _array(INTEGER, 1)
INPUT: Schema = {
    "description": "a text, a list of texts, a list of token ids, or a list of texts and lists of token ids; "
    "never empty. Token ids are refused with --no-token-id-input (400 token_ids_refused).",
    "anyOf": [TEXT, TOKEN_IDS, _array({"anyOf": [TEXT, TOKEN_IDS]}, 1)],
}
TEXTS: Schema = {"anyOf": [TEXT, _array(TEXT, 1)]}
MODEL: Schema = nullable({**STRING, "description": "a served model's id (GET /v1/models); default: the first found"})

# How one embedding row is answered for each `encoding_format` the parser takes (schemas.ENCODING_FORMATS): one
# entry a format (docs/encodings.md defines them). tests/test_openapi.py checks that every accepted format has one.
_BASE64: Schema = {"type": "string", "format": "byte"}
_BITS = "bits packed 8 a byte, the first value in the most significant bit (sentence-transformers' quantize_embeddings)"
ROW_ENCODINGS: dict[str, Schema] = {
    "float": FLOATS,
    "base64": {**_BASE64, "description": "base64 of the row's float32 bytes (embed_dtype, endianness: little)"},
    "int8": _array({"type": "integer", "minimum": -127, "maximum": 127}, description="round(127 x / |x|)"),
    "uint8": _array({"type": "integer", "minimum": 1, "maximum": 255}, description="int8 + 128"),
    "binary": _array({"type": "integer", "minimum": -128, "maximum": 127}, description=f"{_BITS}, less 128"),
    "ubinary": _array({"type": "integer", "minimum": 0, "maximum": 255}, description=_BITS),
    "base64_int8": {**_BASE64, "description": "base64 of the int8 row's bytes"},
    "base64_binary": {**_BASE64, "description": "base64 of the row's bits, the first value in the least significant"},
}
TEI_ENCODING_FORMATS: tuple[str, ...] = ENCODING_FORMATS  # the same formats on TEI's /embed and POST /
EMBED_DTYPE: Schema = nullable(
    {"type": "string", "enum": [*EMBED_DTYPES, ""], "default": "float32", "description": "vLLM's; base64 only"}
)
ENDIANNESS_FIELD: Schema = nullable(
    {"type": "string", "enum": [*ENDIANNESS, ""], "default": "native", "description": "vLLM's; base64 only"}
)


def _encoding_format(formats: tuple[str, ...]) -> Schema:
    """The request field: one of `formats`, or null or "" for the first (the parser's `or "float"`)."""
    return nullable({"type": "string", "enum": [*formats, ""], "default": formats[0]})


def _row(formats: tuple[str, ...]) -> Schema:
    shapes = [ROW_ENCODINGS[name] for name in formats]
    return shapes[0] if len(shapes) == 1 else {"anyOf": shapes}  # an int8 row is also a list of numbers


TRUNCATION_DIRECTION: Schema = nullable(
    {**_any_case(TRUNCATION_DIRECTIONS, empty=True), "description": "right (the default) or left, in any case"}
)
DIMENSIONS: Schema = nullable(
    {"type": "integer", "minimum": 1, "description": "keep the first N values, renormalised; at most the model's width"}
)
LONG_INPUT: Schema = nullable(
    {"type": "string", "enum": list(LONG_INPUTS), "description": "chunk: embed an over-long input whole, in windows"}
)
PROMPT_NAME: Schema = nullable({**STRING, "description": "one of the model's sentence-transformers prompts"})

# Request bodies: each route's fields, as its parser reads them

OPENAI_EMBEDDINGS_FIELDS: dict[str, Schema] = {
    "input": INPUT,
    "model": MODEL,
    "encoding_format": _encoding_format(ENCODING_FORMATS),
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
    "encoding_format": _encoding_format(TEI_ENCODING_FORMATS),
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
    "inputs": _object(
        {"source_sentence": TEXT, "sentences": _array(TEXT, 1)}, ("source_sentence", "sentences"), closed=False
    ),
    "parameters": nullable(_object(SIMILARITY_PARAMETERS)),
    "model": MODEL,
}
CONTEXTUAL_FIELDS: dict[str, Schema] = {
    "input": _array(
        _array(TEXT, 1), 1, description="documents, each a list of its chunks in order (docs/contextual.md)"
    ),
    "model": MODEL,
    "dimensions": DIMENSIONS,
    "encoding_format": _encoding_format(ENCODING_FORMATS),
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
    "tokens": _array(INTEGER, description="token ids; one outside the vocabulary is a 400"),
    "model": MODEL,
}
VLLM_TOKENIZE_FIELDS: dict[str, Schema] = {
    "prompt": TEXT,
    "model": MODEL,
    "add_special_tokens": nullable({**BOOLEAN, "default": True}),
    "return_token_strs": nullable({**BOOLEAN, "default": False}),
}
DECODE_FIELDS: dict[str, Schema] = {
    "ids": {"anyOf": [_array(INTEGER), _array(_array(INTEGER), 1)], "description": "one sequence, or a list of them"},
    "skip_special_tokens": nullable({**BOOLEAN, "default": True}),
    "model": MODEL,
}
TEI_RERANK_FIELDS: dict[str, Schema] = {
    "query": TEXT,
    "texts": _array(TEXT, 1),
    "model": MODEL,
    "raw_scores": nullable({**BOOLEAN, "default": False, "description": "the logits, no activation"}),
    "return_text": nullable({**BOOLEAN, "default": False}),
    "truncate": nullable({**BOOLEAN, "default": True}),
    "truncation_direction": nullable(
        {**_any_case(("right",), empty=True), "description": "right only: a pair's longer part is cut from its end"}
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
    "documents": _array({"anyOf": [TEXT, _object({"text": TEXT}, ("text",), closed=False)]}, 1),
    "model": MODEL,
    "top_n": nullable({"type": "integer", "minimum": 1, "description": "default: every document"}),
    "return_documents": nullable({**BOOLEAN, "default": True}),
    "instruction": INSTRUCTION,
    **ACTIVATION_FIELDS,
}
_COHERE_TEXTS = _array(TEXT, 1)
COHERE_V2_EMBED_FIELDS: dict[str, Schema] = {
    "model": MODEL,
    "texts": {**_COHERE_TEXTS, "description": "the texts (or `inputs`)"},
    "inputs": _array(
        _object(
            {
                "content": _array(
                    _object({"type": {"type": "string", "enum": ["text"]}, "text": STRING}, ("type", "text")), 1
                )
            },
            ("content",),
        ),
        1,
        description="each input's text content, joined (images are refused)",
    ),
    "images": nullable({**_array(STRING), "maxItems": 0, "description": "refused unless empty: no image model"}),
    "input_type": nullable(
        {
            "type": "string",
            "enum": ["search_query", "search_document", "classification", "clustering"],
            "description": "the model's prompt of that role (query, document / passage, ...)",
        }
    ),
    "embedding_types": nullable(
        _array(
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
    "documents": _array(TEXT, 1),
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
_PAIR = _array(TEXT, 1, maxItems=2)
_PREDICT_INPUT = {"anyOf": [TEXT, _PAIR]}
PREDICT_FIELDS: dict[str, Schema] = {
    "inputs": {"anyOf": [_PREDICT_INPUT, _array(_PAIR, 1)],
               "description": "a text, [text], [first, second] (a pair), or a batch of [text] / [first, second]"},
    "truncate": nullable({**BOOLEAN, "default": True}),
    "truncation_direction": nullable({**_any_case(("right", "left"), empty=True), "description": "left: texts only"}),
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
    return _object(fields, required, closed, **({"description": description} if description else {}), **more)


OPENAI_EMBEDDINGS_REQUEST = _named(
    "EmbeddingsRequest", _request(OPENAI_EMBEDDINGS_FIELDS, ("input",), description=_STRICT)
)
TEI_EMBED_REQUEST = _named("TEIEmbedRequest", _request(TEI_EMBED_FIELDS, ("inputs",), description=_STRICT))
SIMILARITY_REQUEST = _named("SimilarityRequest", _request(SIMILARITY_FIELDS, ("inputs",)))
TEI_ROOT_REQUEST: Schema = {
    "description": "an embedding request, or (`inputs` an object) a similarity request, as the Hugging Face "
    "Inference API takes both at one URL",
    "oneOf": [TEI_EMBED_REQUEST, SIMILARITY_REQUEST],
}
EMBED_SPARSE_REQUEST = _named("EmbedSparseRequest", _request(EMBED_SPARSE_FIELDS, ("inputs",), description=_STRICT))
EMBED_ALL_REQUEST = _named("EmbedAllRequest", _request(EMBED_ALL_FIELDS, ("inputs",), description=_STRICT))
CONTEXTUAL_REQUEST = _named(
    "ContextualizedEmbeddingsRequest", _request(CONTEXTUAL_FIELDS, ("input",), description=_STRICT)
)
TOKENIZE_REQUEST: Schema = {
    "description": "TEI's body (`inputs`; TEI's errors), or vLLM's (`prompt` and no `inputs`; OpenAI's errors)",
    "anyOf": [
        _named("TEITokenizeRequest", _request(TEI_TOKENIZE_FIELDS, ("inputs",), description=_STRICT)),
        _named("VLLMTokenizeRequest", _request(VLLM_TOKENIZE_FIELDS, ("prompt",))),
    ],
}
DECODE_REQUEST = _named("DecodeRequest", _request(DECODE_FIELDS, ("ids",)))
PREDICT_REQUEST = _named("PredictRequest", _request(PREDICT_FIELDS, ("inputs",)))
DETOKENIZE_REQUEST = _named("DetokenizeRequest", _request(VLLM_DETOKENIZE_FIELDS, ("tokens",)))
TEI_RERANK_REQUEST = _named("TEIRerankRequest", _request(TEI_RERANK_FIELDS, ("query", "texts")))
COHERE_RERANK_REQUEST = _named("CohereRerankRequest", _request(COHERE_RERANK_FIELDS, ("query", "documents")))
COHERE_V2_EMBED_REQUEST = _named("CohereV2EmbedRequest", _request(
    COHERE_V2_EMBED_FIELDS, (), description="exactly one of texts and inputs",
    oneOf=[{"required": ["texts"]}, {"required": ["inputs"]}],
))  # fmt: skip
COHERE_V2_RERANK_REQUEST = _named("CohereV2RerankRequest", _request(COHERE_V2_RERANK_FIELDS, ("query", "documents")))
RERANK_REQUEST: Schema = {
    "description": "TEI's body (`texts`; TEI's answer and errors), or Cohere's and Jina's (`documents`; theirs)",
    "oneOf": [TEI_RERANK_REQUEST, COHERE_RERANK_REQUEST],
}
SCORE_REQUEST = _named("ScoreRequest", _request(
    SCORE_FIELDS, (), description="each side by exactly one of its names: text_1, queries or data_1; text_2, "
    "documents, items or data_2",
    allOf=[{"oneOf": [{"required": [name]} for name in names]} for names in SCORE_SIDES.values()],
))  # fmt: skip

# Response bodies: what the handlers in app.py, rerank.py, text_tools.py and contextual.py answer

USAGE = _named("Usage", _response({"prompt_tokens": COUNT, "total_tokens": COUNT}))


def _embeddings(formats: tuple[str, ...]) -> Schema:
    embedding = {"object": {"type": "string", "enum": ["embedding"]}, "index": COUNT, "embedding": _row(formats)}
    return _array(_response(embedding), description="one per input, in order")


OPENAI_EMBEDDINGS = _named("EmbeddingList", _response({
    "id": {**STRING, "description": "vLLM's and Infinity's: embd-..."}, "created": {**COUNT, "description": "unix"},
    "object": {"type": "string", "enum": ["list"]}, "data": _embeddings(ENCODING_FORMATS), "model": STRING,
    "usage": _named("EmbeddingUsage", _response(
        {"prompt_tokens": COUNT, "total_tokens": COUNT, "completion_tokens": {"type": "integer", "enum": [0]}}
    )),
}))  # fmt: skip
CONTEXTUAL = _named("ContextualizedEmbeddingList", _response({
    "object": {"type": "string", "enum": ["list"]},
    "data": _array(_response({
        "object": {"type": "string", "enum": ["list"]}, "index": COUNT, "data": _embeddings(ENCODING_FORMATS)
    }), description="one per document, its chunks in order"),
    "model": STRING,
    "usage": USAGE,
}))  # fmt: skip
TEI_ROWS = _named("TEIEmbeddings", _array(_row(TEI_ENCODING_FORMATS), description="one row per input, in order"))
SIMILARITIES = _named(
    "Similarities", _array(NUMBER, description="the cosine of source_sentence with each sentence, in order")
)
TOKEN_STATES = _named(
    "TokenStates", _array(_array(FLOATS), description="per input, every token's last hidden state, special tokens too")
)
SPARSE_ROWS = _named("SparseRows", _array(
    _array(_response({"index": {**COUNT, "description": "a vocabulary id"}, "value": NUMBER}),
           description="an input's nonzero weights, by ascending index"),
    description="one per input, in order",
))  # fmt: skip
TEI_TOKENS = _named("TEITokens", _array(
    _array(
        _response({
            "id": COUNT, "text": STRING, "special": BOOLEAN,
            "start": nullable({**COUNT, "description": "null for a special token"}), "stop": nullable(COUNT),
        })
    ),
    description="per input, its tokens with their character spans",
))  # fmt: skip
VLLM_TOKENS = _named("VLLMTokens", _response({
    "count": COUNT, "max_model_len": COUNT, "tokens": _array(COUNT),
    "token_strs": nullable(
        {**_array(nullable(STRING)), "description": "the vocabulary's token strings; null unless return_token_strs"}
    ),
}))  # fmt: skip
DECODED = _named("Decoded", _array(STRING))
_PREDICTIONS = _array(_object({"score": NUMBER, "label": STRING}, ("score", "label")), 1)
PREDICTIONS = _named(
    "Predictions", {"anyOf": [_PREDICTIONS, _array(_PREDICTIONS)], "description": "every label, best first"}
)
DETOKENIZED = _named("Detokenized", _response({"prompt": STRING}))
TEI_RANKING = _named(
    "TEIRanking",
    _array(
        _object({"index": COUNT, "score": NUMBER, "text": STRING}, ("index", "score")),
        description="every text, best first; `text` with return_text",
    ),
)
COHERE_RANKING = _named("CohereRanking", _response({
    "id": STRING,
    "model": STRING,
    "results": _array(
        _object({"index": COUNT, "relevance_score": NUMBER, "document": _response({"text": STRING})},
                ("index", "relevance_score"))
    ),
    "usage": USAGE,
}))  # fmt: skip
_COHERE_META = _named("CohereMeta", _response({
    "api_version": _response({"version": {"type": "string", "enum": ["2"]}}),
    "billed_units": _object({"input_tokens": COUNT, "search_units": COUNT}),
}))  # fmt: skip
_INTEGERS = _array(_array(INTEGER))
COHERE_V2_EMBEDDINGS = _named("CohereV2Embeddings", _response({
    "id": STRING,
    "embeddings": _object({"float": _array(_array(NUMBER)), "int8": _INTEGERS, "uint8": _INTEGERS,
                           "binary": _INTEGERS, "ubinary": _INTEGERS, "base64": _array(STRING)},
                          description="the types asked for (embedding_types)"),
    "texts": _array(STRING),
    "meta": _COHERE_META,
    "response_type": {"type": "string", "enum": ["embeddings_by_type"]},
}))  # fmt: skip
COHERE_V2_RANKING = _named("CohereV2Ranking", _response({
    "id": STRING,
    "results": _array(_response({"index": COUNT, "relevance_score": NUMBER})),
    "meta": _COHERE_META,
}))  # fmt: skip
SCORES = _named("Scores", _response({
    "id": STRING, "object": {"type": "string", "enum": ["list"]}, "created": COUNT, "model": STRING,
    "data": _array(_response({"index": COUNT, "object": {"type": "string", "enum": ["score"]}, "score": NUMBER})),
    "usage": USAGE,
}))  # fmt: skip
TASK: Schema = {"type": "string", "enum": ["embed", "score", "sparse"], "description": "sparse: a SPLADE model"}
SPARSE: Schema = {**BOOLEAN, "description": "whether /embed_sparse serves it (SPLADE, or bge-m3's sparse head)"}
MODEL_CARD = _named("Model", _response({
    "id": STRING, "object": {"type": "string", "enum": ["model"]}, "created": INTEGER, "owned_by": STRING,
    "root": {**STRING, "description": "the model's own name; id is one of its --served-model-name where given"},
    "family": STRING, "task": TASK, "sparse": SPARSE, "architecture": STRING,
    "pooling": STRING, "normalize": BOOLEAN, "dimension": COUNT, "max_input_length": COUNT, "dtype": STRING,
    "replicas": {**COUNT, "description": "healthy replicas serving it"},
    "stats": _response({"healthy_replicas": COUNT, "max_batch_tokens": COUNT}, description="Infinity's"),
}))  # fmt: skip
MODELS = _named("ModelList", _response({"object": {"type": "string", "enum": ["list"]}, "data": _array(MODEL_CARD)}))
_CLASSIFIER = _response(
    {
        "id2label": {"type": "object", "additionalProperties": STRING},
        "label2id": {"type": "object", "additionalProperties": COUNT},
        "activation": STRING,
    }
)  # TEI's: a reranker has one label, a classifier several
INFO = _named("Info", _response({
    "model_id": STRING, "model_dtype": STRING,
    "model_type": {"oneOf": [_response({"embedding": _response({"pooling": STRING})}),
                             _response({"reranker": _CLASSIFIER}), _response({"classifier": _CLASSIFIER})]},
    "task": TASK, "sparse": SPARSE, "family": STRING, "architecture": STRING,
    "normalize": BOOLEAN, "dimension": COUNT, "max_input_length": COUNT, "max_batch_tokens": COUNT,
    "max_client_batch_size": COUNT, "prompts": {"type": "object", "additionalProperties": STRING},
    "default_prompt_name": nullable(STRING), "replicas": COUNT, "version": STRING,
    "model_sha": ALWAYS_NULL, "served_model_name": STRING, "max_concurrent_requests": COUNT,
    "max_batch_requests": ALWAYS_NULL, "auto_truncate": BOOLEAN, "tokenization_workers": COUNT,
    "sha": ALWAYS_NULL, "docker_label": ALWAYS_NULL,
}))  # fmt: skip
HEALTH = _named("Health", _response({
    "status": {"type": "string", "enum": ["ok"]}, "unix": {**NUMBER, "description": "Infinity's: the server's clock"}
}))  # fmt: skip

# Errors


def _error_classes() -> list[type[errors.ApiError]]:
    found, stack = [], [errors.ApiError]
    while stack:
        cls = stack.pop()
        found.append(cls)
        stack.extend(cls.__subclasses__())
    return found


# OpenAI's `error.type` for each status, as errors.py's classes give it.
OPENAI_ERROR_TYPES: dict[int, set[str]] = {}
for _cls in _error_classes():
    OPENAI_ERROR_TYPES.setdefault(_cls.status, set()).add(_cls.type)
OPENAI_ERROR_TYPES.setdefault(405, set()).add(errors.InvalidRequest.type)  # app._not_found's 405
# TEI's `error_type` for each status on TEI's routes, as errors.tei_error maps them.
TEI_ERROR_TYPES: dict[int, tuple[str, ...]] = {
    400: ("Empty", "Validation"), 401: ("authentication_error",), 404: ("invalid_request_error",),
    408: ("invalid_request_error",), 413: ("Validation",), 415: ("invalid_request_error",), 422: ("Validation",),
    424: ("Backend",), 429: ("Overloaded",), 503: ("Unhealthy",),
}  # fmt: skip


def openai_error(status: int) -> Schema:
    return _named(f"OpenAIError{status}", _response({
        "error": _response({
            "message": STRING, "type": {"type": "string", "enum": sorted(OPENAI_ERROR_TYPES[status])},
            "param": nullable({**STRING, "description": "the field at fault"}),
            "code": {**STRING, "description": "what went wrong: invalid_json, empty_input, model_not_found, ..."},
        })
    }))  # fmt: skip


def tei_error(status: int) -> Schema:
    error_type = {"type": "string", "enum": list(TEI_ERROR_TYPES[status])}
    return _named(f"TEIError{status}", _response({"error": STRING, "error_type": error_type}))


STATUS_TEXT = {
    400: "invalid input: unreadable JSON, an empty input, an invalid value, a field the route does not take",
    401: "no valid API key (`Authorization: Bearer KEY`), where the server runs with --api-key",
    404: "no such model",
    408: "the headers or the body stopped arriving (then the connection closes)",
    413: "over a limit: body bytes, inputs, tokens, or an over-long input with truncate=false",
    415: "a Content-Encoding other than gzip",
    422: "a body or field of the wrong type",
    424: "the model cannot do this (a reranker asked to embed, or the reverse), or the replicas failed",
    429: "over capacity; retry after Retry-After",
    431: "the request line and headers are over the limit (then the connection closes)",
    503: "no healthy replica serves the model, or every connection is busy (with Retry-After)",
}
# What else TEI's mapping (errors.tei_error) answers with a status, on TEI's routes.
_TEI_ANSWERED = {
    400: "error_type Empty for an empty input, Validation for unreadable JSON",
    413: "also TEI's validation errors: a bad dimensions, prompt_name, token id or truncation_direction",
    422: "also a missing field, or one the route does not take",
}

# Error statuses by cause. Every route: the connection's own answers (http_protocol.py, OpenAI-shaped): 408 headers
# too slow, 431 headers too large, 503 every connection busy.
CONNECTION = frozenset({408, 431, 503})
BODY = frozenset({400, 408, 413, 415, 422})  # Gateway.read_json and the route's parser
MODEL_LOOKUP = frozenset({404, 503})  # ModelCatalog.get: unknown model; no replica has reported yet
WORK = frozenset({429})  # max_concurrent_requests, and admission for those that compute
COMPUTE = BODY | MODEL_LOOKUP | WORK  # a body read, a model found, rows computed
TEI_COMPUTE = COMPUTE | {424}  # TEI's status for a model of the wrong task or a failed replica


@dataclass(frozen=True)
class Operation:
    """One route and method: its request, its 200 answer, and the error statuses it can answer."""

    path: str
    method: str
    summary: str
    tag: str
    ok: dict[str, Schema]  # media type -> the 200 body
    request: Schema | None = None
    statuses: frozenset[int] = frozenset()  # besides CONNECTION, and 401 where the key applies
    errors: str = "openai"  # "openai", "tei", "both" (/rerank and /tokenize: by the body), or "cohere"
    public: bool = False  # no API key asked (TEI keeps these open)
    parameters: tuple[Schema, ...] = ()

    def error_statuses(self) -> list[int]:
        return sorted(self.statuses | CONNECTION | (set() if self.public else {401}))


def _json(schema: Schema) -> dict[str, Schema]:
    return {"application/json": schema}


_MODEL_PATH = {
    "name": "model", "in": "path", "required": True, "schema": STRING, "example": "all-MiniLM-L6-v2",
    "description": "a model's id (its names may hold a slash: sentence-transformers/all-MiniLM-L6-v2)",
}  # fmt: skip
_MODEL_QUERY = {"name": "model", "in": "query", "required": False, "schema": STRING, "description": "default: first"}
_ASSET_PATH = {"name": "asset", "in": "path", "required": True, "schema": {"type": "string", "enum": list(DOCS_ASSETS)}}

OPERATIONS: tuple[Operation, ...] = (
    # OpenAI's, and Infinity's without the /v1 prefix
    *(
        Operation(path, "post", "OpenAI / Infinity: embed texts or token ids", "OpenAI", _json(OPENAI_EMBEDDINGS),
                  OPENAI_EMBEDDINGS_REQUEST, COMPUTE)
        for path in ("/v1/embeddings", "/embeddings")
    ),
    *(Operation(path, "get", "OpenAI / Infinity: the served models", "OpenAI", _json(MODELS)) for path in
      ("/v1/models", "/models")),
    Operation("/v1/models/{model}", "get", "OpenAI: one served model", "OpenAI", _json(MODEL_CARD),
              statuses=MODEL_LOOKUP, parameters=(_MODEL_PATH,)),
    # text-embeddings-inference's, with its error bodies
    Operation("/", "post", "TEI / Hugging Face Inference API: embed, or similarities", "TEI",
              _json({"oneOf": [TEI_ROWS, SIMILARITIES]}), TEI_ROOT_REQUEST, TEI_COMPUTE, "tei"),
    Operation("/embed", "post", "TEI: embed texts or token ids", "TEI", _json(TEI_ROWS), TEI_EMBED_REQUEST,
              TEI_COMPUTE, "tei"),
    Operation("/embed_sparse", "post", "TEI: each input's sparse row (SPLADE, bge-m3's sparse head)", "TEI",
              _json(SPARSE_ROWS), EMBED_SPARSE_REQUEST, TEI_COMPUTE, "tei"),
    Operation("/embed_all", "post", "TEI: every token's state, no pooling", "TEI", _json(TOKEN_STATES),
              EMBED_ALL_REQUEST, TEI_COMPUTE, "tei"),
    Operation("/similarity", "post", "TEI: cosine of a sentence with others", "TEI", _json(SIMILARITIES),
              SIMILARITY_REQUEST, TEI_COMPUTE, "tei"),
    Operation("/rerank", "post", "TEI (texts) or Cohere / Jina (documents): rerank with a cross-encoder", "Rerank",
              _json({"oneOf": [TEI_RANKING, COHERE_RANKING]}), RERANK_REQUEST, TEI_COMPUTE, "both"),
    Operation("/tokenize", "post", "TEI (inputs) or vLLM (prompt): tokens", "TEI",
              _json({"oneOf": [TEI_TOKENS, VLLM_TOKENS]}), TOKENIZE_REQUEST, COMPUTE, "both"),
    Operation("/decode", "post", "TEI: token ids back to text", "TEI", _json(DECODED), DECODE_REQUEST, COMPUTE, "tei"),
    Operation("/predict", "post", "TEI: a classifier's or cross-encoder's labels for texts or pairs", "Rerank",
              _json(PREDICTIONS), PREDICT_REQUEST, TEI_COMPUTE, "tei"),
    Operation("/info", "get", "TEI: the model, its limits and pooling", "TEI", _json(INFO), statuses=MODEL_LOOKUP,
              errors="tei", parameters=(_MODEL_QUERY,)),
    Operation("/health", "get", "200 while a replica is healthy, else 503", "Operations", _json(HEALTH),
              statuses=frozenset({503}), errors="tei", public=True),
    *(Operation("/ping", method, "vLLM's (SageMaker's probe): /health's answer", "Operations", _json(HEALTH),
                statuses=frozenset({503}), public=True) for method in ("get", "post")),
    # Cohere's, Jina's and vLLM's
    Operation("/v1/rerank", "post", "Cohere / Jina / vLLM: rerank documents with a cross-encoder", "Rerank",
              _json(COHERE_RANKING), COHERE_RERANK_REQUEST, COMPUTE),
    *(
        Operation(path, "post", "vLLM: score pairs with a cross-encoder", "Rerank", _json(SCORES), SCORE_REQUEST,
                  COMPUTE)
        for path in ("/score", "/v1/score")
    ),
    Operation("/detokenize", "post", "vLLM: token ids back to text", "vLLM", _json(DETOKENIZED),
              DETOKENIZE_REQUEST, COMPUTE),
    # Cohere's v2, with its error body
    Operation("/v2/embed", "post", "Cohere v2: embed texts, in each embedding type asked for", "Cohere",
              _json(COHERE_V2_EMBEDDINGS), COHERE_V2_EMBED_REQUEST, COMPUTE, "cohere"),
    Operation("/v2/rerank", "post", "Cohere v2: rerank documents with a cross-encoder", "Cohere",
              _json(COHERE_V2_RANKING), COHERE_V2_RERANK_REQUEST, COMPUTE, "cohere"),
    # Perplexity's
    Operation("/v1/contextualizedembeddings", "post", "Perplexity: late-chunked chunk embeddings per document",
              "Perplexity", _json(CONTEXTUAL), CONTEXTUAL_REQUEST, COMPUTE),
    # public, as TEI keeps them
    Operation("/metrics", "get", "Prometheus metrics", "Operations", {"text/plain": STRING}, public=True),
    Operation("/openapi.json", "get", "this document", "Operations", _json({"type": "object"}), public=True),
    Operation("/docs", "get", "Swagger UI on this document", "Operations", {"text/html": STRING}, public=True),
    Operation("/docs/{asset}", "get", "Swagger UI's files, served by the gateway", "Operations",
              {"text/css": STRING, "text/javascript": STRING}, statuses=frozenset({404}), public=True,
              parameters=(_ASSET_PATH,)),
)  # fmt: skip

_HEADERS = {
    "x-request-id": {"description": "the client's, if it sent a usable one; else the gateway's", "schema": STRING},
    "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}},
    "WWW-Authenticate": {"description": 'Bearer realm="bouquet"', "schema": STRING},
}


def _header(name: str, required: bool = False) -> Schema:
    return {"$ref": f"#/components/headers/{name}"} if not required else {**_HEADERS[name], "required": True}


def _error(operation: Operation, status: int) -> Schema:
    """The status's answer: TEI's shape where a TEI route answers it itself, OpenAI's where an OpenAI route does or
    the connection does (http_protocol.py answers before any route); /rerank and /tokenize answer either, by the
    body: OpenAI's to Cohere's body (`documents`) and to vLLM's (`prompt`), once the body is read."""
    own = operation.statuses | (set() if operation.public else {401})
    shapes = []
    if operation.errors in ("tei", "both") and status in own:
        shapes.append(tei_error(status))
    if operation.errors == "cohere" and status in own:
        shapes.append(_named(f"CohereError{status}", _response({"message": STRING})))
    both = operation.errors == "both" and status in OPENAI_ERROR_TYPES
    if operation.errors == "openai" or status in CONNECTION or both:
        shapes.append(openai_error(status))
    text = STATUS_TEXT[status]
    if operation.errors in ("tei", "both") and status in _TEI_ANSWERED:
        text += f" ({_TEI_ANSWERED[status]})"
    headers = {"x-request-id": _header("x-request-id")}
    if status == 401:
        headers["WWW-Authenticate"] = _header("WWW-Authenticate", required=True)
    if status == 429:
        headers["Retry-After"] = _header("Retry-After", required=True)
    if status == 503:
        headers["Retry-After"] = _header("Retry-After")
    schema = shapes[0] if len(shapes) == 1 else {"oneOf": shapes}
    return {"description": text, "headers": headers, "content": {"application/json": {"schema": schema}}}


def _operation(operation: Operation) -> Schema:
    ok = {"description": "OK", "headers": {"x-request-id": _header("x-request-id")},
          "content": {media: {"schema": schema} for media, schema in operation.ok.items()}}  # fmt: skip
    responses = {"200": ok, **{str(status): _error(operation, status) for status in operation.error_statuses()}}
    described: Schema = {"summary": operation.summary, "tags": [operation.tag], "responses": responses}
    described["operationId"] = f"{operation.method}_{operation.path.strip('/').replace('/', '_') or 'root'}"
    described["operationId"] = described["operationId"].replace("{", "").replace("}", "").replace(".", "_")
    if operation.parameters:
        described["parameters"] = list(operation.parameters)
    if operation.request is not None:
        described["requestBody"] = {"required": True, "content": {"application/json": {"schema": operation.request}}}
    if operation.public:
        described["security"] = []
    return described


@cache
def openapi_spec() -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for operation in OPERATIONS:
        paths.setdefault(operation.path, {})[operation.method] = _operation(operation)  # names its error schemas
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "bouquet",
            "version": "0.1.0",
            "description": "OpenAI-, vLLM-, Infinity-, TEI-, Cohere- and Perplexity-compatible embeddings and "
            "reranking. Errors are OpenAI's `{error: {message, type, param, code}}`, on TEI's routes TEI's "
            "`{error, error_type}` (OpenAI's again once a Cohere-shaped /rerank or a vLLM-shaped /tokenize body is "
            "read); the connection's own answers (408, 431, 503 at the connection cap) are OpenAI's on every route. "
            "A body is read as JSON whatever its Content-Type, and may be gzip-compressed "
            "(Content-Encoding: gzip; another encoding is a 415).",
        },
        "tags": [{"name": n} for n in ("OpenAI", "TEI", "Rerank", "vLLM", "Cohere", "Perplexity", "Operations")],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "--api-key"}},
            "headers": _HEADERS,
            "schemas": dict(sorted(COMPONENTS.items())),
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }


@cache
def docs_asset(name: str) -> bytes:
    """One of DOCS_ASSETS, read once."""
    assert name in DOCS_ASSETS, f"{name!r} is not a docs asset"
    return Path(swagger_ui_path, name).read_bytes()
