"""sentence-transformers' own int8 path, for bench/offline.py: `backend="onnx"` with the model exported by
`export_dynamic_quantized_onnx_model` (ONNX Runtime's dynamic int8 quantization), run by a Python that has
`sentence-transformers[onnx]`, kept in `.venv-onnx` (`make peers`) so that its optimum and onnxruntime never move
the test environment's packages:

    make peers   # or: python3.11 -m venv .venv-onnx, then its pip: torch==2.13.0 'sentence-transformers[onnx]'
    .venv-onnx/bin/python bench/st_onnx_int8.py time MODEL_DIR WORK_DIR TEXTS.json REPEATS   # prints JSON
    .venv-onnx/bin/python bench/st_onnx_int8.py rows MODEL_DIR WORK_DIR TEXTS.json OUT.npz

`time` is bench/offline.py's: the seconds of each repetition. `rows` is bench/int8_quality.py's: the texts' rows
from the ONNX float32 model and from its int8 export (`float32`, `int8` in OUT.npz), normalised, so that the
field's own int8 is judged against its own float32 by the same gate as bouquet's.

The quantization config is the one sentence-transformers names for this CPU: "avx512_vnni" where the CPU has
VNNI, "avx512" with AVX-512 alone, else "avx2". Prints the config, the batch size found fastest and the seconds
of each repetition over all the texts (encode, normalised), after a warm-up.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path


def quantization_config() -> str:
    flags = Path("/proc/cpuinfo").read_text()
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    return "avx512" if "avx512bw" in flags else "avx2"


def load_models(model_dir: str, work_dir: Path) -> tuple[object, object, str]:
    """(the ONNX float32 model, its dynamic int8 export, the quantization config)."""
    from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

    local = work_dir / "st-onnx"
    if not local.exists():
        shutil.copytree(model_dir, local)
    config = quantization_config()
    float32 = SentenceTransformer(str(local), device="cpu", backend="onnx")
    export_dynamic_quantized_onnx_model(float32, config, str(local))
    int8 = SentenceTransformer(
        str(local), device="cpu", backend="onnx", model_kwargs={"file_name": f"onnx/model_qint8_{config}.onnx"}
    )
    return float32, int8, config


def rows(model_dir: str, work_dir: Path, texts: list[str], out: str) -> None:
    import numpy as np

    float32, int8, config = load_models(model_dir, work_dir)
    encoded = {
        name: m.encode(texts, batch_size=32, normalize_embeddings=True)
        for name, m in (("float32", float32), ("int8", int8))
    }
    np.savez(out, **encoded)
    print(json.dumps({"config": config}))


def time_int8(model_dir: str, work_dir: Path, texts: list[str], repeats: int) -> None:
    _, model, config = load_models(model_dir, work_dir)
    sample = texts[:256]
    model.encode(sample[:32], batch_size=32)
    timings = {}
    for batch_size in (8, 16, 32, 64):
        start = time.perf_counter()
        model.encode(sample, batch_size=batch_size)
        timings[batch_size] = time.perf_counter() - start
    batch_size = min(timings, key=timings.__getitem__)
    model.encode(texts, batch_size=batch_size, normalize_embeddings=True)  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.encode(texts, batch_size=batch_size, normalize_embeddings=True)
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"config": config, "batch_size": batch_size, "seconds": seconds}))


def main() -> None:
    mode, model_dir, work_dir, texts_file, last = sys.argv[1:6]
    texts: list[str] = json.loads(Path(texts_file).read_text())
    if mode == "rows":
        rows(model_dir, Path(work_dir), texts, last)
    else:
        time_int8(model_dir, Path(work_dir), texts, int(last))


if __name__ == "__main__":
    main()
