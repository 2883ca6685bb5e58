"""Every error a client can see, and how each API spells it (http/error_responses.py sends it): OpenAI's
`{"error": {"message", "type", "param", "code"}}`, or on text-embeddings-inference's routes TEI's own
`{"error", "error_type"}` with TEI's status for that kind of error (its router's ErrorType -> StatusCode: an empty
batch 400 `empty`, a limit 413 `validation`, a tokenizer failure 422 `tokenizer`, overload 429 `overloaded`, no
healthy backend 503 `unhealthy`, a failed or wrong-type model 424 `backend`), so Hugging Face's clients read it."""

from __future__ import annotations

import orjson


class ApiError(Exception):
    """An error answered to the client as is; `status` is the HTTP status."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, code: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}


class InvalidRequest(ApiError):
    """The body is malformed or holds a value the model cannot take (400)."""


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"


class NotFound(ApiError):
    status = 404


class RequestTimeout(ApiError):
    """A request's headers or body stopped arriving for longer than their timeout (408); the connection closes."""

    status = 408


class UnsupportedMedia(ApiError):
    """A body in an encoding the gateway does not read (415)."""

    status = 415


class TooLarge(ApiError):
    """Over a size limit: payload bytes, inputs, tokens, or an input over the model's limit with truncate=false."""

    status = 413


class HeadersTooLarge(ApiError):
    """The request line and headers are over the gateway's limit (431); the connection closes."""

    status = 431


class Unprocessable(ApiError):
    """Well-formed JSON of the wrong shape or type (422)."""

    status = 422


class Overloaded(ApiError):
    status = 429
    type = "rate_limit_error"


class NotReady(ApiError):
    """The Open Inference Protocol's health answer "false" on REST: a 4xx, as the protocol's health API says (400, as
    Triton answers); its gRPC twin answers `ready: false` instead."""


class Unavailable(ApiError):
    """No healthy replica can serve the model now (503)."""

    status = 503
    type = "server_error"


class ClientClosed(ApiError):
    """The client went away before its answer was ready; its chunks were cancelled (nginx's 499)."""

    status = 499


class InternalError(ApiError):
    status = 500
    type = "server_error"


def error_body(error: ApiError) -> bytes:
    return orjson.dumps(
        {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
    )


_UNREADABLE_BODY = ("invalid_json", "invalid_utf8", "invalid_gzip")  # 400 on every route, as axum answers them


def tei_error(error: ApiError) -> tuple[int, str]:
    """TEI's status and `error_type` for `error`: its router's ErrorType variant names as serde writes them
    (capitalised); kinds TEI has no variant for keep the OpenAI type."""
    if error.code == "empty_input":
        return 400, "Empty"
    if error.code == "missing_required_parameter":
        return 422, "Validation"  # a body without a required field is one of the wrong shape (axum's 422)
    if error.code == "wrong_task":
        return 424, "Backend"  # TEI: "model is not a re-ranker model" and the like
    if isinstance(error, Unavailable) and error.code in ("no_healthy_replica", "shutting_down"):
        return 503, "Unhealthy"
    if isinstance(error, Unavailable):
        return 424, "Backend"
    if isinstance(error, Overloaded):
        return 429, "Overloaded"
    if error.code == "unsupported_parameter":
        return 422, "Validation"  # a field the route does not have: a body of the wrong shape
    if isinstance(error, InvalidRequest) and error.status == 400 and error.code not in _UNREADABLE_BODY:
        return 413, "Validation"  # TEI's Validation: a bad dimensions or prompt_name, an id out of the vocabulary
    return error.status, "Validation" if error.status in (400, 413, 422) else error.type


def shutting_down() -> Unavailable:
    """What a request still unanswered when the gateway's drain ends gets: a 503 its client retries (on another
    gateway, behind a balancer), never the 500 the server's own cancellation would answer."""
    return Unavailable(
        "the gateway is shutting down before this request could be answered; retry it",
        "shutting_down",
        headers={"Retry-After": "1", "Connection": "close"},
    )
