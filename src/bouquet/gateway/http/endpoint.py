"""The wrapper every route runs through (`endpoint`): authorisation, the request lanes, metrics, and errors turned
into the route's error body in one place (errors.py); and what handlers share: a JSON answer, work cancelled when
its client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import numpy as np
import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from bouquet.gateway.errors import (
    ApiError,
    ClientClosed,
    InternalError,
    InvalidRequest,
    NotFound,
    Unauthorized,
    shutting_down,
)
from bouquet.gateway.http import request_ids
from bouquet.gateway.http.body import refuse_unread
from bouquet.gateway.http.error_responses import error_response, tei_error_response
from bouquet.gateway.service import Service

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_NUMPY = orjson.OPT_SERIALIZE_NUMPY
Handler = Callable[[Service, Request], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


def endpoint(
    route: str, handler: Handler, *, public: bool = False, work: bool = False, tei: bool = False,
    replicas: bool = True, errors: Callable[[ApiError], Response] | None = None,
) -> Endpoint:  # fmt: skip
    """`work`: the route reads a body and computes, and counts against `max_concurrent_requests`; on the
    replicas unless `replicas` is False (the tokenizer's routes). `tei`: a text-embeddings-inference route, whose
    errors have TEI's body and status; `errors`: another API's error body (Cohere's)."""
    answer_error = errors or (tei_error_response if tei else error_response)

    async def run(request: Request) -> Response:
        service: Service = request.app.state.service
        metrics = service.metrics
        started = time.perf_counter()
        metrics.in_flight.inc()
        try:
            if not public:
                authorize(service, request)
            with service.admission.request() if work else contextlib.nullcontext():
                if work and replicas:
                    await refuse_unread(service, request)
                response = await handler(service, request)
        except ApiError as error:
            response = answer_error(error)
        except asyncio.CancelledError:
            if not service.draining:
                raise
            # The server's own end of the drain cancels what is left, and would answer 500: answer 503 instead.
            response = answer_error(shutting_down())
        except Exception:
            logger.exception("%s failed (request %s)", route, request_ids.current.get())
            response = answer_error(InternalError("internal error; see the gateway's log", "internal_error"))
        finally:
            metrics.in_flight.dec()
        metrics.requests.labels(route, str(response.status_code)).inc()
        metrics.request_seconds.labels(route).observe(time.perf_counter() - started)
        return response

    return run


def authorize(service: Service, request: Request) -> None:
    """`Authorization: Bearer KEY`, the scheme in any case (RFC 7235); a refusal names the scheme to use."""
    key = service.config.api_key
    if not key:
        return
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise Unauthorized(
            "a valid API key is required: send 'Authorization: Bearer KEY'",
            "invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="bouquet"'},
        )


def json_response(value: Any, status: int = 200) -> Response:
    """`value` as JSON; structs (http/decode.ResponseBody), or a list of them, become builtins first, numpy rows
    left for orjson, which writes their numbers from the array itself."""
    if isinstance(value, msgspec.Struct | list):
        value = msgspec.to_builtins(value, builtin_types=(np.ndarray,), enc_hook=_numpy_scalar)
    return Response(orjson.dumps(value, option=_NUMPY), status, media_type="application/json")


def _numpy_scalar(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


async def openai_errors(answer: Awaitable[Response]) -> Response:
    """Errors in OpenAI's body for a request in another server's shape on a TEI route (Cohere's, Jina's, Infinity's
    and vLLM's /rerank with documents, vLLM's /tokenize with a prompt): their clients read `error.message`."""
    try:
        return await answer
    except ApiError as error:
        return error_response(error)


async def unless_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """Runs `work`, cancelling it if the client goes away first (its gRPC calls are cancelled with it, so the
    replicas drop the chunks still queued instead of computing rows nobody will read). The service cancels it
    when the gateway's drain ends first: then the client is told to retry (503).

    `work` runs in the request's own task, a watcher task beside it cancelling it: a task of its own would cost a
    turn of the event loop to start and another to hand its result back, on every request."""
    service: Service = request.app.state.service
    task = asyncio.current_task()
    assert task is not None, "a request is handled in a task"
    watcher = asyncio.ensure_future(_disconnected(request))
    stop = _StopOnDisconnect(task)
    watcher.add_done_callback(stop)
    service.work.add(task)
    try:
        return await work
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            task.uncancel()
            raise ClientClosed(
                "the client closed the connection before the embeddings were ready", "client_closed"
            ) from None
        if service.drain_ended:
            task.uncancel()
            raise shutting_down() from None
        raise
    finally:
        stop.armed = False  # its callback may already be on the loop's queue, past removing
        service.work.discard(task)
        watcher.cancel()


class _StopOnDisconnect:
    """The watcher's done-callback: the client went away, so the request's work stops; once the work has ended (or
    the watcher was cancelled for it) it does nothing, whatever the task is doing by then."""

    def __init__(self, task: asyncio.Task[Any]):
        self.task = task
        self.armed = True

    def __call__(self, watcher: asyncio.Future[None]) -> None:
        if self.armed and not watcher.cancelled():
            self.task.cancel()


async def _disconnected(request: Request) -> None:
    # The body has been read: the next ASGI message on this connection is the client going away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def not_found(request: Request, exc: Exception) -> Response:
    """404 and 405, counted in the metrics under the route "unmatched" (scans and misconfigured clients show)."""
    error: ApiError = NotFound(f"no route {request.url.path}", "not_found")
    if isinstance(exc, HTTPException) and exc.status_code == 405:
        error = InvalidRequest(f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")
        error.status = 405
    request.app.state.service.metrics.requests.labels("unmatched", str(error.status)).inc()
    return error_response(error)
