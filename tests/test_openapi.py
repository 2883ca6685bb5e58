"""The OpenAPI document tells the truth: it is valid OpenAPI 3.0.3; it names every route the app registers, with
its methods, and no other; each request body's schema is generated from the struct its route decodes it into; the
error shapes are the ones errors.py writes; and schemathesis, run against the real gateway and replicas in this
process (tests/in_process.py; API key on, an embedding model, a cross-encoder and a sparse model), finds no server
error, no status, media type or body the document does not state, and no request the document calls invalid that
the server takes."""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from in_process import engines, served
from schemathesis.checks import not_a_server_error
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.routing import Route

from bouquet.config import GatewayConfig
from bouquet.engine.engine import Engine
from bouquet.gateway import errors
from bouquet.gateway.api import cohere, fields, flag_embedding, jina, kserve, openai, perplexity, tei_bodies, vllm
from bouquet.gateway.app import create_app
from bouquet.gateway.http.decode import BodyDecoder, field_names
from bouquet.gateway.openapi import document, openapi_spec, requests

API_KEY = "openapi-key"
EMBEDDER = "all-MiniLM-L6-v2"
RERANKER = "tiny-reranker"
RERANK_ROUTES = {"/rerank", "/v1/rerank", "/score", "/v1/score", "/predict", "/v2/rerank"}
SPARSE = "tiny-splade"
COLBERT = "tiny-colbert"
BGE_M3 = "tiny-bge-m3"
MODEL_OF_ROUTE = {"/embed_sparse": SPARSE, "/v1/multi-vector": COLBERT, "/encode": BGE_M3, "/compute_score": BGE_M3}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
# TEI answers a value it cannot take with 413 (its Validation error), not 400: rejected all the same.
REJECTED = ["400", "401", "404", "413", "415", "422", "424"]
CONFIG = schemathesis.Config.from_dict({"checks": {"negative_data_rejection": {"expected-statuses": REJECTED}}})
SCHEMA = schemathesis.openapi.from_dict(copy.deepcopy(openapi_spec()), config=CONFIG)
# Generated cases per operation besides schemathesis' coverage cases: 20, the same each run (derandomized), so CI
# never fails by luck; BOUQUET_OPENAPI_EXAMPLES=N explores N random ones instead (400 found nothing more).
EXAMPLES = int(os.environ.get("BOUQUET_OPENAPI_EXAMPLES", "0")) or None
ANSWERS: collections.Counter[tuple[str, int]] = collections.Counter()  # (operation, status) -> cases


def test_document_is_valid_openapi() -> None:
    from openapi_spec_validator import validate

    assert openapi_spec()["openapi"] == "3.0.3"  # the bundled Swagger UI renders no 3.1
    validate(copy.deepcopy(openapi_spec()))


def test_every_route_is_documented_and_only_those() -> None:
    asyncio.set_event_loop(asyncio.new_event_loop())  # grpc.aio channels need one; an earlier asyncio.run cleared it
    app = create_app(GatewayConfig(replicas=("127.0.0.1:1",)))
    registered = set()
    for route in app.routes:
        assert isinstance(route, Route)
        path = route.path.replace("{model:path}", "{model}")
        # Starlette answers HEAD wherever it answers GET; the document lists the GET.
        registered |= {(path, method.lower()) for method in route.methods or () if method != "HEAD"}
    documented = {(path, method) for path, item in openapi_spec()["paths"].items() for method in item}
    assert registered == documented


def test_every_request_struct_is_documented() -> None:
    """Each route decodes its body into a struct (http/decode.py) whose schema the document generates (openapi/
    structs.py): every decoder the routers hold is among the documented ones, and its component is the struct's,
    the fields of its schema the struct's fields as a client spells them."""
    modules = (cohere, flag_embedding, jina, kserve, openai, perplexity, tei_bodies, vllm)
    decoders = [value for module in modules for value in vars(module).values() if isinstance(value, BodyDecoder)]
    assert {decoder.kind for decoder in decoders} == set(requests.REQUESTS)
    schemas = openapi_spec()["components"]["schemas"]
    for kind in requests.REQUESTS:
        assert set(schemas[kind.__name__]["properties"]) == set(field_names(kind)), kind
        # unknown fields are refused by name; KServe's objects are open, as the protocol's servers ignore them
        closed = kind.__struct_config__.forbid_unknown_fields
        assert schemas[kind.__name__].get("additionalProperties", True) is not closed, kind


