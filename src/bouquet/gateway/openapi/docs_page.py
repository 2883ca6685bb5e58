"""The interactive docs page (/docs), which renders /openapi.json with Swagger UI's files served by the gateway."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from swagger_ui_bundle import swagger_ui_path

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


@cache
def docs_asset(name: str) -> bytes:
    """One of DOCS_ASSETS, read once."""
    assert name in DOCS_ASSETS, f"{name!r} is not a docs asset"
    return Path(swagger_ui_path, name).read_bytes()
