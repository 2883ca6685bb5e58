"""text-embeddings-inference's API, with its error bodies and statuses: `POST /embed` (and `POST /`, which also
takes the Hugging Face Inference API's similarity body), `/embed_sparse`, `/embed_all`, `/similarity`,
`/tokenize` (which also takes vLLM's body), `/decode`, `GET /info` and `/health`. Its scoring routes, `/rerank` and
`/predict`, are in tei_scores.py."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.batch import RowOptions
from bouquet.gateway import text_tools
from bouquet.gateway.api import vllm
from bouquet.gateway.api.fields import (
    long_input,
    parse_inputs,
    response_format,
    strict,
    text_positions,
    truncation_direction,
)
from bouquet.gateway.api.tei_bodies import (
    DECODE,
    EMBED,
    EMBED_ALL,
    EMBED_SPARSE,
    SIMILARITY,
    TOKENIZE,
    Classifier,
    Decoded,
    EmbedAllRequest,
    EmbedSparseRequest,
    Health,
    Info,
    Pooling,
    Similarities,
    SimilarityInputs,
    SimilarityParameters,
    SimilarityRequest,
    SparseEntries,
    SparseEntry,
    TEIEmbeddings,
    TEIEmbedRequest,
    TEITokens,
    TokenStates,
)
from bouquet.gateway.contextual import embed_all
from bouquet.gateway.errors import ApiError, InvalidRequest, Unavailable, Unprocessable
from bouquet.gateway.http.body import read_body
from bouquet.gateway.http.decode import EitherDecoder, present
from bouquet.gateway.http.endpoint import Handler, endpoint, json_response, openai_errors, unless_disconnected
from bouquet.gateway.http.error_responses import error_response
from bouquet.gateway.jobs import EmbedJob
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service
from bouquet.sparse_rows import SparseRows


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
    return await _embed_body(service, request, EMBED.decode(await read_body(service, request), strict(service)))


async def _embed_body(service: Service, request: Request, body: TEIEmbedRequest) -> Response:
    job = embed_job(body)
    _, rows, _ = await unless_disconnected(request, service.embed(job))
    answer: TEIEmbeddings = job.response_format.answer(rows)  # a list of numbers a row, or a base64 string
    return json_response(answer)


# TEI's `POST /` body: an embedding request, or a similarity request when `inputs` is an object
ROOT = EitherDecoder(EMBED, SIMILARITY, lambda body: isinstance(body.inputs, SimilarityInputs))


async def _root(service: Service, request: Request) -> Response:
    """TEI's `POST /` embeds; an object as `inputs` (`{"source_sentence", "sentences"}`) asks for similarities, as
    the Hugging Face Inference API takes both at one URL: huggingface_hub's
    `InferenceClient(model=URL).sentence_similarity` and litellm's `huggingface/` similarity requests send it here."""
    parsed = ROOT.decode(await read_body(service, request), strict(service))
    if isinstance(parsed, SimilarityRequest):
        return await _similarity_body(service, request, parsed)
    return await _embed_body(service, request, parsed)


async def _similarity(service: Service, request: Request) -> Response:
    body = SIMILARITY.decode(await read_body(service, request), strict(service))
    return await _similarity_body(service, request, body)


async def _similarity_body(service: Service, request: Request, body: SimilarityRequest) -> Response:
    job = similarity_job(body)
    service.check_inputs(job.num_inputs)
    _, rows, _ = await unless_disconnected(request, service.embed(job))
    answer: Similarities = text_tools.similarities(rows)
    return json_response(answer)


async def _embed_sparse(service: Service, request: Request) -> Response:
    """Per input, its sparse row's nonzero entries `{"index", "value"}` by ascending vocabulary id."""
    job = embed_sparse_job(EMBED_SPARSE.decode(await read_body(service, request), strict(service)))
    _, rows, _ = await unless_disconnected(request, service.embed(job))
    assert isinstance(rows, SparseRows)
    answer: SparseEntries = [_entries(*rows.row(index)) for index in range(rows.num_rows)]
    return json_response(answer)


async def _embed_all(service: Service, request: Request) -> Response:
    job = embed_all_job(EMBED_ALL.decode(await read_body(service, request), strict(service)))
    _, token_states, _ = await unless_disconnected(request, embed_all(service, job))
    answer: TokenStates = token_states
    return json_response(answer)


# TEI's `/tokenize` body (`inputs`), or vLLM's (`prompt` and no `inputs`)
TOKENIZE_BODIES = EitherDecoder(
    TOKENIZE, vllm.TOKENIZE, lambda body: body.prompt is not UNSET and body.inputs is UNSET
)  # fmt: skip


async def _tokenize(service: Service, request: Request) -> Response:
    """TEI's body (`inputs`; TEI's errors), or vLLM's (`prompt`; OpenAI's errors, as vLLM answers)."""
    body = await read_body(service, request)
    try:
        parsed = TOKENIZE_BODIES.decode(body, strict(service))
    except ApiError as error:  # the body's shape says whose error it is (looked for on this path only)
        fields = present(body)
        if "prompt" in fields and "inputs" not in fields:
            return error_response(error)
        raise
    if isinstance(parsed, vllm.VLLMTokenizeRequest):
        return await openai_errors(vllm.tokenize(service, parsed))
    model = service.catalog.get(parsed.model)
    prompt = model.prompt(parsed.prompt_name)
    texts = [parsed.inputs] if isinstance(parsed.inputs, str) else parsed.inputs
    answer: TEITokens = await text_tools.tokenize(service, model, texts, prompt, parsed.add_special_tokens)
    return json_response(answer)


