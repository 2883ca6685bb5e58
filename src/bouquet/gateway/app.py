"""The HTTP routes: OpenAI's /v1/embeddings and /v1/models, TEI's /embed, /tokenize and /info, plus /health,
/metrics, /openapi.json and /docs. Every route runs through `_endpoint`: authorisation, metrics, and errors
turned into responses in one place (errors.py)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from bouquet.batch import Batch, RowOptions
from bouquet.config import GatewayConfig
from bouquet.encodings import Encoding, encode_rows
from bouquet.gateway import contextual, long_inputs, predict, request_ids, rerank, sparse, text_tools
from bouquet.gateway.admission import Admission
from bouquet.gateway.api import cohere
from bouquet.gateway.chunking import embed_chunked
from bouquet.gateway.errors import (
    ApiError,
    ClientClosed,
    InternalError,
    InvalidRequest,
    NotFound,
    RequestTimeout,
    TooLarge,
    Unauthorized,
    Unavailable,
    Unprocessable,
    UnsupportedMedia,
    cohere_error_response,
    error_response,
    tei_error_response,
)
from bouquet.gateway.memory_trim import trim_when_idle
from bouquet.gateway.metrics import GatewayMetrics
from bouquet.gateway.openapi import DOCS_ASSETS, DOCS_HTML, docs_asset, openapi_spec
from bouquet.gateway.replicas.catalog import ModelCatalog, ServedModel
from bouquet.gateway.replicas.pool import ReplicaPool
from bouquet.gateway.request_ids import RequestIds
from bouquet.gateway.schemas import (
    EmbedJob,
    openai_response,
    optional_field,
    parse_inputs,
    parse_openai,
    parse_tei,
    refuse_unknown,
    with_response_id,
)
from bouquet.sparse_rows import max_sparse_rows
from bouquet.tls import channel_credentials

logger = logging.getLogger(__name__)

_JSON = "application/json"
_T = TypeVar("_T")
_NUMPY = orjson.OPT_SERIALIZE_NUMPY
_SPECIAL_TOKENS = 4  # the most any tokenizer here adds around one text or pair (e.g. <s> </s></s> </s>)


class Gateway:
    """The state every route shares: the replica pool, the models it has found, limits and metrics."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None):
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.executor = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        self.catalog = ModelCatalog(config.model_dirs, self.executor)
        credentials = None
        if config.replica_tls_ca is not None:
            credentials = channel_credentials(config.replica_tls_ca, config.replica_tls_cert, config.replica_tls_key)
        self.pool = ReplicaPool(
            config.replicas, self.catalog, self.metrics, config.max_attempts, config.request_timeout,
            config.probe_interval, config.replica_token, credentials=credentials, dns_names=config.replicas_dns,
            dns_interval=config.dns_interval,
        )  # fmt: skip
        self.admission = Admission(
            self.metrics, config.max_inflight_tokens, config.admission_seconds, config.admission_wait,
            config.max_concurrent_requests,
            self.pool.tokens_per_second, self._admission_floor,
        )  # fmt: skip
        self._api_key = config.api_key.encode() if config.api_key else None

    def authorize(self, request: Request) -> None:
        """`Authorization: Bearer KEY`, the scheme in any case (RFC 7235); a refusal names the scheme to use."""
        if self._api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._api_key):
            raise Unauthorized(
                "a valid API key is required: send 'Authorization: Bearer KEY'",
                "invalid_api_key",
                headers={"WWW-Authenticate": 'Bearer realm="bouquet"'},
            )

    async def refuse_unread(self, request: Request) -> None:
        """A large body refused before it is read while the bulk lane is over its cap (`Admission.refuse_unread`);
        one over the body limit is left to `read_json`'s 413."""
        length = _content_length(request)
        if length is not None and length <= self.config.max_payload_bytes:
            await self.admission.refuse_unread(length)

    async def read_json(self, request: Request) -> dict[str, Any]:
        limit = self.config.max_payload_bytes
        length = _content_length(request)
        if length is not None and length > limit:
            raise TooLarge(f"the body has {length} bytes, over the limit of {limit}", "payload_too_large")
        encoding = request.headers.get("content-encoding", "identity")
        body = _decoded(await self._read_body(request, limit), encoding, limit)
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError as error:
            if "UTF-8" in str(error):
                raise InvalidRequest("the body is not valid UTF-8", "invalid_utf8") from error
            raise InvalidRequest(f"the body is not valid JSON: {error}", "invalid_json") from error
        if not isinstance(value, dict):
            raise Unprocessable("the body must be a JSON object", "invalid_type")
        return value

    async def _read_body(self, request: Request, limit: int) -> bytearray:
        body = bytearray()
        async with aclosing(request.stream()) as pieces:
            while (piece := await self._next_piece(pieces)) is not None:
                body += piece
                if len(body) > limit:
                    raise TooLarge(f"the body is over the limit of {limit} bytes", "payload_too_large")
        return body

    async def _next_piece(self, pieces: AsyncGenerator[bytes, None]) -> bytes | None:
        """The body's next piece, None at its end. The body timeout lives here, in the one reader every route
        with a body uses, so the 408 is the route's own error answer, counted under the route; a client that
        stops sending (a body shorter than its Content-Length) no longer holds its connection forever."""
        seconds = self.config.body_timeout
        try:
            async with asyncio.timeout(seconds):
                return await anext(pieces, None)
        except TimeoutError:
            self.metrics.connections_closed.labels("body_timeout").inc()
            raise RequestTimeout(
                f"no byte of the body arrived for {seconds:g} s (is it shorter than its Content-Length?)",
                "request_timeout",
                headers={"Connection": "close"},  # the rest of the body may still come: the connection is done
            ) from None
        except ClientDisconnect:
            raise ClientClosed("the client closed the connection before its body ended", "client_closed") from None

    async def embed(self, job: EmbedJob) -> tuple[ServedModel, Any, int]:
        """Rows [N, elements] for the job, in its response format's encoding, and the tokens they took."""
        if job.text_positions is not None:
            return await self._embed_mixed(job)
        model = self.catalog.get(job.model)
        if job.sparse and not model.sparse_dimension:
            raise model.wrong_task("sparse rows")
        if not job.sparse and model.task != "embed":
            raise model.wrong_task("embeddings")
        _check_truncate_tokens(job, model)
        options = self._row_options(job, model)
        self.check_inputs(job.num_inputs)
        if not job.sparse and (job.long_input or self.config.long_input) == "chunk":  # sparse rows are not averaged
            return model, *await self._embed_windows(job, model, options)

        async def batch() -> Batch:
            return Batch.pack(await self._sequences(job, model), options)

        estimate = self._estimate(job, model, options.prompt_tokens)
        rows, tokens = await self.compute(model, estimate, batch, exact=job.token_ids is not None)
        return model, rows, tokens

    async def _embed_mixed(self, job: EmbedJob) -> tuple[ServedModel, Any, int]:
        """Texts and token ids in one batch (TEI takes it): each kind embedded as a job of its own, concurrently,
        the rows put back in the input's order."""
        self.check_inputs(job.num_inputs)
        texts = replace(job, token_ids=None, text_positions=None)
        ids = replace(job, texts=None, text_positions=None)
        (model, text_rows, text_tokens), (_, id_rows, id_tokens) = await asyncio.gather(
            self.embed(texts), self.embed(ids)
        )
        rows = np.empty((job.num_inputs, text_rows.shape[1]), text_rows.dtype)
        is_text = np.zeros(job.num_inputs, bool)
        is_text[list(job.text_positions or ())] = True
        rows[is_text], rows[~is_text] = text_rows, id_rows
        return model, rows, text_tokens + id_tokens

    async def _embed_windows(self, job: EmbedJob, model: ServedModel, options: RowOptions) -> tuple[Any, int]:
        """Each input whole, in windows of the model's limit averaged (long_inputs.py)."""
        prompt = model.prompt(job.prompt_name) if job.texts is not None else ""
        cut: list[long_inputs.Windows] = []

        async def batch() -> Batch:
            if job.texts is not None:
                tokenizer = model.require_tokenizer()
                contents, (prefix, suffix) = await tokenizer.encode_text_only(job.texts), tokenizer.frame(prompt)
            else:
                assert job.token_ids is not None
                self._check_vocabulary(job.token_ids, model)
                contents, prefix, suffix = job.token_ids, [], []  # ids as sent, their own special tokens
            cut.append(long_inputs.cut(contents, prefix, suffix, model.max_seq_length))
            # the windows' rows come back as float32, averaged, then finished and encoded here
            window_options = replace(options, dimensions=0, normalize=False, encoding=Encoding.FLOAT32)
            return Batch.pack(cut[0].sequences, window_options)

        sizes = [len(text.encode()) for text in job.texts] if job.texts is not None else map(len, job.token_ids or ())
        estimate = sum(size + _SPECIAL_TOKENS * (1 + size // model.max_seq_length) for size in sizes)
        rows, tokens = await self.compute(model, estimate, batch, exact=job.token_ids is not None)
        combined = long_inputs.combine(rows, cut[0], job.num_inputs, options.dimensions, options.normalize)
        return encode_rows(combined, options.encoding), tokens

    async def compute(
        self, model: ServedModel, estimate: int, prepare: Callable[[], Awaitable[Batch]], exact: bool = False
    ) -> tuple[Any, int]:
        """The rows of the batch `prepare` tokenizes, admitted on `estimate` (an upper bound of its tokens, from
        its bytes; `exact` when counted from token ids) before any work; and the tokens they took."""
        if not self.pool.any_healthy(model.name):
            raise Unavailable(f"no healthy replica serves the model {model.id!r}", "no_healthy_replica", "model")
        async with self.admission.admit(estimate, short_tokens=model.max_batch_tokens, exact=exact) as ticket:
            batch = await prepare()
            tokens = batch.num_tokens
            self.check_tokens(tokens)
            ticket.tokenized(tokens)
            chunk_tokens = self.config.chunk_tokens or 2 * max(1, model.max_batch_tokens)
            priority = 0 if ticket.short else 1  # queries first; among the rest, first come first served
            max_seqs = max_sparse_rows(model.sparse_dimension) if batch.any_sparse else None
            rows = await embed_chunked(self.pool, model.name, batch, chunk_tokens, priority, max_seqs)
        self.metrics.tokens.labels(model.id).inc(tokens)
        return rows, tokens

    def _estimate(self, job: EmbedJob, model: ServedModel, prompt_tokens: int) -> int:
        """At least the tokens the job will take, known before tokenizing: a token is at least one byte."""
        limit = model.max_seq_length
        if job.token_ids is not None:
            return sum(min(len(ids), limit) if job.truncate else len(ids) for ids in job.token_ids)
        assert job.texts is not None
        bound = _SPECIAL_TOKENS + prompt_tokens
        sizes = (_utf8_size(text) + bound for text in job.texts)
        return sum(min(size, limit) for size in sizes) if job.truncate else sum(sizes)

    def _admission_floor(self) -> int:
        """Tokens admitted at once before the replicas' speed is known, and the least after: sixteen batches
        for each healthy replica (about a second of work on a CPU), so a cap measured while they idled never
        starves them."""
        return sum(16 * r.model.max_batch_tokens for r in self.pool.replicas if r.healthy and r.model is not None)

    def check_inputs(self, count: int) -> None:
        """Every route's cap on the inputs of one request (embeddings, documents, texts to tokenize)."""
        if count > self.config.max_inputs:
            raise TooLarge(f"{count} inputs, over the limit of {self.config.max_inputs} a request", "too_many_inputs")

    def check_tokens(self, tokens: int) -> None:
        if tokens > self.config.max_request_tokens:
            raise TooLarge(
                f"{tokens} tokens, over the limit of {self.config.max_request_tokens} a request", "too_many_tokens"
            )

    def _row_options(self, job: EmbedJob, model: ServedModel) -> RowOptions:
        prompt = model.prompt(job.prompt_name) if job.texts is not None else ""
        prompt_tokens = model.require_tokenizer().prompt_tokens(prompt) if prompt else 0
        if job.sparse:  # a sparse row comes whole and as it is: no dimensions, normalisation or encoding
            return RowOptions(normalize=False, prompt_tokens=prompt_tokens, sparse=True)
        return RowOptions(
            dimensions=self._check_dimensions(job.dimensions, model),
            normalize=model.normalize if job.normalize is None else job.normalize,
            prompt_tokens=prompt_tokens,
            encoding=job.response_format.encoding,
        )

    def _check_dimensions(self, dimensions: int | None, model: ServedModel) -> int:
        if dimensions is None:
            return 0
        if not 1 <= dimensions <= model.dimension:
            raise InvalidRequest(
                f"dimensions must be between 1 and {model.dimension} for {model.id!r}, got {dimensions}",
                "invalid_value",
                "dimensions",
            )
        return dimensions

    async def _sequences(self, job: EmbedJob, model: ServedModel) -> list[list[int]]:
        if job.token_ids is not None:
            return self._check_token_ids(job.token_ids, job, model)
        assert job.texts is not None
        tokenizer = model.require_tokenizer()
        started = time.perf_counter()
        sequences = await tokenizer.encode(
            job.texts, model.prompt(job.prompt_name), job.truncate, job.truncation_direction, job.truncate_tokens
        )
        self.metrics.tokenize_seconds.observe(time.perf_counter() - started)
        return sequences

    def _check_vocabulary(self, token_ids: list[list[int]], model: ServedModel) -> None:
        if not self.config.token_id_input:
            raise InvalidRequest(
                "this server takes text only, not token ids (--no-token-id-input): a client that tokenizes for "
                "another model (langchain-openai's default tiktoken ids) would get wrong vectors",
                "token_ids_refused",
                "input",
            )
        for index, ids in enumerate(token_ids):
            low, high = min(ids), max(ids)
            if low < 0 or high >= model.vocab_size:
                raise InvalidRequest(
                    f"input {index} holds the token id {low if low < 0 else high}, outside this model's vocabulary "
                    f"[0, {model.vocab_size})",
                    "invalid_token_id",
                    "input",
                )

    def _check_token_ids(self, token_ids: list[list[int]], job: EmbedJob, model: ServedModel) -> list[list[int]]:
        self._check_vocabulary(token_ids, model)
        limit = min(model.max_seq_length, job.truncate_tokens or model.max_seq_length)
        for index, ids in enumerate(token_ids):
            if len(ids) > limit and not job.truncate:
                raise TooLarge(
                    f"input {index} has {len(ids)} tokens, over this model's limit of {limit}", "input_too_long"
                )
        if job.truncation_direction == "left":
            return [ids[-limit:] for ids in token_ids]
        return [ids[:limit] for ids in token_ids]


def _check_truncate_tokens(job: EmbedJob, model: ServedModel) -> None:
    """vLLM's truncate_prompt_tokens keeps the first k tokens; k over the model's limit is refused, as vLLM does."""
    if job.truncate_tokens is not None and job.truncate_tokens > model.max_seq_length:
        raise InvalidRequest(
            f"truncate_prompt_tokens ({job.truncate_tokens}) is greater than the model's limit "
            f"(max_model_len {model.max_seq_length}); request a smaller truncation size",
            "invalid_value",
            "truncate_prompt_tokens",
        )


def _content_length(request: Request) -> int | None:
    """The body's size as its Content-Length states it; None without one (chunked) or with a malformed one."""
    length = request.headers.get("content-length")
    return int(length) if length is not None and length.isdigit() else None


def _decoded(body: bytearray, encoding: str, limit: int) -> bytes | bytearray:
    """The body as sent, or gunzipped (clients that compress requests); the limit holds for the decompressed
    body too, so a small bomb cannot grow past it."""
    encoding = encoding.strip().lower()
    if encoding in ("identity", ""):
        return body
    if encoding not in ("gzip", "x-gzip"):
        raise UnsupportedMedia(
            f"Content-Encoding {encoding!r} is not supported; send gzip or none", "unsupported_encoding"
        )
    inflater = zlib.decompressobj(wbits=31)  # 31: a gzip header and trailer
    try:
        plain = inflater.decompress(bytes(body), limit + 1)
    except zlib.error as error:
        raise InvalidRequest(f"the gzip body is corrupt: {error}", "invalid_gzip") from error
    if len(plain) > limit or inflater.unconsumed_tail:
        raise TooLarge(f"the decompressed body is over the limit of {limit} bytes", "payload_too_large")
    if not inflater.eof:
        raise InvalidRequest("the gzip body ends before its stream does", "invalid_gzip")
    return plain


Handler = Callable[[Gateway, Request], Awaitable[Response]]


def _endpoint(
    route: str, handler: Handler, *, public: bool = False, work: bool = False, tei: bool = False,
    replicas: bool = True, errors: Callable[[ApiError], Response] | None = None,
) -> Callable[[Request], Awaitable[Response]]:  # fmt: skip
    """`work`: the route reads a body and computes, and counts against `max_concurrent_requests`; on the
    replicas unless `replicas` is False (the tokenizer's routes). `tei`: a text-embeddings-inference route, whose
    errors have TEI's body and status; `errors`: another API's error body (Cohere's)."""
    answer_error = errors or (tei_error_response if tei else error_response)

    async def endpoint(request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        metrics = gateway.metrics
        started = time.perf_counter()
        metrics.in_flight.inc()
        try:
            if not public:
                gateway.authorize(request)
            with gateway.admission.request() if work else contextlib.nullcontext():
                if work and replicas:
                    await gateway.refuse_unread(request)
                response = await handler(gateway, request)
        except ApiError as error:
            response = answer_error(error)
        except Exception:
            logger.exception("%s failed (request %s)", route, request_ids.current.get())
            response = answer_error(InternalError("internal error; see the gateway's log", "internal_error"))
        finally:
            metrics.in_flight.dec()
        metrics.requests.labels(route, str(response.status_code)).inc()
        metrics.request_seconds.labels(route).observe(time.perf_counter() - started)
        return response

    return endpoint


def _json(value: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(value, option=_NUMPY), status, media_type=_JSON)


async def _openai_embeddings(gateway: Gateway, request: Request) -> Response:
    job = parse_openai(await gateway.read_json(request), strict=not gateway.config.allow_unknown_fields)
    model, rows, tokens = await _unless_disconnected(request, gateway.embed(job))
    return _json(with_response_id(openai_response(rows, job.model or model.id, tokens, job.response_format)))


async def _tei_embed(gateway: Gateway, request: Request) -> Response:
    return await _tei_embed_body(gateway, request, await gateway.read_json(request))


async def _tei_embed_body(gateway: Gateway, request: Request, body: dict[str, Any]) -> Response:
    job = parse_tei(body, strict=not gateway.config.allow_unknown_fields)
    _, rows, _ = await _unless_disconnected(request, gateway.embed(job))
    return _json(job.response_format.answer(rows))  # a list of numbers a row, or a base64 string


async def _tei_root(gateway: Gateway, request: Request) -> Response:
    """TEI's `POST /` embeds; an object as `inputs` (`{"source_sentence", "sentences"}`) asks for similarities, as
    the Hugging Face Inference API takes both at one URL: huggingface_hub's
    `InferenceClient(model=URL).sentence_similarity` and litellm's `huggingface/` similarity requests send it here."""
    body = await gateway.read_json(request)
    if isinstance(body.get("inputs"), dict):
        return await _similarity_body(gateway, request, body)
    return await _tei_embed_body(gateway, request, body)


async def _similarity(gateway: Gateway, request: Request) -> Response:
    return await _similarity_body(gateway, request, await gateway.read_json(request))


async def _similarity_body(gateway: Gateway, request: Request, body: dict[str, Any]) -> Response:
    job = text_tools.parse_similarity(body, strict=not gateway.config.allow_unknown_fields)
    gateway.check_inputs(job.num_inputs)
    _, rows, _ = await _unless_disconnected(request, gateway.embed(job))
    return _json(text_tools.similarities(rows))


async def _decode(gateway: Gateway, request: Request) -> Response:
    return _json(await text_tools.decode(gateway, await gateway.read_json(request)))


async def _contextual_embeddings(gateway: Gateway, request: Request) -> Response:
    job = contextual.parse_contextual(await gateway.read_json(request), strict=not gateway.config.allow_unknown_fields)
    model, documents, tokens = await _unless_disconnected(request, contextual.contextual_embeddings(gateway, job))
    return _json(contextual.contextual_response(documents, job.model or model.id, tokens, job.response_format))


async def _tei_embed_sparse(gateway: Gateway, request: Request) -> Response:
    job = sparse.parse_embed_sparse(await gateway.read_json(request), strict=not gateway.config.allow_unknown_fields)
    return _json(await _unless_disconnected(request, sparse.embed_sparse(gateway, job)))


async def _tei_embed_all(gateway: Gateway, request: Request) -> Response:
    job = contextual.parse_embed_all(await gateway.read_json(request), strict=not gateway.config.allow_unknown_fields)
    _, token_states, _ = await _unless_disconnected(request, contextual.embed_all(gateway, job))
    return _json(token_states)


async def _rerank(gateway: Gateway, request: Request) -> Response:
    """TEI's shape (`texts`), or Cohere's and Jina's (`documents`), which clients also send here."""
    body = await gateway.read_json(request)
    if "documents" in body:
        return await _openai_errors(_cohere_rerank(gateway, request, body))
    job, return_text = rerank.parse_tei_rerank(body, strict=not gateway.config.allow_unknown_fields)
    _, scores, _ = await _unless_disconnected(request, rerank.score(gateway, job))
    return _json(rerank.tei_response(scores, job, return_text))


async def _v1_rerank(gateway: Gateway, request: Request) -> Response:
    return await _cohere_rerank(gateway, request, await gateway.read_json(request))


async def _cohere_rerank(gateway: Gateway, request: Request, body: dict[str, Any]) -> Response:
    job, top_n, return_documents = rerank.parse_cohere_rerank(body, strict=not gateway.config.allow_unknown_fields)
    model, scores, tokens = await _unless_disconnected(request, rerank.score(gateway, job))
    return _json(rerank.cohere_response(scores, job, model, tokens, top_n, return_documents))


async def _cohere_v2_embed(gateway: Gateway, request: Request) -> Response:
    parsed = cohere.parse_embed(await gateway.read_json(request), strict=not gateway.config.allow_unknown_fields)
    model = gateway.catalog.get(parsed.job.model)
    job = replace(parsed.job, prompt_name=cohere.prompt_name(model.prompts, parsed.input_type))
    _, rows, tokens = await _unless_disconnected(request, gateway.embed(job))
    return _json(cohere.embed_response(rows, parsed, tokens))


async def _cohere_v2_rerank(gateway: Gateway, request: Request) -> Response:
    job, top_n = cohere.parse_rerank(await gateway.read_json(request), strict=not gateway.config.allow_unknown_fields)
    _, scores, tokens = await _unless_disconnected(request, rerank.score(gateway, job))
    return _json(cohere.rerank_response(scores, top_n, tokens))


async def _score(gateway: Gateway, request: Request) -> Response:
    job = rerank.parse_score(await gateway.read_json(request), strict=not gateway.config.allow_unknown_fields)
    model, scores, tokens = await _unless_disconnected(request, rerank.score(gateway, job))
    return _json(rerank.score_response(scores, model, tokens))


async def _openai_errors(answer: Awaitable[Response]) -> Response:
    """Errors in OpenAI's body for a request in another server's shape on a TEI route (Cohere's, Jina's, Infinity's
    and vLLM's /rerank with documents, vLLM's /tokenize with a prompt): their clients read `error.message`."""
    try:
        return await answer
    except ApiError as error:
        return error_response(error)


async def _vllm_tokenize(gateway: Gateway, body: dict[str, Any]) -> Response:
    return _json(await text_tools.vllm_tokenize(gateway, body))


async def _detokenize(gateway: Gateway, request: Request) -> Response:
    return _json(await text_tools.vllm_detokenize(gateway, await gateway.read_json(request)))


async def _predict(gateway: Gateway, request: Request) -> Response:
    job = predict.parse_predict(await gateway.read_json(request), strict=not gateway.config.allow_unknown_fields)
    model, scores, _ = await _unless_disconnected(request, predict.predict(gateway, job))
    return _json(predict.predict_response(scores, job, model))


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """Runs `work`, cancelling it if the client goes away first: its gRPC calls are cancelled with it, so the
    replicas drop the chunks still queued instead of computing rows nobody will read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise ClientClosed("the client closed the connection before the embeddings were ready", "client_closed")
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body has been read: the next ASGI message on this connection is the client going away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _tei_tokenize(gateway: Gateway, request: Request) -> Response:
    """TEI's body (`inputs`), or vLLM's (`prompt`)."""
    body = await gateway.read_json(request)
    if "prompt" in body and "inputs" not in body:
        return await _openai_errors(_vllm_tokenize(gateway, body))
    if not gateway.config.allow_unknown_fields:
        refuse_unknown(body, text_tools.TEI_TOKENIZE_FIELDS)
    texts, token_ids = parse_inputs(body.get("inputs"), "inputs")
    if texts is None or token_ids is not None:
        raise Unprocessable("'inputs' must be a string or a list of strings", "invalid_type", "inputs")
    model = gateway.catalog.get(optional_field(body, "model", str))
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise Unprocessable("'add_special_tokens' must be a boolean", "invalid_type", "add_special_tokens")
    prompt = model.prompt(optional_field(body, "prompt_name", str))
    gateway.check_inputs(len(texts))  # the limits /embed has: a /tokenize reply is larger than its request
    tokens = await model.require_tokenizer().tokens(texts, prompt, add_special)
    gateway.check_tokens(sum(map(len, tokens)))
    return _json(tokens)


def _model_card(gateway: Gateway, model: ServedModel, name: str | None = None) -> dict[str, Any]:
    """OpenAI's model object under `name` (default: the model's id), plus what a client needs to use it: family,
    pooling, limit, width; `root` is the model's own name (vLLM's, for a served name)."""
    return {
        "id": name or model.id, "object": "model", "created": 0, "owned_by": "bouquet", "root": model.name,
        "family": model.family,
        "task": model.task, "sparse": bool(model.sparse_dimension),
        "architecture": model.architecture, "pooling": model.pooling, "normalize": model.normalize,
        "dimension": model.dimension, "max_input_length": model.max_seq_length, "dtype": model.dtype,
        "replicas": sum(r.healthy and r.model is model for r in gateway.pool.replicas),
        "stats": _model_stats(gateway, model),
    }  # fmt: skip


def _model_stats(gateway: Gateway, model: ServedModel) -> dict[str, Any]:
    """Infinity's `stats` object on each model of /models: what the gateway knows of its capacity."""
    replicas = [r for r in gateway.pool.replicas if r.healthy and r.model is model]
    return {"healthy_replicas": len(replicas), "max_batch_tokens": model.max_batch_tokens}


async def _models(gateway: Gateway, request: Request) -> Response:
    cards = [_model_card(gateway, model, name) for model in gateway.catalog.ordered for name in model.listed_names]
    return _json({"object": "list", "data": cards})


async def _model(gateway: Gateway, request: Request) -> Response:
    name = request.path_params["model"]
    model = gateway.catalog.get(name)
    return _json(_model_card(gateway, model, name if name in model.listed_names else None))


async def _info(gateway: Gateway, request: Request) -> Response:
    if not gateway.catalog.ordered:
        raise Unavailable("no replica has reported its model yet", "no_healthy_replica")
    model = gateway.catalog.get(request.query_params.get("model"))
    c = gateway.config
    return _json({
        "model_id": model.id, "model_dtype": model.dtype, "model_type": _model_type(model), "task": model.task,
        "sparse": bool(model.sparse_dimension),
        "family": model.family, "architecture": model.architecture, "normalize": model.normalize,
        "dimension": model.dimension, "max_input_length": model.max_seq_length,
        "max_batch_tokens": model.max_batch_tokens, "max_client_batch_size": gateway.config.max_inputs,
        "prompts": model.prompts, "default_prompt_name": model.default_prompt_name,
        "replicas": sum(r.healthy and r.model is model for r in gateway.pool.replicas), "version": "0.1.0",
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


async def _health(gateway: Gateway, request: Request) -> Response:
    if not gateway.pool.any_healthy():
        raise Unavailable("no replica is healthy", "no_healthy_replica")
    return _json({"status": "ok", "unix": time.time()})  # Infinity's clock field


async def _metrics(gateway: Gateway, request: Request) -> Response:
    return Response(gateway.metrics.exposition(), media_type="text/plain; version=0.0.4")


async def _openapi(gateway: Gateway, request: Request) -> Response:
    return _json(openapi_spec())


async def _docs(gateway: Gateway, request: Request) -> Response:
    return HTMLResponse(DOCS_HTML)


async def _docs_asset(gateway: Gateway, request: Request) -> Response:
    name = request.path_params["asset"]
    if name not in DOCS_ASSETS:
        raise NotFound(f"no route {request.url.path}", "not_found")
    return Response(docs_asset(name), media_type=DOCS_ASSETS[name], headers={"Cache-Control": "max-age=86400"})


async def _not_found(request: Request, exc: Exception) -> Response:
    """404 and 405, counted in the metrics under the route "unmatched" (scans and misconfigured clients show)."""
    error: ApiError = NotFound(f"no route {request.url.path}", "not_found")
    if isinstance(exc, HTTPException) and exc.status_code == 405:
        error = InvalidRequest(f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")
        error.status = 405
    request.app.state.gateway.metrics.requests.labels("unmatched", str(error.status)).inc()
    return error_response(error)


def create_app(config: GatewayConfig, metrics: GatewayMetrics | None = None) -> Starlette:
    gateway = Gateway(config, metrics)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gateway.pool.start()
        trimmer = asyncio.ensure_future(
            trim_when_idle(lambda: gateway.admission.requests, lambda: gateway.admission.answered)
        )
        yield
        trimmer.cancel()
        await gateway.pool.close()
        gateway.executor.shutdown(wait=False)

    embed, tei = (_endpoint("/", _tei_root, work=True, tei=True), _endpoint("/embed", _tei_embed, work=True, tei=True))
    openai_embeddings = _endpoint("/v1/embeddings", _openai_embeddings, work=True)
    routes = [
        # OpenAI's, and Infinity's without the /v1 prefix
        Route("/v1/embeddings", openai_embeddings, methods=["POST"]),
        Route("/embeddings", _endpoint("/embeddings", _openai_embeddings, work=True), methods=["POST"]),
        Route("/v1/models", _endpoint("/v1/models", _models), methods=["GET"]),
        Route("/models", _endpoint("/models", _models), methods=["GET"]),
        Route("/v1/models/{model:path}", _endpoint("/v1/models/{model}", _model), methods=["GET"]),
        # text-embeddings-inference's, with its error bodies
        Route("/", embed, methods=["POST"]),
        Route("/embed", tei, methods=["POST"]),
        Route("/embed_sparse", _endpoint("/embed_sparse", _tei_embed_sparse, work=True, tei=True), methods=["POST"]),
        Route("/embed_all", _endpoint("/embed_all", _tei_embed_all, work=True, tei=True), methods=["POST"]),
        Route("/similarity", _endpoint("/similarity", _similarity, work=True, tei=True), methods=["POST"]),
        Route("/rerank", _endpoint("/rerank", _rerank, work=True, tei=True), methods=["POST"]),
        Route("/predict", _endpoint("/predict", _predict, work=True, tei=True), methods=["POST"]),
        Route(
            "/tokenize", _endpoint("/tokenize", _tei_tokenize, work=True, tei=True, replicas=False), methods=["POST"]
        ),
        Route("/decode", _endpoint("/decode", _decode, work=True, tei=True, replicas=False), methods=["POST"]),
        Route("/info", _endpoint("/info", _info, tei=True), methods=["GET"]),
        Route("/health", _endpoint("/health", _health, public=True, tei=True), methods=["GET"]),
        # vLLM's (SageMaker's probe): the same answer as /health, on GET and POST
        Route("/ping", _endpoint("/ping", _health, public=True), methods=["GET", "POST"]),
        # Cohere's, Jina's and vLLM's
        Route("/v1/rerank", _endpoint("/v1/rerank", _v1_rerank, work=True), methods=["POST"]),
        Route("/score", _endpoint("/score", _score, work=True), methods=["POST"]),
        Route(
            "/v2/embed",
            _endpoint("/v2/embed", _cohere_v2_embed, work=True, errors=cohere_error_response),
            methods=["POST"],
        ),
        Route(
            "/v2/rerank",
            _endpoint("/v2/rerank", _cohere_v2_rerank, work=True, errors=cohere_error_response),
            methods=["POST"],
        ),
        Route("/v1/score", _endpoint("/v1/score", _score, work=True), methods=["POST"]),
        # Perplexity's
        Route(
            "/v1/contextualizedembeddings",
            _endpoint("/v1/contextualizedembeddings", _contextual_embeddings, work=True),
            methods=["POST"],
        ),
        Route(
            "/detokenize", _endpoint("/detokenize", _detokenize, work=True, replicas=False), methods=["POST"]
        ),  # vLLM's
        # Public, as TEI keeps them: a scraper, a load balancer's probe and a browser need no key.
        Route("/metrics", _endpoint("/metrics", _metrics, public=True), methods=["GET"]),
        Route("/openapi.json", _endpoint("/openapi.json", _openapi, public=True), methods=["GET"]),
        Route("/docs", _endpoint("/docs", _docs, public=True), methods=["GET"]),
        Route("/docs/{asset}", _endpoint("/docs/{asset}", _docs_asset, public=True), methods=["GET"]),
    ]
    middleware = [Middleware(RequestIds)]
    if config.cors_allow_origin:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_allow_origin),
                allow_methods=["GET", "POST"],
                allow_headers=["*"],
                expose_headers=["x-request-id", "retry-after"],
                max_age=600,
            )
        )
    app = Starlette(
        routes=routes, lifespan=lifespan, middleware=middleware, exception_handlers={404: _not_found, 405: _not_found}
    )
    app.state.gateway = gateway
    return app


def _utf8_size(text: str) -> int:
    """`len(text.encode())` without the copy for ASCII text (CPython knows a string is ASCII without a scan):
    estimating every request before it is refused must cost little when a flood of them is."""
    return len(text) if text.isascii() else len(text.encode())
