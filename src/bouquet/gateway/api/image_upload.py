"""Images sent as their bytes to Infinity's `/embeddings_image` (api/openai.py sends such a body here), besides its
JSON body of data URIs and base64:
- a body that is one image file, `Content-Type: image/*` or `application/octet-stream`, as Hugging Face's Inference
  API takes an image (`curl --data-binary @cat.jpg -H 'Content-Type: image/jpeg'`); the options in the query
  string (`?model=clip&encoding_format=base64&dimensions=64`); the image is named `input` in a refusal;
- `multipart/form-data`, as a browser's form, `requests.post(files=...)` and httpx's `files=` send it: every file
  part is an image, in order, named by its field (`input[0]`, `input[1]`, or `file[0]`); the options as text fields.
The options are `/embeddings_image`'s JSON fields: `model`, `encoding_format` (with vLLM's `embed_dtype` and
`endianness`), `dimensions`, `user`, `modality`; another is refused by name unless --allow-unknown-fields.

Bounds: a lone image's body at `--max-image-bytes` (refused by its Content-Length before a byte is read, else
while it streams); a multipart body at the larger of that and `--max-payload-bytes`, each file at
`--max-image-bytes`. The images are then decoded as every image is (images.py)."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.requests import Request

from bouquet.batch import RowOptions
from bouquet.gateway.api.fields import refuse_unless, response_format
from bouquet.gateway.errors import InvalidRequest, TooLarge
from bouquet.gateway.http.body import content_length, read_body
from bouquet.gateway.http.multipart import parse_parts
from bouquet.gateway.images import ImageEmbedJob
from bouquet.gateway.service import Service

OPTIONS = ("model", "encoding_format", "embed_dtype", "endianness", "dimensions", "user", "modality")


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").partition(";")[0].strip().lower()


def is_upload(request: Request) -> bool:
    """Whether the body is an image's bytes or a form of them, not JSON."""
    media = media_type(request)
    return media.startswith("image/") or media in ("application/octet-stream", "multipart/form-data")


async def upload_job(service: Service, request: Request) -> ImageEmbedJob:
    config = service.config
    if media_type(request) != "multipart/form-data":
        body = await _read(service, request, config.max_image_bytes, "input")
        return _job(service, [bytes(body)], ["input"], request.query_params.multi_items())
    body = await _read(service, request, max(config.max_payload_bytes, config.max_image_bytes), None)
    parts = parse_parts(bytes(body), request.headers["content-type"])
    files = [part for part in parts if part.filename is not None]
    if not files:
        raise InvalidRequest("the form holds no image file (a part with a filename)", "missing_required_parameter")
    counts: dict[str, int] = {}
    names = []
    for part in files:
        names.append(f"{part.name}[{counts.setdefault(part.name, 0)}]")
        counts[part.name] += 1
    fields = [(part.name, part.data.decode("utf-8", "replace")) for part in parts if part.filename is None]
    return _job(service, [part.data for part in files], names, fields)


async def _read(service: Service, request: Request, limit: int, name: str | None) -> bytes | bytearray:
    """The body within `limit`, a refusal naming the image when the body is one."""
    what = f"{name} (the body)" if name else "the body"
    length = content_length(request)
    if length is not None and length > limit:
        raise TooLarge(f"{what} has {length} bytes, over the limit of {limit}", "payload_too_large", name)
    try:
        return await read_body(service, request, limit)
    except TooLarge:
        raise TooLarge(f"{what} is over the limit of {limit} bytes", "payload_too_large", name) from None


def _job(service: Service, images: list[bytes], names: list[str], fields: Iterable[tuple[str, str]]) -> ImageEmbedJob:
    """The options of the query string or the form's text fields, each given once."""
    options: dict[str, str] = {}
    for key, value in fields:
        if key not in OPTIONS:
            if service.config.allow_unknown_fields:
                continue
            raise InvalidRequest(f"'{key}' is not a field of this route", "unsupported_parameter", key)
        if key in options:
            raise InvalidRequest(f"'{key}' is given twice", "invalid_value", key)
        options[key] = value
    refuse_unless(options.get("modality"), "modality", "image", "this route embeds images")
    formats = response_format(options.get("encoding_format"), options.get("embed_dtype"), options.get("endianness"))
    row_options = RowOptions(_dimensions(options.get("dimensions")), None, encoding=formats.encoding)
    return ImageEmbedJob(options.get("model") or None, list(images), names, row_options, formats)


def _dimensions(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    if not value.isdigit() or int(value) < 1:
        raise InvalidRequest(f"'dimensions' must be a positive integer, not {value!r}", "invalid_value", "dimensions")
    return int(value)
