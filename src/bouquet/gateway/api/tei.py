"""text-embeddings-inference's API, with its error bodies and statuses: `POST /embed` (and `POST /`, which also
takes the Hugging Face Inference API's similarity body), `/embed_sparse`, `/embed_all`, `/similarity`,
`/tokenize` (which also takes vLLM's body), `/decode`, `GET /info` and `/health`. Its scoring routes, `/rerank` and
`/predict`, are in tei_scores.py."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.gateway import text_tools
from bouquet.gateway.api import vllm
from bouquet.gateway.api.fields import (
    is_int,
    long_input,
    optional_field,
    parse_dimensions,
    parse_inputs,
    parse_response_format,
    refuse_unknown,
    strict,
    text_positions,
    truncation_direction,
)
from bouquet.gateway.contextual import embed_all
from bouquet.gateway.errors import InvalidRequest, Unavailable, Unprocessable
from bouquet.gateway.http.body import read_json
from bouquet.gateway.http.endpoint import Handler, endpoint, json_response, openai_errors, unless_disconnected
from bouquet.gateway.jobs import EmbedJob
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service
from bouquet.sparse_rows import SparseRows

# What each route reads; anything else is refused by name unless the server runs with --allow-unknown-fields.
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

EMBED_SPARSE_FIELDS = frozenset({"inputs", "truncate", "truncation_direction", "prompt_name", "model"})
EMBED_ALL_FIELDS = frozenset({"inputs", "truncate", "truncation_direction", "prompt_name", "model"})
SIMILARITY_FIELDS = frozenset({"inputs", "parameters", "model"})
SIMILARITY_PARAMETERS = frozenset({"truncate", "truncation_direction", "prompt_name"})
TOKENIZE_FIELDS = frozenset({"inputs", "add_special_tokens", "prompt_name", "model"})
DECODE_FIELDS = frozenset({"ids", "skip_special_tokens", "model"})


def routes() -> list[Route]:
    def post(path: str, handler: Handler, replicas: bool = True) -> Route:
        return Route(path, endpoint(path, handler, work=True, tei=True, replicas=replicas), methods=["POST"])

    return [
        post("/", _root),
        post("/embed", _embed),
        post("/embed_sparse", _embed_sparse),
        post("/embed_all", _embed_all),
        post("/similarity", _similarity),
        post("/tokenize", _tokenize, replicas=False),
        post("/decode", _decode, replicas=False),
        Route("/info", endpoint("/info", _info, tei=True), methods=["GET"]),
        Route("/health", endpoint("/health", health, public=True, tei=True), methods=["GET"]),
    ]


async def _embed(service: Service, request: Request) -> Response:
    return await _embed_body(service, request, await read_json(service, request))


async def _embed_body(service: Service, request: Request, body: dict[str, Any]) -> Response:
    job = parse_tei(body, strict(service))
    _, rows, _ = await unless_disconnected(request, service.embed(job))
    return json_response(job.response_format.answer(rows))  # a list of numbers a row, or a base64 string


async def _root(service: Service, request: Request) -> Response:
    """TEI's `POST /` embeds; an object as `inputs` (`{"source_sentence", "sentences"}`) asks for similarities, as
    the Hugging Face Inference API takes both at one URL: huggingface_hub's
    `InferenceClient(model=URL).sentence_similarity` and litellm's `huggingface/` similarity requests send it here."""
    body = await read_json(service, request)
    if isinstance(body.get("inputs"), dict):
        return await _similarity_body(service, request, body)
    return await _embed_body(service, request, body)


async def _similarity(service: Service, request: Request) -> Response:
    return await _similarity_body(service, request, await read_json(service, request))


async def _similarity_body(service: Service, request: Request, body: dict[str, Any]) -> Response:
    job = parse_similarity(body, strict(service))
    service.check_inputs(job.num_inputs)
    _, rows, _ = await unless_disconnected(request, service.embed(job))
    return json_response(text_tools.similarities(rows))


async def _embed_sparse(service: Service, request: Request) -> Response:
    """Per input, its sparse row's nonzero entries `{"index", "value"}` by ascending vocabulary id."""
    job = parse_embed_sparse(await read_json(service, request), strict(service))
    _, rows, _ = await unless_disconnected(request, service.embed(job))
    assert isinstance(rows, SparseRows)
    return json_response([_entries(*rows.row(index)) for index in range(rows.num_rows)])


