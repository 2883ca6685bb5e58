"""`x-request-id` on every answer: the client's own when it sent a usable one (so its logs and ours share the
id), else a new one; kept in a context variable so the gateway's log lines about a request can name it."""

from __future__ import annotations

import contextvars
import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
_USABLE = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")  # what is safe to echo into a header and a log line
current: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == HEADER:
            given: str = value.decode("latin-1")
            if _USABLE.fullmatch(given):
                return given
    return uuid.uuid4().hex


class RequestIds:
    """ASGI middleware: every HTTP answer carries `x-request-id`, 404s and errors included."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        header = (HEADER, request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        token = current.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current.reset(token)
