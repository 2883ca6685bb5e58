"""The OpenAPI 3.0.3 description of the gateway's routes, written out as data (the routes check their bodies by
hand), and the interactive docs page that renders it, with Swagger UI's files served by the gateway itself.

It states what the parsers take and what the handlers answer: each request field a route reads, with `nullable`
where null counts as left out and every spelling the parser accepts (TEI's "Right"); each route's 200 body; and
only the error statuses that route can answer, in its error shape (TEI's on TEI's routes). 3.0.3 rather than 3.1:
the bundled Swagger UI (4.15) renders no 3.1 document. tests/test_openapi.py validates the document, matches it
to the app's routes and parsers, and runs schemathesis against a real server with it.

To document a new value or field: an `encoding_format` is one entry in ROW_ENCODINGS (how its rows are answered;
the accepted names come from the parser), a request field one entry in its route's `*_FIELDS` table, a route one
`Operation` in OPERATIONS (pieces.py, requests.py, responses.py and document.py respectively).

The document is built in document.py from the schemas in pieces.py (shared pieces), requests.py and responses.py;
docs_page.py serves the page."""

from bouquet.gateway.openapi.docs_page import DOCS_ASSETS, DOCS_HTML, docs_asset
from bouquet.gateway.openapi.document import openapi_spec

__all__ = ["DOCS_ASSETS", "DOCS_HTML", "docs_asset", "openapi_spec"]
