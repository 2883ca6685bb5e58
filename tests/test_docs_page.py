"""The interactive docs page (/docs) renders in a real browser with no network beyond the gateway: headless Chromium
loads the page, Swagger UI's files and /openapi.json from the gateway alone (every other host fails to resolve),
and renders every operation of the document; a screenshot is kept under the test's tmp_path. The gateway runs in
this process (tests/in_process.py) on a loopback port.

Skipped where no Chromium is installed (Debian's `chromium`; `make install` installs it where apt-get can)."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from in_process import served

from bouquet.engine.engine import Engine
from bouquet.gateway.openapi import openapi_spec

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium browser on PATH: `apt-get install chromium` (make install does it)"
)
PATHS = ("/v1/embeddings", "/embed", "/v1/rerank", "/v2/embed", "/v1/contextualizedembeddings", "/score")


@pytest.fixture(scope="module")
def url(minilm_fp32: Engine) -> Iterator[str]:
    with served([minilm_fp32], listen=True) as running:
        yield running.url


def _chromium(page: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium on `page`, given time for its scripts and their requests (virtual time runs ahead while
    nothing is pending). Offline: every host but the gateway's loopback address fails to resolve, so a file the
    page fetched from a CDN would be missing and the page would not render."""
    assert CHROMIUM is not None
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--virtual-time-budget=20000",
        "--window-size=1280,4000", *args, page,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def test_the_docs_page_renders_every_operation_offline(url: str, tmp_path: Path) -> None:
    dom = _chromium(f"{url}/docs", "--dump-dom").stdout
    rendered = set(re.findall(r'class="opblock-summary-path" data-path="([^"]+)"', dom))
    documented = set(openapi_spec()["paths"])
    assert rendered == documented, f"documented, not rendered: {sorted(documented - rendered)}"
    for path in PATHS:
        assert f'data-path="{path}"' in dom
    assert "Failed to load API definition" not in dom
    assert "EmbeddingsRequest" in dom  # the schemas section, generated from the request structs

    screenshot = tmp_path / "docs.png"
    _chromium(f"{url}/docs", f"--screenshot={screenshot}")
    header = screenshot.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert (width, height) == (1280, 4000)
    assert screenshot.stat().st_size > 50_000  # a rendered page of operations, not a blank one
