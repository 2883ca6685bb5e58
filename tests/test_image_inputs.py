"""Images as raw bytes and as URLs, over real HTTP on loopback to a tiny CLIP (random weights, saved by transformers
with its image processor) behind the real gateway:
- raw bytes on `/embeddings_image`: a body that is the image (`Content-Type: image/png`, options in the query
  string) and multipart/form-data uploads sent by httpx's and requests' `files=`, each row against transformers'
  processor and `get_image_features` (cosine >= 0.99999) and equal to the same image sent as a data URI; bodies over
  --max-image-bytes (declared or chunked), bad files and malformed forms refused 4xx naming the input;
- URLs, fetched only from the origins --image-url-origin lists: a threaded http.server on loopback serves images;
  an image fetched from a listed origin (on each image route, and through a redirect within it) embeds equal to the
  same image inline; an origin not listed, a listed name that resolves to loopback, a redirect off the list, a body
  over the cap (with and without a Content-Length), a server that answers too slowly, a 404: each a 400 naming the
  input; with no origin listed a URL is refused and the image server never asked."""

from __future__ import annotations

import base64
import http.server
import shutil
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import requests
import torch
from in_process import engines, served
from PIL import Image
from qwen3_vl_models import save_qwen3_vl_with_tokenizer
from test_clip import _clip, _save
from test_image_api import _assert_close, _data_uri, _file, _image, _processor, _reference, _rows
from test_replica_tls import make_certificates

from bouquet.config import GatewayConfig
from bouquet.gateway import image_fetch

MAX_IMAGE_BYTES = 200_000
FETCH_TIMEOUT = 1.0  # the slow route answers after SLOW_SECONDS: the deadline, not the test, ends it
SLOW_SECONDS = 30.0
PICTURES = {f"/{index}.png": _file(_image(w, h, index)) for index, (w, h) in enumerate([(50, 80), (33, 21), (64, 64)])}
PICTURES["/photo.jpg"] = _file(_image(90, 61, 8), "JPEG")
FIELDS_ONLY = b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\ntiny-clip\r\n--x--\r\n'
NOISE = np.random.default_rng(0).integers(0, 256, (400, 400, 3), dtype=np.uint8)


