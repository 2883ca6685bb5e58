"""The operator's routes, public as TEI keeps them (a scraper, a load balancer's probe and a browser need no key):
`GET /metrics` (Prometheus), `/openapi.json`, and the interactive docs page `/docs` with Swagger UI's files."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from bouquet.gateway.errors import NotFound
from bouquet.gateway.http.endpoint import endpoint, json_response
from bouquet.gateway.openapi import DOCS_ASSETS, DOCS_HTML, docs_asset, openapi_spec
from bouquet.gateway.service import Service


def routes() -> list[Route]:
    return [
        Route("/metrics", endpoint("/metrics", _metrics, public=True), methods=["GET"]),
        Route("/openapi.json", endpoint("/openapi.json", _openapi, public=True), methods=["GET"]),
        Route("/docs", endpoint("/docs", _docs, public=True), methods=["GET"]),
        Route("/docs/{asset}", endpoint("/docs/{asset}", _docs_asset, public=True), methods=["GET"]),
    ]


async def _metrics(service: Service, request: Request) -> Response:
    return Response(service.metrics.exposition(), media_type="text/plain; version=0.0.4")


async def _openapi(service: Service, request: Request) -> Response:
    return json_response(openapi_spec())


async def _docs(service: Service, request: Request) -> Response:
    return HTMLResponse(DOCS_HTML)


async def _docs_asset(service: Service, request: Request) -> Response:
    name = request.path_params["asset"]
    if name not in DOCS_ASSETS:
        raise NotFound(f"no route {request.url.path}", "not_found")
    return Response(docs_asset(name), media_type=DOCS_ASSETS[name], headers={"Cache-Control": "max-age=86400"})
