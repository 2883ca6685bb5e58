"""A `multipart/form-data` body (RFC 7578), already read within its size limit (body.py), split into its parts:
each part's field name, file name (None for a plain field) and bytes, in order. The body is bytes in memory, so
the parts are slices of it; nothing is spooled to disk. A malformed body is a 400."""

from __future__ import annotations

from dataclasses import dataclass
from email.message import Message

from bouquet.gateway.errors import InvalidRequest

MAX_PARTS = 4096  # a bound on the work a body of tiny parts can cause
MAX_PART_HEADER_BYTES = 4096


@dataclass(frozen=True)
class Part:
    name: str
    filename: str | None
    content_type: str | None
    data: bytes


def boundary(content_type: str) -> bytes:
    """The boundary the Content-Type header names; 400 without one."""
    header = Message()
    header["content-type"] = content_type
    value = header.get_param("boundary")
    if not isinstance(value, str) or not 0 < len(value) <= 70:
        raise InvalidRequest("a multipart/form-data body needs a boundary (1-70 characters)", "invalid_multipart")
    return value.encode("latin-1")


def parse_parts(body: bytes, content_type: str) -> list[Part]:
    """The body's parts in order (the preamble before the first boundary and the epilogue after the last ignored,
    as RFC 2046 says)."""
    delimiter = b"--" + boundary(content_type)
    start = body.find(delimiter)
    if start < 0 or (start > 0 and body[start - 2 : start] != b"\r\n"):
        raise _malformed("it holds no boundary line")
    parts: list[Part] = []
    position = start + len(delimiter)
    while not body.startswith(b"--", position):  # the closing delimiter ends with "--"
        if not body.startswith(b"\r\n", position):
            raise _malformed("a boundary line does not end in CRLF")
        end = body.find(b"\r\n" + delimiter, position)
        if end < 0:
            raise _malformed("it ends before its closing boundary")
        parts.append(_part(body[position + 2 : end]))
        if len(parts) > MAX_PARTS:
            raise _malformed(f"it has over {MAX_PARTS} parts")
        position = end + 2 + len(delimiter)
    return parts


def _part(raw: bytes) -> Part:
    headers, separator, data = raw.partition(b"\r\n\r\n")
    if not separator:
        if raw.startswith(b"\r\n"):  # a part without headers
            headers, data = b"", raw[2:]
        else:
            raise _malformed("a part's headers do not end in a blank line")
    if len(headers) > MAX_PART_HEADER_BYTES:
        raise _malformed("a part's headers are over 4 KB")
    message = Message()
    for line in headers.decode("utf-8", "replace").split("\r\n"):
        key, colon, value = line.partition(":")
        if line and not colon:
            raise _malformed(f"a part's header line {line[:40]!r} has no colon")
        if line:
            message[key.strip()] = value.strip()
    if message.get_content_disposition() != "form-data":
        raise _malformed("a part has no Content-Disposition: form-data")
    name = message.get_param("name", header="content-disposition")
    if not isinstance(name, str):
        raise _malformed("a part's Content-Disposition has no name")
    filename = message.get_filename()
    content_type = message["content-type"]
    return Part(name, filename, str(content_type) if content_type is not None else None, data)


def _malformed(why: str) -> InvalidRequest:
    return InvalidRequest(f"the multipart/form-data body is malformed: {why}", "invalid_multipart")