def test_every_encoding_format_has_its_rows_documented() -> None:
    assert set(fields.ROW_ENCODINGS) == set(fields.ENCODING_FORMATS)
    accepted = openapi_spec()["components"]["schemas"]["EmbeddingsRequest"]["properties"]["encoding_format"]["enum"]
    assert set(accepted) == {*fields.ENCODING_FORMATS, "", None}


_CODES = (
    "empty_input", "missing_required_parameter", "wrong_task", "no_healthy_replica", "timeout", "overloaded",
    "unsupported_parameter", "invalid_json", "invalid_utf8", "invalid_gzip", "invalid_value", "invalid_type",
    "invalid_token_id", "token_ids_refused", "no_tokenizer", "payload_too_large", "too_many_inputs",
    "too_many_tokens", "input_too_long", "model_not_found", "request_timeout", "unsupported_encoding",
    "invalid_api_key",
)  # fmt: skip
# Raised on no route: the connection's own answer (431), and what no client reads (499) or the document never
# promises (500).
_NOT_FROM_ROUTES = (errors.HeadersTooLarge, errors.ClientClosed, errors.InternalError)


@pytest.mark.parametrize("code", _CODES)
def test_tei_error_types_are_the_documented_ones(code: str) -> None:
    for cls in document.error_classes():
        if cls is errors.ApiError or issubclass(cls, _NOT_FROM_ROUTES):
            continue
        status, error_type = errors.tei_error(cls("message", code))
        assert error_type in document.TEI_ERROR_TYPES[status], (cls.__name__, code)
        assert cls.type in document.OPENAI_ERROR_TYPES[cls.status]