class _Images(http.server.BaseHTTPRequestHandler):
    """The image server: pictures, redirects, an endless body, a slow answer, and a count of what it was asked."""

    protocol_version = "HTTP/1.1"
    asked: list[str] = []  # noqa: RUF012 (the class's one log, read by the tests)
    stop = threading.Event()
    other_origin = ""

    def do_GET(self) -> None:
        type(self).asked.append(self.path)
        if self.path in PICTURES:
            return self._send(200, PICTURES[self.path], {"Content-Type": "image/png"})
        if self.path == "/redirect-in":
            return self._send(302, b"", {"Location": "/1.png"})
        if self.path == "/redirect-out":
            return self._send(302, b"", {"Location": f"{self.other_origin}/1.png"})
        if self.path == "/declared-large":
            return self._send(200, b"\0" * (MAX_IMAGE_BYTES + 1), {"Content-Type": "image/png"})
        if self.path in ("/endless", "/lying-length"):
            self.send_response(200)
            if self.path == "/lying-length":  # says small, then never stops: only the close would end it
                self.send_header("Content-Length", "100")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            return self._stream() if self.path == "/endless" else self._write(b"\x89PNG" + b"\0" * 96)
        if self.path in ("/chunked.png", "/chunked-large"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            data = PICTURES["/0.png"] if self.path == "/chunked.png" else b"\0" * (MAX_IMAGE_BYTES + 1)
            for start in range(0, len(data), 1000):
                self._write(b"%x\r\n%s\r\n" % (len(data[start : start + 1000]), data[start : start + 1000]))
            self._write(b"0\r\n\r\n")
            return None
        if self.path == "/slow.png":
            self.stop.wait(SLOW_SECONDS)
            return self._send(200, PICTURES["/0.png"], {})
        return self._send(404, b"not here", {})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        self._write(body)

    def _stream(self) -> None:
        for _ in range(1000):  # 64 MB at most, far over the cap: the gateway hangs up first
            if not self._write(b"\0" * 65536):
                return

    def _write(self, data: bytes) -> bool:
        try:
            self.wfile.write(data)
            return True
        except OSError:  # the gateway hung up: what a cap does
            return False

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    _Images.other_origin = f"http://127.0.0.2:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    _Images.stop.set()
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def clip(tmp_path_factory, minilm_path: Path) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("image-inputs") / "tiny-clip"
    model = _save(_clip(eos_token_id=102), path, minilm_path)
    _processor("clip").save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def built(clip) -> Iterator[list]:
    with engines(clip[0]) as running:
        yield running


@pytest.fixture(scope="module")
def server(built, image_server: str) -> Iterator[httpx.Client]:
    """The gateway on a loopback port, fetching from the image server's origin and from `localhost` (a name that
    resolves to loopback: listed, yet refused)."""
    port = image_server.rsplit(":", 1)[1]
    origins = (image_server, f"http://localhost:{port}")
    with (
        served(
            built, listen=True, max_image_bytes=MAX_IMAGE_BYTES, image_url_origins=origins,
            image_url_timeout=FETCH_TIMEOUT,
        ) as running,
        httpx.Client(base_url=running.url, timeout=120) as client,
    ):  # fmt: skip
        yield client


@pytest.fixture(scope="module")
def models(clip) -> dict[str, tuple[Path, torch.nn.Module]]:
    return {"clip": clip}


# ---- raw bytes ------------------------------------------------------------------------------------------------


def test_an_image_body_embeds_as_the_same_image_inline(server: httpx.Client, models) -> None:
    files = [PICTURES["/0.png"], PICTURES["/photo.jpg"]]
    expected = _reference("clip", models, files)
    for data, kind, row in zip(files, ("image/png", "application/octet-stream"), expected, strict=True):
        answer = server.post("/embeddings_image?model=tiny-clip", content=data, headers={"Content-Type": kind})
        _assert_close(_rows(answer), row[None])
        inline = _rows(server.post("/embeddings_image", json={"model": "tiny-clip", "input": _data_uri(data)}))
        np.testing.assert_allclose(_rows(answer), inline, atol=1e-6)
    query = "/embeddings_image?model=tiny-clip&dimensions=16&encoding_format=base64"
    answer = server.post(query, content=files[0], headers={"Content-Type": "image/png"})
    assert answer.status_code == 200, answer.text
    cut = np.frombuffer(base64.b64decode(answer.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(cut, expected[0][:16] / np.linalg.norm(expected[0][:16]), atol=1e-5)


def test_multipart_uploads_from_httpx_and_requests_embed_each_file_in_order(server: httpx.Client, models) -> None:
    files = [PICTURES["/1.png"], PICTURES["/photo.jpg"], PICTURES["/2.png"]]
    expected = _reference("clip", models, files)
    parts = [("input", (f"{index}.img", data, "image/png")) for index, data in enumerate(files)]
    by_httpx = _rows(server.post("/embeddings_image", files=parts, data={"model": "tiny-clip"}))
    _assert_close(by_httpx, expected)
    url = f"{server.base_url}/embeddings_image"
    by_requests = requests.post(url, files=[("file", ("cat.png", files[0]))], data={"model": "tiny-clip"}, timeout=60)
    assert by_requests.status_code == 200, by_requests.text
    np.testing.assert_allclose(np.array([by_requests.json()["data"][0]["embedding"]]), by_httpx[:1], atol=1e-6)


def test_an_image_body_over_the_limit_is_refused_naming_it(server: httpx.Client) -> None:
    big = _file(Image.fromarray(NOISE))
    assert len(big) > MAX_IMAGE_BYTES
    declared = server.post("/embeddings_image", content=big, headers={"Content-Type": "image/png"})
    assert declared.status_code == 413, declared.text
    assert declared.json()["error"]["param"] == "input"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted while it streams
        for start in range(0, len(big), 16384):
            yield big[start : start + 16384]

    streamed = server.post("/embeddings_image", content=chunked(), headers={"Content-Type": "image/png"})
    assert streamed.status_code == 413, streamed.text
    assert streamed.json()["error"]["param"] == "input"
    in_form = server.post("/embeddings_image", files=[("input", ("a.png", PICTURES["/0.png"])), ("input", ("b", big))])
    assert in_form.status_code == 400, in_form.text
    assert in_form.json()["error"]["param"] == "input[1]" and in_form.json()["error"]["code"] == "image_too_large"


@pytest.mark.parametrize(
    ("request_kwargs", "status", "param", "code"),
    [
        ({"content": b"not an image", "headers": {"Content-Type": "image/png"}}, 400, "input", "unknown_image_format"),
        ({"files": [("input", ("a.png", PICTURES["/0.png"])), ("input", ("b.png", PICTURES["/0.png"][:300]))]}, 400,
         "input[1]", "invalid_image"),
        ({"files": [("input", ("a.png", PICTURES["/0.png"]))], "data": {"colour": "red"}}, 400, "colour",
         "unsupported_parameter"),
        ({"files": [("input", ("a.png", PICTURES["/0.png"]))], "data": {"dimensions": "0"}}, 400, "dimensions",
         "invalid_value"),
        ({"content": FIELDS_ONLY, "headers": {"Content-Type": "multipart/form-data; boundary=x"}}, 400, None,
         "missing_required_parameter"),
        ({"content": b"--x\r\nno headers end", "headers": {"Content-Type": "multipart/form-data; boundary=x"}}, 400,
         None, "invalid_multipart"),
        ({"content": b"abc", "headers": {"Content-Type": "multipart/form-data"}}, 400, None, "invalid_multipart"),
        ({"content": PICTURES["/0.png"], "headers": {"Content-Type": "image/png"}, "params": {"modality": "text"}},
         400, "modality", "unsupported_parameter"),
    ],
)  # fmt: skip
def test_a_bad_upload_is_refused_naming_what_is_wrong(
    server: httpx.Client, request_kwargs: dict, status: int, param: str | None, code: str
) -> None:
    answer = server.post("/embeddings_image", **request_kwargs)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert server.post("/embeddings_image", json={"input": _data_uri(PICTURES["/0.png"])}).status_code == 200


# ---- URLs -----------------------------------------------------------------------------------------------------


def test_an_image_url_on_a_listed_origin_embeds_as_the_same_image_inline(
    server: httpx.Client, image_server: str, models
) -> None:
    paths = ["/0.png", "/photo.jpg", "/2.png"]
    inline = _rows(server.post("/embeddings_image", json={"input": [_data_uri(PICTURES[p]) for p in paths]}))
    _assert_close(inline, _reference("clip", models, [PICTURES[p] for p in paths]))
    fetched = _rows(server.post("/embeddings_image", json={"input": [image_server + p for p in paths]}))
    np.testing.assert_allclose(fetched, inline, atol=1e-6)
    chunked = _rows(server.post("/embeddings_image", json={"input": f"{image_server}/chunked.png"}))
    np.testing.assert_allclose(chunked, inline[:1], atol=1e-6)
    content = [{"type": "image_url", "image_url": {"url": f"{image_server}/photo.jpg"}}]
    chat = _rows(server.post("/v1/embeddings", json={"messages": [{"role": "user", "content": content}]}))
    np.testing.assert_allclose(chat, inline[1:2], atol=1e-6)
    redirected = _rows(server.post("/embeddings_image", json={"input": f"{image_server}/redirect-in"}))
    np.testing.assert_allclose(redirected, _rows(server.post("/embeddings_image", json={
        "input": _data_uri(PICTURES["/1.png"])})), atol=1e-6)  # fmt: skip
    scored = server.post("/score", json={"text_1": "a cat", "text_2": {"content": [
        {"type": "image_url", "image_url": {"url": f"{image_server}/0.png"}}]}})  # fmt: skip
    assert scored.status_code == 200, scored.text


def _refused(server: httpx.Client, url: str) -> dict:
    _Images.asked.clear()
    answer = server.post("/embeddings_image", json={"input": [_data_uri(PICTURES["/0.png"]), url]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "input[1]", error
    return error


def test_an_origin_not_listed_is_refused_and_never_asked(server: httpx.Client, image_server: str) -> None:
    port = image_server.rsplit(":", 1)[1]
    not_listed = (
        f"http://127.0.0.2:{port}/0.png", f"https://127.0.0.1:{port}/0.png", f"http://127.0.0.1:1{port}/x",
        f"http://127.0.0.1:{port}@127.0.0.2:{port}/0.png", f"http://user@127.0.0.1:{port}/0.png",
        "file:///etc/passwd", f"ftp://127.0.0.1:{port}/0.png",
    )  # fmt: skip
    for url in not_listed:
        assert _refused(server, url)["code"] == "image_url_refused"
        assert _Images.asked == []
    error = _refused(server, f"http://localhost:{port}/0.png")  # listed, but by a name that resolves inward
    assert error["code"] == "image_url_refused" and "not a public address" in error["message"], error
    assert _Images.asked == []


def test_a_redirect_off_the_list_is_refused(server: httpx.Client, image_server: str) -> None:
    error = _refused(server, f"{image_server}/redirect-out")
    assert error["code"] == "image_url_refused" and "127.0.0.2" in error["message"], error
    assert _Images.asked == ["/redirect-out"]


@pytest.mark.parametrize("path", ["/declared-large", "/endless", "/chunked-large", "/lying-length"])
def test_a_body_over_the_cap_is_refused_as_it_streams(server: httpx.Client, image_server: str, path: str) -> None:
    error = _refused(server, image_server + path)
    expected = "image_too_large" if path != "/lying-length" else "unknown_image_format"  # its 100 bytes: no image
    assert error["code"] == expected, error


def test_a_request_s_urls_are_bounded_in_bytes_together(
    server: httpx.Client, image_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each URL within --max-image-bytes, yet more than the request's total: 413 naming the input that passed it."""
    monkeypatch.setattr(image_fetch, "MAX_REQUEST_FETCH_BYTES", 2 * len(PICTURES["/0.png"]) + 1)
    answer = server.post("/embeddings_image", json={"input": [f"{image_server}/0.png"] * 3})
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["param"] in ("input[0]", "input[1]", "input[2]"), answer.text


def test_a_slow_image_server_times_out_naming_the_input(server: httpx.Client, image_server: str) -> None:
    started = time.monotonic()
    error = _refused(server, image_server + "/slow.png")
    assert error["code"] == "image_url_timeout" and time.monotonic() - started < SLOW_SECONDS, error


def test_an_error_answer_is_refused_naming_the_input(server: httpx.Client, image_server: str) -> None:
    error = _refused(server, image_server + "/missing.png")
    assert error["code"] == "image_url_failed" and "404" in error["message"], error


def test_with_no_origin_listed_a_url_is_refused_and_nothing_fetched(built, image_server: str) -> None:
    with served(built, max_image_bytes=MAX_IMAGE_BYTES) as running:
        _Images.asked.clear()
        answer = running.client.post("/embeddings_image", json={"input": f"{image_server}/0.png"})
        assert answer.status_code == 400, answer.text
        assert (answer.json()["error"]["code"], answer.json()["error"]["param"]) == ("image_url_refused", "input")
        content = [{"type": "image_url", "image_url": {"url": f"{image_server}/0.png"}}]
        chat = running.client.post("/v1/embeddings", json={"messages": [{"role": "user", "content": content}]})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "image_url_refused", chat.text
        assert _Images.asked == []


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_https_verifies_the_certificate_against_the_listed_host(
    built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, models
) -> None:
    """Two https image servers on 127.0.0.1, certificates signed by the test's CA (trusted through SSL_CERT_FILE, as
    an operator points the gateway at an internal CA): one for 127.0.0.1, fetched; one for another name, refused."""
    certificates = make_certificates(tmp_path)
    servers = [_https_server(certificates, name) for name in ("replica", "named")]
    origins = tuple(f"https://127.0.0.1:{server.server_port}" for server in servers)
    monkeypatch.setenv("SSL_CERT_FILE", str(certificates / "ca.pem"))
    try:
        with served(built, max_image_bytes=MAX_IMAGE_BYTES, image_url_origins=origins) as running:
            client = running.client
            fetched = _rows(client.post("/embeddings_image", json={"input": f"{origins[0]}/photo.jpg"}))
            inline = _rows(client.post("/embeddings_image", json={"input": _data_uri(PICTURES["/photo.jpg"])}))
            np.testing.assert_allclose(fetched, inline, atol=1e-6)
            _assert_close(fetched, _reference("clip", models, [PICTURES["/photo.jpg"]]))
            refused = client.post("/embeddings_image", json={"input": f"{origins[1]}/photo.jpg"})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["code"] == "image_url_failed" and "certificate" in error["message"].lower(), error
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def _https_server(certificates: Path, name: str) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certificates / f"{name}.pem", certificates / f"{name}.key")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.handle_error = lambda *args: None  # the refused handshake: the client's refusal, not the server's error
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_an_origin_is_scheme_host_and_port_only() -> None:
    for origin in ("https://images.example.com", "http://10.0.0.5:8000", "http://[::1]:9000", "HTTPS://A.example"):
        assert GatewayConfig(replicas=("127.0.0.1:1",), image_url_origins=(origin,)).image_url_origins == (origin,)
    bad = ("ftp://a.example", "https://a.example/images", "https://a.example?x=1", "https://u:p@a.example", "a.example",
           "https://a.example:99999", "file:///etc")  # fmt: skip
    for origin in bad:
        with pytest.raises(ValueError, match="image-url-origin"):
            GatewayConfig(replicas=("127.0.0.1:1",), image_url_origins=(origin,))


def test_an_image_body_is_bounded_by_the_image_limit_not_the_json_one(built) -> None:
    """A lone image's body may pass --max-payload-bytes up to --max-image-bytes; the same image in JSON may not."""
    image = _file(Image.fromarray(NOISE[:150, :150]))
    assert 50_000 < len(image) < MAX_IMAGE_BYTES
    with served(built, max_image_bytes=MAX_IMAGE_BYTES, max_payload_bytes=50_000) as running:
        raw = running.client.post("/embeddings_image", content=image, headers={"Content-Type": "image/png"})
        form = running.client.post("/embeddings_image", files=[("input", ("noise.png", image))])
        np.testing.assert_allclose(_rows(raw), _rows(form), atol=1e-6)
        as_json = running.client.post("/embeddings_image", json={"input": _data_uri(image)})
        assert as_json.status_code == 413 and as_json.json()["error"]["code"] == "payload_too_large", as_json.text


@pytest.mark.long  # a model of its own to build and load (~15 s)
def test_a_model_whose_images_enter_its_decoder_takes_urls_and_bytes_alike(tmp_path: Path, image_server: str) -> None:
    """Qwen3-VL-Embedding (gateway/patch_embed.py): an image fetched from a listed origin inside a conversation, and
    an image body on /embeddings_image, embed equal to the same images as data URIs."""
    path = tmp_path / "tiny-qwen3-vl"
    save_qwen3_vl_with_tokenizer(path)
    picture, photo = PICTURES["/2.png"], PICTURES["/photo.jpg"]

    def message(url: str) -> dict:
        content = [{"type": "text", "text": "a chart"}, {"type": "image_url", "image_url": {"url": url}}]
        return {"messages": [{"role": "user", "content": content}]}

    with engines(path) as built, served(built, image_url_origins=(image_server,)) as running:
        client = running.client
        inline = _rows(client.post("/v1/embeddings", json=message(_data_uri(picture))))
        fetched = _rows(client.post("/v1/embeddings", json=message(f"{image_server}/2.png")))
        np.testing.assert_allclose(fetched, inline, atol=1e-6)
        as_json = _rows(client.post("/embeddings_image", json={"input": _data_uri(photo)}))
        raw = _rows(client.post("/embeddings_image", content=photo, headers={"Content-Type": "image/jpeg"}))
        np.testing.assert_allclose(raw, as_json, atol=1e-6)
        refused = client.post("/v1/embeddings", json=message(f"{_Images.other_origin}/2.png"))
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "messages[0].content[1].image_url.url", refused.text