async def _embed_all(service: Service, request: Request) -> Response:
    job = parse_embed_all(await read_json(service, request), strict(service))
    _, token_states, _ = await unless_disconnected(request, embed_all(service, job))
    return json_response(token_states)


async def _tokenize(service: Service, request: Request) -> Response:
    """TEI's body (`inputs`), or vLLM's (`prompt`)."""
    body = await read_json(service, request)
    if "prompt" in body and "inputs" not in body:
        return await openai_errors(vllm.tokenize(service, body))
    if strict(service):
        refuse_unknown(body, TOKENIZE_FIELDS)
    texts, token_ids = parse_inputs(body.get("inputs"), "inputs")
    if texts is None or token_ids is not None:
        raise Unprocessable("'inputs' must be a string or a list of strings", "invalid_type", "inputs")
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise Unprocessable("'add_special_tokens' must be a boolean", "invalid_type", "add_special_tokens")
    model = service.catalog.get(optional_field(body, "model", str))
    prompt = model.prompt(optional_field(body, "prompt_name", str))
    return json_response(await text_tools.tokenize(service, model, texts, prompt, add_special))


async def _decode(service: Service, request: Request) -> Response:
    """`{"ids": [...] | [[...], ...], "skip_special_tokens"}` -> one string per sequence."""
    body = await read_json(service, request)
    if strict(service):
        refuse_unknown(body, DECODE_FIELDS)
    ids = body.get("ids")
    if ids is None:
        raise InvalidRequest("'ids' is required", "missing_required_parameter", "ids")
    batch = ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else [ids]
    model_name = optional_field(body, "model", str)
    for index, sequence in enumerate(batch):
        if not isinstance(sequence, list) or not all(map(is_int, sequence)):
            raise Unprocessable(f"'ids[{index}]' must be a list of token ids", "invalid_type", "ids")
    skip = optional_field(body, "skip_special_tokens", bool)
    return json_response(await text_tools.decode(service, model_name, batch, skip is not False, "ids"))


async def _info(service: Service, request: Request) -> Response:
    if not service.catalog.ordered:
        raise Unavailable(f"no replica has reported its model yet{_why(service)}", "no_healthy_replica")
    model = service.catalog.get(request.query_params.get("model"))
    c = service.config
    return json_response({
        "model_id": model.id, "model_dtype": model.dtype, "model_type": _model_type(model), "task": model.task,
        "sparse": bool(model.sparse_dimension),
        "family": model.family, "architecture": model.architecture, "normalize": model.normalize,
        "dimension": model.dimension, "max_input_length": model.max_seq_length,
        "max_batch_tokens": model.max_batch_tokens, "max_client_batch_size": service.config.max_inputs,
        "prompts": model.prompts, "default_prompt_name": model.default_prompt_name,
        "replicas": sum(r.healthy and r.model is model for r in service.pool.replicas), "version": "0.1.0",
        # TEI's router fields, for clients that read them
        "model_sha": None, "served_model_name": model.id, "max_concurrent_requests": c.max_concurrent_requests,
        "max_batch_requests": None, "auto_truncate": True, "tokenization_workers": c.tokenizer_threads,
        "sha": None, "docker_label": None,
    })  # fmt: skip


def _model_type(model: ServedModel) -> dict[str, Any]:
    """TEI's /info `model_type`: an embedding model's pooling, a reranker (one label) or a classifier, with labels."""
    if model.task == "score":
        id2label = {str(index): name for index, name in enumerate(model.labels)}
        labels = {"id2label": id2label, "label2id": {name: int(index) for index, name in id2label.items()}}
        return {"reranker" if model.dimension == 1 else "classifier": {**labels, "activation": model.score_activation}}
    return {"embedding": {"pooling": "splade" if model.task == "sparse" else model.pooling}}


async def health(service: Service, request: Request) -> Response:
    if not service.pool.any_healthy():
        raise Unavailable(f"no replica is healthy{_why(service)}", "no_healthy_replica")
    return json_response({"status": "ok", "unix": time.time()})  # Infinity's clock field


