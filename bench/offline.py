"""Offline embedding throughput: `bouquet embed` against sentence-transformers on the same real texts.

Both run in this process on the same corpus (standard-library docstrings: documents, and their first lines as
queries), in float32, bfloat16 and int8, interleaved repetition by repetition so that the shared machine's noise
hits both alike; medians are reported. Tokens are real (non-padding) tokens after truncation to the model's
limit. The ceilings (a square matrix product, and the model's widest Linear on its oneDNN-prepacked weight, or
in int8 bouquet's int8 linear and oneDNN's int8 product alone) are measured in the same run. bouquet's int8 is
set against sentence-transformers in float32 here, and against sentence-transformers' own int8 (ONNX Runtime's
dynamic quantization, bench/st_onnx_int8.py) where `.venv-onnx` has it.

    .venv/bin/python bench/offline.py [--repeats 5] [--texts documents,queries] [--dtypes float32,bfloat16,int8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import corpus
import numpy as np
import torch

from bouquet.config import EmbedConfig, EngineConfig, default_model_path
from bouquet.engine.engine import Engine
from bouquet.layers.int8_linear import (
    int8_linear,
    int8_product,
    quantize_rows,
    quantize_weight,
    weight_range,
    with_products,
)
from bouquet.layers.int8_products import available_products, without_slow_paths
from bouquet.layers.linear import Linear, prepack_cpu_linears
from bouquet.offline.embed import embed_file
from bouquet.tokenizer import TextTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# What sentence-transformers runs where bouquet runs int8 (its own int8 is ONNX's: bench/st_onnx_int8.py).
ST_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "int8": "float32"}
ONNX_PYTHON = Path(__file__).resolve().parent.parent / ".venv-onnx" / "bin" / "python"


def matmul_ceiling(dtype: torch.dtype, repeats: int = 20) -> float:
    """GFLOP/s of a large square matrix product: what the cores can do at best."""
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    times = [_timed(lambda: a @ b) for _ in range(repeats)]
    return 2 * 2048**3 / statistics.median(times) / 1e9


def packed_linear_ceiling(dtype: torch.dtype, tokens: int = 4096, repeats: int = 20) -> float:
    """GFLOP/s of bouquet's own Linear on its oneDNN-prepacked weight, at MiniLM's widest product (384 -> 1536)
    over a step's worth of tokens: what the model's matrix products can reach at best on these cores."""
    layer = Linear(384, 1536).to(dtype)
    prepack_cpu_linears(layer)
    x = torch.randn(tokens, 384, dtype=dtype)
    with torch.inference_mode():
        layer(x)  # oneDNN builds and caches the primitive for this shape on the first call
        times = [_timed(lambda: layer(x)) for _ in range(repeats)]
    return 2 * tokens * 384 * 1536 / statistics.median(times) / 1e9


def int8_ceilings(product: str, tokens: int = 4096, repeats: int = 20) -> tuple[float, float]:
    """GOP/s of bouquet's int8 linear (row quantization, product, dequantization) and of the int8 product alone
    (`torch._int_mm`, or oneDNN's matmul on the prepacked weight), at MiniLM's widest product over a step's worth
    of tokens."""
    weight = quantize_weight(torch.randn(1536, 384) * 0.05, torch.zeros(1536), weight_range(product))
    weight = with_products(weight, product, product)
    x = torch.randn(tokens, 384)
    rows = quantize_rows(x)
    operations = 2 * tokens * 384 * 1536 / 1e9
    int8_linear(x, weight)  # oneDNN builds its primitive for the shape on the first call
    linear = [_timed(lambda: int8_linear(x, weight)) for _ in range(repeats)]
    alone = [_timed(lambda: int8_product(rows.values, weight)) for _ in range(repeats)]
    return operations / statistics.median(linear), operations / statistics.median(alone)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_gflop(lengths: list[int], hidden: int, intermediate: int, layers: int) -> float:
    """Forward FLOPs: the dense layers per token, plus attention's two products per sequence."""
    dense = 2 * (4 * hidden * hidden + 2 * hidden * intermediate) * sum(lengths)
    attention = 4 * hidden * sum(length * length for length in lengths)
    return layers * (dense + attention) / 1e9


class BouquetRunner:
    """The `bouquet embed` pipeline (reader, tokenizer thread, engine steps, .npy writer) on one file."""

    def __init__(self, texts: list[str], workdir: Path, dtype: str, batch_tokens: int, model_path: Path):
        self.input_path = workdir / "texts.jsonl"
        self.input_path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        self.engine = Engine(EngineConfig(model_path=model_path, device="cpu", dtype=dtype))
        self.tokenizer = TextTokenizer(self.engine.spec.tokenizer_file, self.engine.max_seq_length)
        self.config = EmbedConfig(self.input_path, workdir / f"out-{dtype}.npy", batch_tokens=batch_tokens)

    def __call__(self) -> None:
        embed_file(self.engine, self.tokenizer, self.config, progress_bar=False)

    def close(self) -> None:
        self.engine.close()


class SentenceTransformersRunner:
    def __init__(self, texts: list[str], dtype: str, model_path: Path, search_texts: int = 256):
        from sentence_transformers import SentenceTransformer

        self.texts = texts
        self.model = SentenceTransformer(str(model_path), device="cpu", model_kwargs={"torch_dtype": DTYPES[dtype]})
        self.batch_size = self._best_batch_size(search_texts)

    def _best_batch_size(self, search_texts: int) -> int:
        sample = self.texts[:search_texts]
        self.model.encode(sample[:32], batch_size=32)
        timings = {bs: _timed(lambda bs=bs: self.model.encode(sample, batch_size=bs)) for bs in (8, 16, 32, 64)}
        return min(timings, key=timings.__getitem__)

    def __call__(self) -> None:
        self.model.encode(self.texts, batch_size=self.batch_size, normalize_embeddings=True)

    def close(self) -> None:
        pass


def run_cli_once(texts: list[str], workdir: Path, dtype: str) -> float:
    """Wall seconds of one real `bouquet embed` process, start-up and model load included."""
    source = workdir / "cli.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    command = [sys.executable, "-m", "bouquet.cli", "embed", str(source), "-o", str(workdir / "cli.npy")]
    start = time.perf_counter()
    subprocess.run([*command, "--dtype", dtype], check=True, capture_output=True)
    return time.perf_counter() - start


Samples = dict[tuple[str, str], list[float]]  # (system, dtype) -> seconds per repetition


def measure(texts: list[str], model_path: Path, args: argparse.Namespace, workdir: Path) -> Samples:
    """Both systems in every dtype on `texts`, warmed up, then interleaved repetition by repetition."""
    runners: dict[tuple[str, str], BouquetRunner | SentenceTransformersRunner] = {}
    for dtype in args.dtypes.split(","):
        runners["bouquet", dtype] = BouquetRunner(texts, workdir, dtype, args.batch_tokens, model_path)
        st = SentenceTransformersRunner(texts, ST_DTYPES[dtype], model_path, args.st_search_texts)
        runners["sentence-transformers", dtype] = st
        print(f"sentence-transformers {ST_DTYPES[dtype]} (beside bouquet {dtype}): best batch size {st.batch_size}")
    for runner in runners.values():
        runner()  # warm-up
    samples: Samples = {key: [] for key in runners}
    for _ in range(args.repeats):
        for key, runner in runners.items():
            samples[key].append(_timed(runner))
    for runner in runners.values():
        runner.close()
    return samples


def ratio(samples: Samples, dtype: str) -> float:
    """bouquet's speed over sentence-transformers', from the medians."""
    return statistics.median(samples["sentence-transformers", dtype]) / statistics.median(samples["bouquet", dtype])


def bench_corpus(name: str, texts: list[str], args: argparse.Namespace, workdir: Path) -> None:
    tokenizer = TextTokenizer(default_model_path() / "tokenizer.json", 256)
    lengths = [len(ids) for ids in tokenizer.encode(texts)]
    tokens = sum(lengths)
    gflop = model_gflop(lengths, hidden=384, intermediate=1536, layers=6)
    print(f"\n== {name}: {len(texts)} texts, {tokens} real tokens (mean {tokens / len(texts):.0f}/text)")
    samples = measure(texts, default_model_path(), args, workdir)
    print(f"{'system':<24}{'dtype':<10}{'tokens/s':>10}{'GFLOP/s':>9}   runs (tokens/s)")
    for (system, dtype), times in samples.items():
        rate = tokens / statistics.median(times)
        runs = " ".join(f"{tokens / t:.0f}" for t in times)
        print(f"{system:<24}{dtype:<10}{rate:>10.0f}{gflop * rate / tokens:>9.0f}   {runs}")
    for dtype in args.dtypes.split(","):
        print(f"ratio bouquet {dtype} / sentence-transformers {ST_DTYPES[dtype]}: {ratio(samples, dtype):.2f}x")
    if "int8" in args.dtypes.split(","):
        onnx_int8(texts, tokens, samples, args, workdir)


def onnx_int8(texts: list[str], tokens: int, samples: Samples, args: argparse.Namespace, workdir: Path) -> None:
    """sentence-transformers' ONNX int8 on the same texts, in `.venv-onnx`'s Python, after bouquet's runs."""
    if not ONNX_PYTHON.exists():
        print(f"sentence-transformers ONNX int8: not measured ({ONNX_PYTHON} missing; see bench/st_onnx_int8.py)")
        return
    texts_file = workdir / "onnx-texts.json"
    texts_file.write_text(json.dumps(texts))
    worker = Path(__file__).resolve().parent / "st_onnx_int8.py"
    command = [str(ONNX_PYTHON), str(worker), "time", str(default_model_path()), str(workdir), str(texts_file)]
    result = subprocess.run([*command, str(args.repeats)], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"sentence-transformers ONNX int8: failed ({result.stderr.strip().splitlines()[-1:]})")
        return
    found = json.loads(result.stdout.strip().splitlines()[-1])
    onnx_rate = tokens / float(np.median(found["seconds"]))
    ours = tokens / statistics.median(samples["bouquet", "int8"])
    runs = " ".join(f"{tokens / t:.0f}" for t in found["seconds"])
    print(f"sentence-transformers ONNX int8 ({found['config']}, batch {found['batch_size']}): {onnx_rate:.0f} tokens/s"
          f"   runs {runs}")  # fmt: skip
    print(f"ratio bouquet int8 / sentence-transformers ONNX int8: {ours / onnx_rate:.2f}x (its runs after ours)")


def add_measure_arguments(parser: argparse.ArgumentParser, repeats: int, st_search_texts: int) -> None:
    """The options `measure` reads."""
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument(
        "--st-search-texts",
        type=int,
        default=st_search_texts,
        help="texts timed to pick sentence-transformers' batch size",
    )
    parser.add_argument("--dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--batch-tokens", type=int, default=EmbedConfig.batch_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_measure_arguments(parser, repeats=5, st_search_texts=256)
    parser.add_argument("--texts", default="documents,queries")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for dtype in args.dtypes.split(","):
        if dtype == "int8":
            for product in without_slow_paths(available_products(), (384, 1536)):  # slow paths take minutes
                linear, alone = int8_ceilings(product)
                print(f"int8 ceiling ({product}): bouquet's int8 linear {linear:.0f} GOP/s, product alone {alone:.0f}")
            continue
        print(f"matrix-product ceiling {dtype}: {matmul_ceiling(DTYPES[dtype]):.0f} GFLOP/s, "
              f"oneDNN packed linear {packed_linear_ceiling(DTYPES[dtype]):.0f}")  # fmt: skip
    texts = {"documents": corpus.documents(), "queries": corpus.queries()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.texts.split(","):
            bench_corpus(name, texts[name], args, Path(tmp))
        for dtype in args.dtypes.split(","):
            seconds = run_cli_once(texts["documents"], Path(tmp), dtype)
            print(f"one `bouquet embed` process on the documents, {dtype}: {seconds:.1f} s wall, start-up included")


if __name__ == "__main__":
    main()
