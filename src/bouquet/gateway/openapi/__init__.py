"""The OpenAPI 3.0.3 description of the gateway's routes, and the interactive docs page that renders it, with
Swagger UI's files served by the gateway itself.

Each request body's schema is generated from the struct its route decodes it into (gateway/api/; structs.py turns
msgspec's JSON Schema into 3.0.3's dialect), so the document states exactly the fields, types, bounds and defaults
the decoder takes; what a type cannot say (a value among names, one of two fields) is stated beside the field in the
struct. The response bodies (responses.py, from the shared pieces in pieces.py), each route's error statuses in its
error shape (TEI's on TEI's routes) and the operations (document.py) are written out as data. 3.0.3 rather than
3.1: the bundled Swagger UI (4.15) renders no 3.1 document. tests/test_openapi.py validates the document, matches it
to the app's routes and runs schemathesis against a real server with it; tests/test_docs_page.py renders the page in
a headless browser, offline.

To document a new value or field: an `encoding_format` is one entry in ROW_ENCODINGS (how its rows are answered;
the accepted names come from encodings.FORMATS), a request field one field of its route's struct, a route one
`Operation` in OPERATIONS (pieces.py, gateway/api/ and document.py respectively)."""

from bouquet.gateway.openapi.docs_page import DOCS_ASSETS, DOCS_HTML, docs_asset
from bouquet.gateway.openapi.document import openapi_spec

__all__ = ["DOCS_ASSETS", "DOCS_HTML", "docs_asset", "openapi_spec"]