def test_errors_are_only_where_the_route_answers_them() -> None:
    paths = openapi_spec()["paths"]
    assert set(paths["/health"]["get"]["responses"]) == {"200", "408", "431", "503"}  # public, no body, no model
    assert set(paths["/metrics"]["get"]["responses"]) == {"200", "408", "431", "503"}
    assert "401" in paths["/v1/models"]["get"]["responses"] and "429" not in paths["/v1/models"]["get"]["responses"]
    assert "424" in paths["/embed"]["post"]["responses"] and "424" not in paths["/v1/embeddings"]["post"]["responses"]
    embed_400 = paths["/embed"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert embed_400 == {"$ref": "#/components/schemas/TEIError400"}


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    from test_cross_encoders import _tiny_classifier

    return _tiny_classifier("bert", tmp_path_factory.mktemp("openapi") / RERANKER, minilm_path, labels=1)


@pytest.fixture(scope="module")
def splade_dir(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    from sparse_models import build_splade

    root = tmp_path_factory.mktemp("openapi-sparse")
    return Path(shutil.move(build_splade(root, minilm_path), root / SPARSE))


@pytest.fixture(scope="module")
def colbert_dir(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    from colbert_models import build_pylate

    return build_pylate(tmp_path_factory.mktemp("openapi-colbert") / COLBERT, minilm_path)  # its name: the model's


@pytest.fixture(scope="module")
def bge_m3_dir(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    from flag_m3 import build_m3

    return build_m3(tmp_path_factory.mktemp("openapi-bge-m3"), minilm_path, BGE_M3)


@pytest.fixture(scope="module")
def server(
    reranker_dir: Path, splade_dir: Path, colbert_dir: Path, bge_m3_dir: Path, minilm_path: Path, minilm_fp32: Engine
) -> Iterator[str]:
    """In process (tests/in_process.py): a replica per model and the gateway app with the API key, on a loopback
    port of the gateway's own HTTP server: schemathesis sends its cases over a socket, headers as it spoiled them."""
    models = (minilm_path, reranker_dir, splade_dir, colbert_dir, bge_m3_dir)
    with (
        engines(reranker_dir, splade_dir, colbert_dir, bge_m3_dir) as others,
        served([minilm_fp32, *others], model_dirs=models, api_key=API_KEY, listen=True) as running,
    ):
        yield running.url


@SCHEMA.parametrize()
@settings(
    max_examples=EXAMPLES or 20, derandomize=EXAMPLES is None, database=None, deadline=None,
    suppress_health_check=list(HealthCheck),
)  # fmt: skip
def test_server_answers_as_documented(case: schemathesis.Case, server: str) -> None:
    if isinstance(case.body, dict) and case.body.get("model") is None and case.operation.method == "post":
        # The default model is whichever replica reported first: name the one the route serves.
        path = case.operation.path
        case.body["model"] = MODEL_OF_ROUTE.get(path, RERANKER if path in RERANK_ROUTES else EMBEDDER)
    # A case whose Authorization header schemathesis left out or spoiled goes as it is (a 401); the rest with the key.
    spoiled_key = case.meta is not None and case.meta.is_negative_at(ParameterLocation.HEADER)
    headers = {} if spoiled_key else {"Authorization": f"Bearer {API_KEY}"}
    response = case.call_and_validate(base_url=server, headers=headers, checks=CHECKS, timeout=60)
    ANSWERS[(case.operation.label, response.status_code)] += 1


# A random body holds no decodable image, and these servers take none: /embeddings_image answers 400 here, its 200
# (OpenAI's embeddings, as /v1/embeddings answers) checked in tests/test_image_api.py.
NO_RANDOM_200 = {"POST /embeddings_image"}


def test_every_operation_answered_200_in_its_documented_shape() -> None:
    """After the schemathesis cases (which check each answer's shape): every operation they ran answered at least
    once with a 200, so each success shape was checked against a real answer, not only the errors."""
    operations = {label for label, _ in ANSWERS}
    if not operations:
        pytest.skip("the schemathesis cases did not run")
    print(f"\nschemathesis: {sum(ANSWERS.values())} cases over {len(operations)} operations")
    for label in sorted(operations):
        statuses = {status: count for (name, status), count in sorted(ANSWERS.items()) if name == label}
        print(f"  {label}: {statuses}")
    assert {label for (label, status) in ANSWERS if status == 200} == operations - NO_RANDOM_200


def _post(url: str, body: object) -> tuple[int, object]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(
    ("route", "body", "status"),
    [
        # Fixed, found by schemathesis (and the 1 == True one in writing the document): values the parser took
        # though they are not what the document says, and two server errors.
        ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": False}, 422),
        ("/rerank", {"model": RERANKER, "query": "a", "texts": ["b"], "truncation_direction": {}}, 422),
        ("/rerank", {"model": RERANKER, "query": "a", "texts": ["b"], "truncation_direction": "RIGHT"}, 200),
        ("/tokenize", {"inputs": "a", "unknown": 1}, 422),  # refused by name, as on every other route
        ("/tokenize", {"inputs": "a", "model": []}, 422),  # was a 500: a list looked up as a model name
        ("/tokenize", {"inputs": "a", "model": EMBEDDER, "prompt_name": ["x"]}, 422),  # was a 500 too
        ("/v1/embeddings", {"input": "a", "model": EMBEDDER, "add_special_tokens": 1}, 400),  # 1 == True, no bool
        ("/embed", {"inputs": "a", "model": EMBEDDER, "truncation_direction": "Left"}, 200),  # TEI's spelling
    ],
)
def test_requests_schemathesis_found(server: str, route: str, body: dict, status: int) -> None:
    assert _post(f"{server}{route}", body)[0] == status


# Answers random cases may not reach, checked against the document all the same: the reranker's model card and
# /info, each option that changes a shape.
_EXPLICIT = [
    ("/info", "GET", {"query": {"model": RERANKER}}, 200),
    ("/v1/models/{model}", "GET", {"path_parameters": {"model": RERANKER}}, 200),
    ("/v1/models/{model}", "GET", {"path_parameters": {"model": f"sentence-transformers/{EMBEDDER}"}}, 200),
    ("/v1/embeddings", "POST",
     {"body": {"input": ["a", [101, 102]], "model": EMBEDDER, "encoding_format": "base64"}}, 200),
    ("/embed", "POST", {"body": {"inputs": ["a", [101, 102]], "model": EMBEDDER, "long_input": "chunk"}}, 200),
    ("/", "POST", {"body": {"inputs": {"source_sentence": "a", "sentences": ["b", "c"]}, "model": EMBEDDER}}, 200),
    ("/v1/contextualizedembeddings", "POST",
     {"body": {"input": [["a", "b"], ["c"]], "encoding_format": "base64", "model": EMBEDDER}}, 200),
    ("/tokenize", "POST", {"body": {"prompt": "a b", "return_token_strs": True, "model": EMBEDDER}}, 200),
    ("/tokenize", "POST", {"body": {"inputs": ["a b", "c"], "add_special_tokens": False, "model": EMBEDDER}}, 200),
    ("/decode", "POST", {"body": {"ids": [[101, 102], []], "skip_special_tokens": False, "model": EMBEDDER}}, 200),
    ("/rerank", "POST", {"body": {"query": "a", "texts": ["b", "c"], "return_text": True, "model": RERANKER}}, 200),
    # the wrong kind of model: OpenAI's 400 for Cohere's body on /rerank, TEI's 424 for TEI's
    ("/rerank", "POST", {"body": {"query": "a", "documents": ["b", {"text": "c"}], "model": EMBEDDER}}, 400),
    ("/rerank", "POST", {"body": {"query": "a", "texts": ["b"], "model": EMBEDDER}}, 424),
    ("/embed", "POST", {"body": {"inputs": "a", "model": RERANKER}}, 424),
    ("/v1/rerank", "POST",
     {"body": {"query": "a", "documents": ["b", {"text": "c"}], "top_n": 1, "return_documents": False,
               "model": RERANKER}}, 200),
    ("/score", "POST", {"body": {"text_1": ["a", "b"], "text_2": ["c", "d"], "model": RERANKER}}, 200),
    # vLLM's: the sides' newer names and the activation switch, /detokenize, /tokenize's errors in OpenAI's shape
    ("/v1/score", "POST",
     {"body": {"queries": "a", "items": ["c", "d"], "use_activation": False, "model": RERANKER}}, 200),
    ("/score", "POST", {"body": {"text_1": "a", "data_1": "b", "text_2": ["c"], "model": RERANKER}}, 400),
    ("/v1/rerank", "POST", {"body": {"query": "a", "documents": ["b"], "activation": False, "model": RERANKER}}, 200),
    ("/v1/embeddings", "POST", {"body": {"input": "a", "use_activation": False, "model": EMBEDDER}}, 200),
    ("/detokenize", "POST", {"body": {"tokens": [101, 1037, 102], "model": EMBEDDER}}, 200),
    ("/detokenize", "POST", {"body": {"tokens": [10**9], "model": EMBEDDER}}, 400),
    ("/tokenize", "POST", {"body": {"prompt": "a", "unknown": 1, "model": EMBEDDER}}, 400),
]  # fmt: skip


@pytest.mark.parametrize(("path", "method", "parts", "status"), _EXPLICIT)
def test_explicit_requests_answer_as_documented(server: str, path: str, method: str, parts: dict, status: int) -> None:
    case = SCHEMA[path][method].Case(**parts)
    response = case.call_and_validate(
        base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, checks=CHECKS[:-1], timeout=60
    )
    assert response.status_code == status
