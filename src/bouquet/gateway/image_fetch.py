"""Image URLs in requests, fetched only from the origins an operator lists (`--image-url-origin`); with none listed
(the default) nothing is fetched and a URL is refused as images.py refuses it (server-side request forgery).

What a fetch may reach, and how long it may take:
- the URL's origin (scheme, host, port) is one the list names exactly, and so is every redirect's (at most
  `MAX_REDIRECTS`); any other scheme (file:, ftp:, s3:) is refused;
- a host the list names by name must resolve to public addresses only: a name that resolves to a loopback,
  private, link-local (the cloud metadata service's 169.254.169.254) or otherwise non-global address is refused,
  so that a DNS record cannot point the gateway inward. An internal server is reached only when the list names
  its address itself (`http://10.0.0.5:8000`, `http://127.0.0.1:9000`): that is the operator's explicit choice;
- the connection goes to the address checked (the name is resolved once, here), never resolved again by a client
  library, so a record that changes between the check and the connection (DNS rebinding) changes nothing; TLS
  still verifies the certificate against the name;
- one deadline covers the connection, every redirect and the body (`--image-url-timeout`); the body is counted as
  it streams and cut at `--max-image-bytes` whatever its Content-Length says;
- the bytes are then decoded as an inline image is (images.py: format, pixels, corruption), so the response's
  Content-Type decides nothing.
Every refusal is a 400 naming the input (`input[2]`), counted by reason (fetch_answer.REFUSALS) in the gateway's metrics
beside the URLs fetched and their bytes. An IPv6 origin is listed with its address in brackets
(`http://[2001:db8::5]:8000`); an address compares in its canonical form, however a URL spells it. The answer is read
by fetch_answer.py, with the standard library's streams: the gateway needs no HTTP client library."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING
from urllib.parse import quote, urljoin, urlsplit

from bouquet.gateway.errors import TooLarge
from bouquet.gateway.fetch_answer import MAX_HEAD_BYTES, FetchRefused, read_answer

if TYPE_CHECKING:
    from bouquet.config import GatewayConfig
    from bouquet.gateway.metrics import GatewayMetrics

MAX_REDIRECTS = 3
CONCURRENT_FETCHES = 8  # a request's URLs fetched at once
# A request's fetched bytes: a small body of many URLs must not make the gateway download gigabytes. The bodies in
# flight when the total passes it add at most CONCURRENT_FETCHES x --max-image-bytes.
MAX_REQUEST_FETCH_BYTES = 64 * 1024 * 1024
DEFAULT_PORTS = {"http": 80, "https": 443}
REDIRECTS = (301, 302, 303, 307, 308)
PATH_SAFE = "/%:@!$&'()*+,;=-._~"  # RFC 3986's path characters, and escapes kept as sent

Origin = tuple[str, str, int]  # scheme, host (lower case, an IPv6 address without brackets), port


def parse_origin(text: str) -> Origin:
    """`scheme://host[:port]` as the list and a URL's origin compare; ValueError for anything else."""
    parts = urlsplit(text.strip())
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"{text!r} is not an http:// or https:// origin (scheme://host[:port])")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{text!r} holds credentials; an origin is scheme://host[:port]")
    port = parts.port if parts.port is not None else DEFAULT_PORTS[scheme]
    address = _ip(parts.hostname)  # one address, one spelling: [0:0::1] is [::1]
    return scheme, parts.hostname.lower() if address is None else address.compressed, port


def is_url(source: str | bytes) -> bool:
    return isinstance(source, str) and source[:8].lower().startswith(("http://", "https://"))


