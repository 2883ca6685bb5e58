"""An error as each API answers it (the bodies and statuses are errors.py's): OpenAI's body, Cohere's, the Open
Inference Protocol's, or TEI's with TEI's status."""

from __future__ import annotations

import orjson
from starlette.responses import Response

from bouquet.gateway.errors import ApiError, error_body, tei_error


def error_response(error: ApiError) -> Response:
    return Response(error_body(error), error.status, error.headers, media_type="application/json")


def cohere_error_response(error: ApiError) -> Response:
    """Cohere's error body, `{"message"}`, which its SDK raises as the status's error class."""
    body = orjson.dumps({"message": error.message})
    return Response(body, error.status, error.headers, media_type="application/json")


def tei_error_response(error: ApiError) -> Response:
    status, error_type = tei_error(error)
    body = orjson.dumps({"error": error.message, "error_type": error_type})
    return Response(body, status, error.headers, media_type="application/json")


def kserve_error_response(error: ApiError) -> Response:
    """The Open Inference Protocol's error body, `{"error": message}`."""
    body = orjson.dumps({"error": error.message})
    return Response(body, error.status, error.headers, media_type="application/json")
