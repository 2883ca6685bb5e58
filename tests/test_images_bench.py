"""bench/images.py (issue 29 item 5) end to end at its smallest settings on its tiny random CLIP: it must finish and
print every ratio and every part of where the time goes as finite numbers, so that a change to the gateway, the
engine or a peer's environment cannot leave the bench broken until someone next runs it for figures. Infinity is
measured when the peers' environment (`make peers`) can run it; otherwise the bench must say what is missing and
still measure bouquet against sentence-transformers. No figure's value is asserted, only that it is a number."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import peers
import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALLEST = ["--images", "2", "--per-request", "2", "--concurrency", "1", "--latency", "1", "--rounds", "1"]
NUMBER = r"(?P<value>[-+\w.]+)"  # nan and inf included, so that they fail as numbers rather than as missing lines
PARTS = {"decode (base64 + JPEG)", "preprocess", "encode (batch 2)", "encode (batch 1)", "transformers preprocess"}


def _infinity_runs() -> bool:
    """What the bench itself requires of the peers' Python before it starts Infinity."""
    try:
        for package in ("infinity_emb", "aiohttp"):
            peers.require(peers.PEERS_PYTHON, package)
    except SystemExit:
        return False
    return True


def _numbers(pattern: str, output: str) -> dict[str, float]:
    """Each line matching `pattern`, a (?P<name>) and a NUMBER, as name -> value."""
    return {found["name"]: float(found["value"]) for found in re.finditer(pattern, output, re.MULTILINE)}


def _assert_finite(pattern: str, output: str, expected: set[str]) -> None:
    found = _numbers(pattern, output)
    assert set(found) == expected, (pattern, output)
    assert all(math.isfinite(value) and value > 0 for value in found.values()), found


@pytest.mark.long  # ~30 s, ~50 s with Infinity: CI's long tier
@pytest.mark.process
def test_images_bench_prints_finite_ratios_at_its_smallest_settings(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "bench" / "images.py"), "--tiny", "--model-dir", str(tmp_path / "clip")]
    result = subprocess.run([*command, *SMALLEST], capture_output=True, text=True, timeout=600)
    output = result.stdout
    assert result.returncode == 0, output[-3000:] + result.stderr[-3000:]
    peers_measured = {"infinity"} if _infinity_runs() else set()
    if not peers_measured:
        assert f"infinity: not measured ({peers.PEERS_PYTHON} cannot import" in output, output
    measured = peers_measured | {"sentence-transformers"}
    cosines = _numbers(rf"^  (?P<name>\S+) image embeddings against bouquet's: min cosine {NUMBER}$", output)
    assert set(cosines) == measured and min(cosines.values()) > 0.9999, cosines  # float32, the same features
    _assert_finite(rf"^  (?P<name>bouquet serve|\S+) +{NUMBER} images/s", output, measured | {"bouquet serve"})
    _assert_finite(rf"^  ratio +{NUMBER}x (?P<name>\S+)$", output, measured)
    _assert_finite(rf"^  p50 ratio \((?P<name>\S+) / bouquet serve\) {NUMBER}x$", output, measured)
    _assert_finite(rf"^  (?P<name>bouquet serve|\S+) +p50 +{NUMBER} ms", output, measured | {"bouquet serve"})
    parts = "|".join(map(re.escape, PARTS))
    _assert_finite(rf"^  (?P<name>{parts}) +{NUMBER} ms", output, PARTS)