@dataclass(frozen=True)
class UrlFetcher:
    origins: frozenset[Origin]
    timeout: float  # seconds for one URL: connection, redirects and body
    max_bytes: int  # of one image's body
    tls: ssl.SSLContext = field(default_factory=ssl.create_default_context, compare=False)

    async def fetch(self, url: str, name: str) -> bytes:
        """The body of `url` (after its allowed redirects), within the deadline and the byte cap."""
        try:
            async with asyncio.timeout(self.timeout):
                for _ in range(MAX_REDIRECTS + 1):
                    origin, target = self._allowed(url, name)
                    address = await self._address(origin, name)
                    status, location, body = await self._get(origin, address, target, name)
                    if status not in REDIRECTS:
                        break
                    if location is None:
                        raise _failed(name, _shown(url), f"answered {status} without a Location", "bad_answer")
                    url = urljoin(url, location)
                else:
                    raise _failed(name, _shown(url), f"redirected more than {MAX_REDIRECTS} times", "bad_answer")
        except TimeoutError:
            raise FetchRefused(
                f"{name}: fetching {_shown(url)} took over {self.timeout:g} s", "image_url_timeout", name, "timeout"
            ) from None
        if status != 200:
            raise _failed(name, _shown(url), f"answered HTTP {status}", "bad_answer")
        return body

    def _allowed(self, url: str, name: str) -> tuple[Origin, str]:
        """The URL's origin, if listed, and its request target (path and query)."""
        try:
            origin = parse_origin(url)
            parts = urlsplit(url)
        except ValueError:
            origin = None
        if origin is None or origin not in self.origins:
            raise FetchRefused(
                f"{name}: {_shown(url)} is not on an origin this server fetches images from (--image-url-origin); "
                "send the image inline, as a data URI or base64",
                "image_url_refused",
                name,
                "not_listed",
            )
        path = quote(parts.path or "/", safe=PATH_SAFE)  # a space or a control character would break the request
        return origin, path + (f"?{quote(parts.query, safe=PATH_SAFE + '?')}" if parts.query else "")

    async def _address(self, origin: Origin, name: str) -> str:
        """The address to connect to: a listed address itself, or a listed name's first address if every address
        it resolves to is public."""
        _, host, port = origin
        if _ip(host) is not None:
            return host
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as error:
            raise _failed(name, host, f"does not resolve ({error})", "unreachable") from None
        addresses = [str(info[4][0]) for info in infos]
        inward = [a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_global]
        if inward or not addresses:
            raise FetchRefused(
                f"{name}: {host} resolves to {', '.join(inward) or 'nothing'}, not a public address; a private or "
                "loopback server is fetched from only when --image-url-origin names its address",
                "image_url_refused",
                name,
                "inward_address",
            )
        return addresses[0]

    async def _get(self, origin: Origin, address: str, target: str, name: str) -> tuple[int, str | None, bytes]:
        scheme, host, port = origin
        tls = self.tls if scheme == "https" else None
        try:  # to the address checked; TLS verifies the certificate against the name
            reader, writer = await asyncio.open_connection(
                address, port, limit=MAX_HEAD_BYTES, ssl=tls, server_hostname=host if tls else None
            )
        except (OSError, ssl.SSLError) as error:
            raise _failed(name, _origin_text(origin), f"refused the connection ({error})", "unreachable") from None
        try:
            authority = f"[{host}]" if ":" in host else host
            if port != DEFAULT_PORTS[scheme]:
                authority += f":{port}"
            writer.write(
                f"GET {target} HTTP/1.1\r\nHost: {authority}\r\nAccept: image/*\r\nUser-Agent: bouquet\r\n"
                "Connection: close\r\n\r\n".encode("latin-1")
            )
            answer = await read_answer(reader, self.max_bytes, name)
            return answer.status, answer.headers.get("location"), answer.body
        except (OSError, ssl.SSLError) as error:
            raise _failed(name, _origin_text(origin), f"failed mid-answer ({error})", "unreachable") from None
        finally:
            writer.close()


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _over_total(name: str, metrics: GatewayMetrics) -> TooLarge:
    metrics.image_fetch_refusals.labels("too_large").inc()
    return TooLarge(
        f"{name}: the request's image URLs come to over {MAX_REQUEST_FETCH_BYTES} bytes; send fewer a request",
        "image_too_large",
        name,
    )


def _shown(url: str) -> str:
    """A URL as an error message quotes it: a client's URL may be as long as its body."""
    return url if len(url) <= 200 else url[:200] + "..."


def _failed(name: str, where: str, what: str, reason: str) -> FetchRefused:
    return FetchRefused(f"{name}: {where} {what}", "image_url_failed", name, reason)


def _origin_text(origin: Origin) -> str:
    scheme, host, port = origin
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


@lru_cache(maxsize=8)
def _fetcher(origins: tuple[str, ...], timeout: float, max_bytes: int) -> UrlFetcher:
    return UrlFetcher(frozenset(parse_origin(origin) for origin in origins), timeout, max_bytes)


def url_fetcher(config: GatewayConfig) -> UrlFetcher | None:
    """The gateway's fetcher, None when no origin is listed (nothing is fetched)."""
    if not config.image_url_origins:
        return None
    return _fetcher(config.image_url_origins, config.image_url_timeout, config.max_image_bytes)


async def fetch_urls(
    config: GatewayConfig, sources: Sequence[str | bytes], names: Sequence[str], metrics: GatewayMetrics
) -> list[str | bytes]:
    """`sources` with each http(s) URL replaced by its image's bytes when the operator allows fetching; otherwise
    as they are (images.py refuses a URL)."""
    urls = sum(1 for source in sources if is_url(source))
    fetcher = url_fetcher(config)
    if fetcher is None or not urls:
        metrics.image_fetch_refusals.labels("no_origins").inc(urls)
        return list(sources)
    gate = asyncio.Semaphore(CONCURRENT_FETCHES)
    fetched = 0

    async def one(source: str | bytes, name: str) -> str | bytes:
        nonlocal fetched
        if not isinstance(source, str) or not is_url(source):
            return source
        async with gate:
            if fetched > MAX_REQUEST_FETCH_BYTES:
                raise _over_total(name, metrics)
            try:
                body = await fetcher.fetch(source, name)
            except FetchRefused as error:
                metrics.image_fetch_refusals.labels(error.reason).inc()
                raise
        metrics.image_fetches.inc()
        metrics.image_fetch_bytes.inc(len(body))
        fetched += len(body)
        if fetched > MAX_REQUEST_FETCH_BYTES:
            raise _over_total(name, metrics)
        return body

    return list(await asyncio.gather(*(one(source, name) for source, name in zip(sources, names, strict=True))))