async def _decode(service: Service, request: Request) -> Response:
    """`{"ids": [...] | [[...], ...], "skip_special_tokens"}` -> one string per sequence."""
    parsed = DECODE.decode(await read_body(service, request), strict(service))
    ids = parsed.ids
    nested = bool(ids) and isinstance(ids[0], list)
    for index, item in enumerate(ids):
        if isinstance(item, list) is not nested:
            where = f"ids[{index}]"
            raise Unprocessable(
                f"'{where}' must be a {'list of token ids' if nested else 'token id'}", "invalid_type", "ids"
            )
    batch: list[list[int]] = ids if nested else [ids]  # type: ignore[list-item,assignment]
    skip = parsed.skip_special_tokens is not False
    answer: Decoded = await text_tools.decode(service, parsed.model, batch, skip, "ids")
    return json_response(answer)


async def _info(service: Service, request: Request) -> Response:
    if not service.catalog.ordered:
        raise Unavailable(f"no replica has reported its model yet{_why(service)}", "no_healthy_replica")
    model = service.catalog.get(request.query_params.get("model"))
    c = service.config
    return json_response(Info(
        model_id=model.id, model_dtype=model.dtype, model_type=_model_type(model), task=model.task,
        sparse=bool(model.sparse_dimension), family=model.family, architecture=model.architecture,
        normalize=model.normalize, dimension=model.dimension, max_input_length=model.max_seq_length,
        max_batch_tokens=model.max_batch_tokens, max_client_batch_size=c.max_inputs, prompts=model.prompts,
        default_prompt_name=model.default_prompt_name,
        replicas=sum(r.healthy and r.model is model for r in service.pool.replicas), version="0.1.0",
        served_model_name=model.id, max_concurrent_requests=c.max_concurrent_requests,
        tokenization_workers=c.tokenizer_threads,
    ))  # fmt: skip


def _model_type(model: ServedModel) -> dict[str, Pooling | Classifier]:
    """TEI's /info `model_type`: an embedding model's pooling, a reranker (one label) or a classifier, with labels."""
    if model.task == "score":
        id2label = {str(index): name for index, name in enumerate(model.labels)}
        label2id = {name: int(index) for index, name in id2label.items()}
        kind = "reranker" if model.dimension == 1 else "classifier"
        return {kind: Classifier(id2label, label2id, model.score_activation)}
    return {"embedding": Pooling("splade" if model.task == "sparse" else model.pooling)}


async def health(service: Service, request: Request) -> Response:
    if not service.pool.any_healthy():
        raise Unavailable(f"no replica is healthy{_why(service)}", "no_healthy_replica")
    return json_response(Health(time.time()))


def parse_tei(body: bytes | bytearray, strict: bool = True) -> EmbedJob:
    """An `/embed` body's job, from its bytes."""
    return embed_job(EMBED.decode(body, strict))


def embed_job(body: TEIEmbedRequest) -> EmbedJob:
    texts, token_ids = parse_inputs(body.inputs, "inputs")
    formats = response_format(body.encoding_format, body.embed_dtype, body.endianness)
    return EmbedJob(
        model=body.model,
        texts=texts,
        token_ids=token_ids,
        options=RowOptions(body.dimensions, body.normalize, encoding=formats.encoding),
        truncate=body.truncate is not False,
        truncation_direction=truncation_direction(body.truncation_direction),
        prompt_name=body.prompt_name,
        response_format=formats,
        text_positions=text_positions(body.inputs, texts, token_ids),
        # truncate=false stays an error for an over-long input, as on TEI, unless the request asks to chunk it
        long_input=long_input(body.long_input) or ("truncate" if body.truncate is False else None),
    )


def embed_sparse_job(body: EmbedSparseRequest) -> EmbedJob:
    job = embed_all_job(body)
    if job.text_positions is not None:
        message = "a batch mixing texts and token ids is not taken on /embed_sparse: send one kind a request"
        raise InvalidRequest(message, "unsupported_parameter", "inputs")
    sparse = RowOptions(normalize=False, sparse=True)  # a sparse row comes whole: no dimensions or encoding
    return replace(job, options=sparse, long_input="truncate" if body.truncate is False else None)


def similarity_job(body: SimilarityRequest) -> EmbedJob:
    """TEI's /similarity: `{"inputs": {"source_sentence", "sentences"}, "parameters": {...}}` as one embedding job,
    the source first, rows not normalised (the cosine does that)."""
    parameters = body.parameters or SimilarityParameters()
    return EmbedJob(
        model=body.model,
        texts=[body.inputs.source_sentence, *body.inputs.sentences],
        token_ids=None,
        options=RowOptions(normalize=False),
        truncate=parameters.truncate is not False,
        truncation_direction=truncation_direction(parameters.truncation_direction),
        prompt_name=parameters.prompt_name,
    )


def embed_all_job(body: EmbedAllRequest) -> EmbedJob:
    """TEI's EmbedAllRequest: `inputs`, `truncate`, `truncation_direction`, `prompt_name` (and bouquet's `model`)."""
    texts, token_ids = parse_inputs(body.inputs, "inputs")
    return EmbedJob(
        model=body.model,
        texts=texts,
        token_ids=token_ids,
        truncate=body.truncate is not False,
        truncation_direction=truncation_direction(body.truncation_direction),
        prompt_name=body.prompt_name,
        text_positions=text_positions(body.inputs, texts, token_ids),  # texts and ids in one batch, as TEI takes
    )


def _entries(indices: Any, values: Any) -> list[SparseEntry]:
    return [SparseEntry(index, value) for index, value in zip(indices.tolist(), values.tolist(), strict=True)]


def _why(service: Service) -> str:
    """Why the replicas cannot be used, as the gateway last saw it (also in its log, once per replica and cause)."""
    causes = service.pool.unusable()
    return "; " + "; ".join(f"{address}: {cause}" for address, cause in sorted(causes.items())) if causes else ""