def parse_tei(body: dict[str, Any], strict: bool = True) -> EmbedJob:
    if strict:
        refuse_unknown(body, TEI_FIELDS)
    if "inputs" not in body:
        raise InvalidRequest("'inputs' is required", "missing_required_parameter", "inputs")
    texts, token_ids = parse_inputs(body["inputs"], "inputs")
    positions = text_positions(body["inputs"], texts, token_ids)
    normalize = optional_field(body, "normalize", bool)
    truncate = optional_field(body, "truncate", bool)
    return EmbedJob(
        model=optional_field(body, "model", str),
        texts=texts,
        token_ids=token_ids,
        dimensions=parse_dimensions(body),
        normalize=normalize,
        truncate=True if truncate is None else truncate,
        truncation_direction=truncation_direction(body),
        prompt_name=optional_field(body, "prompt_name", str),
        response_format=parse_response_format(body),
        text_positions=positions,
        # truncate=false stays an error for an over-long input, as on TEI, unless the request asks to chunk it
        long_input=long_input(body) or ("truncate" if truncate is False else None),
    )


def parse_embed_sparse(body: dict[str, Any], strict: bool = True) -> EmbedJob:
    if strict:
        refuse_unknown(body, EMBED_SPARSE_FIELDS)
    job = parse_tei({name: value for name, value in body.items() if name in EMBED_SPARSE_FIELDS}, strict=False)
    if job.text_positions is not None:
        message = "a batch mixing texts and token ids is not taken on /embed_sparse: send one kind a request"
        raise InvalidRequest(message, "unsupported_parameter", "inputs")
    return replace(job, sparse=True)


def parse_similarity(body: dict[str, Any], strict: bool = True) -> EmbedJob:
    """TEI's /similarity: `{"inputs": {"source_sentence", "sentences"}, "parameters": {...}}` as one embedding job,
    the source first, rows not normalised (the cosine does that)."""
    if strict:
        refuse_unknown(body, SIMILARITY_FIELDS)
    inputs = body.get("inputs")
    if not isinstance(inputs, dict):
        raise Unprocessable("'inputs' must be an object with source_sentence and sentences", "invalid_type", "inputs")
    source, sentences = inputs.get("source_sentence"), inputs.get("sentences")
    if not isinstance(source, str) or not isinstance(sentences, list):
        raise Unprocessable("'inputs' needs a string source_sentence and a list of sentences", "invalid_type", "inputs")
    if not sentences or not source or not all(isinstance(s, str) and s for s in sentences):
        raise InvalidRequest("'inputs.sentences' cannot be empty, nor hold an empty string", "empty_input", "inputs")
    parameters = {} if body.get("parameters") is None else body["parameters"]  # false, 0 or "" are no object
    if not isinstance(parameters, dict):
        raise Unprocessable("'parameters' must be an object", "invalid_type", "parameters")
    if strict:
        refuse_unknown(parameters, SIMILARITY_PARAMETERS)
    truncate = optional_field(parameters, "truncate", bool)
    return EmbedJob(
        model=optional_field(body, "model", str),
        texts=[source, *sentences],
        token_ids=None,
        normalize=False,
        truncate=True if truncate is None else truncate,
        truncation_direction=truncation_direction(parameters),
        prompt_name=optional_field(parameters, "prompt_name", str),
    )


def parse_embed_all(body: dict[str, Any], strict: bool = True) -> EmbedJob:
    """TEI's EmbedAllRequest: `inputs`, `truncate`, `truncation_direction`, `prompt_name` (and bouquet's `model`)."""
    if strict:
        refuse_unknown(body, EMBED_ALL_FIELDS)
    if "inputs" not in body:
        raise InvalidRequest("'inputs' is required", "missing_required_parameter", "inputs")
    texts, token_ids = parse_inputs(body["inputs"], "inputs")
    truncate = optional_field(body, "truncate", bool)
    mixed = texts is not None and token_ids is not None  # texts and lists of ids in one batch, as TEI takes
    return EmbedJob(
        model=optional_field(body, "model", str),
        texts=texts,
        token_ids=token_ids,
        truncate=True if truncate is None else truncate,
        truncation_direction=truncation_direction(body),
        prompt_name=optional_field(body, "prompt_name", str),
        text_positions=tuple(i for i, item in enumerate(body["inputs"]) if isinstance(item, str)) if mixed else None,
    )


def _entries(indices: Any, values: Any) -> list[dict[str, float | int]]:
    return [{"index": index, "value": value} for index, value in zip(indices.tolist(), values.tolist(), strict=True)]


def _why(service: Service) -> str:
    """Why the replicas cannot be used, as the gateway last saw it (also in its log, once per replica and cause)."""
    causes = service.pool.unusable()
    return "; " + "; ".join(f"{address}: {cause}" for address, cause in sorted(causes.items())) if causes else ""
