"""Embedding servers people run today, started on loopback so that bench/serve.py can measure them beside
bouquet in the same run, on the same texts and the same OpenAI-compatible requests.

Infinity (infinity-emb, Michael Feil's server: FastAPI, a dynamic batcher, sentence-transformers on torch) is
the one that installs here from the package registry. It lives in its own environment, because it pins
numpy < 2 and sentence-transformers < 4: `make peers` builds `.venv-peers` (torch pinned to the same CPU
build), with ONNX Runtime beside it for bench/ort.py. Hugging Face text-embeddings-inference is a Rust
binary and vLLM's CPU build is not on PyPI, so neither can be installed on this machine.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np

from bouquet.gateway.testing import Process, wait_healthy

PEERS_PYTHON = Path(__file__).resolve().parent.parent / ".venv-peers" / "bin" / "python"
SERVED_MODEL_NAME = "all-MiniLM-L6-v2"  # the name bouquet serve gives its bundled model; Infinity is told it


def require(python: Path, package: str) -> None:
    """Stops with what to run when the peers' environment is missing or lacks `package`."""
    found = (
        python.exists()
        and subprocess.run([str(python), "-c", f"import {package}"], capture_output=True).returncode == 0
    )
    if not found:
        raise SystemExit(f"{python} cannot import {package}: run `make peers` first (or pass the Python that can)")


def start_infinity(python: Path, model_dir: Path, port: int, dtype: str) -> Process:
    """`infinity_emb v2` on the model directory, its defaults otherwise (torch engine, batches of up to 32),
    answering /v1/embeddings under the same model name bouquet serves; returns once /health answers. Its
    log level is warning, so that it spends no time on access logs (bouquet writes none either)."""
    require(python, "infinity_emb")
    command = [
        str(python), "-m", "infinity_emb.cli", "v2",
        "--model-id", str(model_dir), "--served-model-name", SERVED_MODEL_NAME,
        "--engine", "torch", "--device", "cpu", "--dtype", dtype,
        "--host", "127.0.0.1", "--port", str(port), "--url-prefix", "/v1", "--log-level", "warning",
    ]  # fmt: skip
    # No hub, no telemetry: the model is a local directory and this machine has no internet.
    env = os.environ | {"HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    infinity = Process(process, ready_pattern=r"$^")  # never matches: readiness is /health's answer
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=180)  # /health is outside the prefix
    except TimeoutError:
        infinity.stop()
        raise RuntimeError("infinity did not start:\n" + "".join(infinity.lines[-30:])) from None
    return infinity


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The lowest cosine between matching rows: a peer and bouquet must compute the same embeddings."""
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())
