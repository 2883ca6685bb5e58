"""The int8 quality gate (issue 24, item 3): `--dtype int8` rows against float32 rows of the same model.

`--dtype int8` runs every transformer Linear in int8 (per-channel weights, per-token asymmetric activations;
bouquet/layers/int8_linear.py). Each model here embeds the same texts twice through bouquet's engine, in float32
and in int8, normalised as served, and the rows are compared one by one by cosine (min and mean):

- all-MiniLM-L6-v2 (the bundled, real weights) on documents (bench/corpus.py: whole standard-library docstrings,
  many past the model's 256-token limit and truncated to it) and on queries (their first lines), separately;
- every family of bench/family_models.py, random-weight models at their tiny test shape, on the same documents
  and queries: random weights, so these figures describe the arithmetic, not retrieval quality. (At the full
  benchmark shape a random model can be chaotic: gte's and nomic-bert's rows then move as far in bfloat16 as in
  int8, min cosine near 0, so the full shape says nothing of int8.) Each family's bfloat16 rows against its
  float32 rows are shown beside int8's, as a measure of the model's own sensitivity;
- retrieval: bench/encoding_recall.py's set (every docstring paragraph a document, every first line a query),
  each query ranking the documents by dot product of normalised rows; recall@10 of int8's ten nearest documents
  against float32's ten nearest, averaged over the queries; then the same for sentence-transformers' own int8
  (ONNX Runtime's dynamic quantization of its ONNX export, bench/st_onnx_int8.py) against its ONNX float32, where
  `.venv-onnx` has it: the int8 users get from the field today.

Goals: min cosine >= 0.99 on MiniLM's documents and on its queries, recall@10 >= 0.98; the last lines say PASS or
FAIL for each. The CPU and the int8 weights' range in use (full; narrowed on a CPU without VNNI) come first.

    .venv/bin/python bench/int8_quality.py [--docs 300] [--queries 300] [--families bert,qwen3] [--skip-recall]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import corpus
import encoding_recall
import numpy as np
from family_models import FAMILIES, build_family

from bouquet.config import EngineConfig, default_model_path
from bouquet.cpu_features import cpu_features
from bouquet.engine.engine import Engine
from bouquet.layers.int8_linear import weight_range
from bouquet.tokenizer import TextTokenizer

MIN_COSINE_GOAL = 0.99
RECALL_GOAL = 0.98
K = 10
ONNX_PYTHON = Path(__file__).resolve().parent.parent / ".venv-onnx" / "bin" / "python"
TINY = True  # random models at full shape are chaotic (module docstring)


@dataclass
class Embedded:
    """One engine's rows for each set of texts, in the texts' order."""

    rows: list[np.ndarray]
    over_limit: list[np.ndarray]  # [N] bool per set: the text ran past the model's token limit (truncated)
    limit: int  # the model's token limit
    seconds: float  # embedding only, every set


def embed_sets(model_path: Path, dtype: str, sets: list[list[str]]) -> Embedded:
    engine = Engine(EngineConfig(model_path=model_path, device="cpu", dtype=dtype, cpu_warmup_tokens=0))
    try:
        tokenizer = TextTokenizer(engine.spec.tokenizer_file, engine.max_seq_length)
        over_limit = [
            np.array([len(ids) > engine.max_seq_length for ids in tokenizer.encode(texts, truncate=False)])
            for texts in sets
        ]
        started = time.perf_counter()
        rows = [encoding_recall.embed(engine, tokenizer, texts, 0) for texts in sets]
        return Embedded(rows, over_limit, engine.max_seq_length, time.perf_counter() - started)
    finally:
        engine.close()


@dataclass
class Compared:
    """int8 against float32 on the same sets: per-row cosines per set."""

    cosines: list[np.ndarray]
    over_limit: list[np.ndarray]
    limit: int
    float32: Embedded
    int8: Embedded


def compare(model_path: Path, sets: list[list[str]]) -> Compared:
    float32 = embed_sets(model_path, "float32", sets)
    int8 = embed_sets(model_path, "int8", sets)
    cosines = [row_cosines(a, b) for a, b in zip(int8.rows, float32.rows, strict=True)]
    return Compared(cosines, float32.over_limit, float32.limit, float32, int8)


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def min_mean(cosines: np.ndarray) -> str:
    return f"min {cosines.min():.5f} mean {cosines.mean():.5f}" if len(cosines) else "(none)"


def verdict(label: str, value: float, goal: float) -> str:
    return f"{'PASS' if value >= goal else 'FAIL'}  {label:34} {value:.5f}  (goal >= {goal}: {value - goal:+.5f})"


def minilm(documents: list[str], queries: list[str], path: Path) -> list[str]:
    compared = compare(path, [documents, queries])
    print(f"\n== all-MiniLM-L6-v2 (real weights), limit {compared.limit} tokens; embedded in "
          f"{compared.float32.seconds:.1f} s float32, {compared.int8.seconds:.1f} s int8")  # fmt: skip
    (doc_cos, query_cos), (doc_over, query_over) = compared.cosines, compared.over_limit
    print(f"documents {len(documents):5d}: {min_mean(doc_cos)}; {doc_over.sum()} over the limit (truncated): "
          f"{min_mean(doc_cos[doc_over])}, within it: {min_mean(doc_cos[~doc_over])}")  # fmt: skip
    print(f"queries   {len(queries):5d}: {min_mean(query_cos)}; {query_over.sum()} over the limit")
    return [
        verdict("MiniLM documents, min cosine", float(doc_cos.min()), MIN_COSINE_GOAL),
        verdict("MiniLM queries, min cosine", float(query_cos.min()), MIN_COSINE_GOAL),
    ]


def families(names: list[str], documents: list[str], queries: list[str], tokenizer_dir: Path) -> None:
    shape = "tiny (tests' shape)" if TINY else "full (the benchmark shape: 6 layers, hidden 384)"
    print(f"\n== families: random weights, {shape}; {len(documents)} documents + {len(queries)} queries each. "
          f"Random weights: these describe the arithmetic, not retrieval quality")  # fmt: skip
    print(f"{'family':12} {'build s':>7} {'embed s f32/int8':>16} {'over':>5}  {'all rows':28} "
          f"{'documents over the limit':28} {'queries':28} {'bfloat16 (reference), all rows':28}")  # fmt: skip
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"int8-{name}-") as out:
            started = time.perf_counter()
            model_path = build_family(name, Path(out), tokenizer_dir=tokenizer_dir, tiny=TINY)
            built = time.perf_counter() - started
            compared = compare(model_path, [documents, queries])
            bfloat16 = embed_sets(model_path, "bfloat16", [documents + queries]).rows[0]
        (doc_cos, query_cos), doc_over = compared.cosines, compared.over_limit[0]
        reference = row_cosines(bfloat16, np.concatenate(compared.float32.rows))
        seconds = f"{compared.float32.seconds:.1f}/{compared.int8.seconds:.1f}"
        print(f"{name:12} {built:7.1f} {seconds:>16} {doc_over.sum():5d}  "
              f"{min_mean(np.concatenate([doc_cos, query_cos])):28} {min_mean(doc_cos[doc_over]):28} "
              f"{min_mean(query_cos):28} {min_mean(reference):28}")  # fmt: skip


def recall(path: Path) -> list[str]:
    documents, queries = corpus.paragraphs(), list(dict.fromkeys(corpus.queries()))
    compared = compare(path, [documents, queries])
    truth = encoding_recall.top_k(compared.float32.rows[1] @ compared.float32.rows[0].T, K)
    found = encoding_recall.top_k(compared.int8.rows[1] @ compared.int8.rows[0].T, K)
    value = encoding_recall.recall(found, truth)
    print(f"\n== retrieval (bench/encoding_recall.py's set): all-MiniLM-L6-v2, {len(documents)} documents, "
          f"{len(queries)} queries; embedded in {compared.float32.seconds:.1f} s float32, "
          f"{compared.int8.seconds:.1f} s int8")  # fmt: skip
    print(f"row cosines: documents {min_mean(compared.cosines[0])}, queries {min_mean(compared.cosines[1])}")
    print(f"recall@{K} of int8's top {K} against float32's: {value:.5f}")
    field_int8(documents, queries, path)
    return [verdict(f"recall@{K} against float32", value, RECALL_GOAL)]


def field_int8(documents: list[str], queries: list[str], path: Path) -> None:
    """The same gate for sentence-transformers' own int8 (its ONNX export, ONNX Runtime's dynamic quantization)
    against its own ONNX float32, where `.venv-onnx` has it (`make peers`): what users get from the field today."""
    if not ONNX_PYTHON.exists():
        print(f"sentence-transformers ONNX int8: not measured ({ONNX_PYTHON} missing; `make peers`)")
        return
    with tempfile.TemporaryDirectory(prefix="int8-onnx-") as work:
        texts_file, out = Path(work) / "texts.json", Path(work) / "rows.npz"
        texts_file.write_text(json.dumps(documents + queries))
        worker = Path(__file__).resolve().parent / "st_onnx_int8.py"
        command = [str(ONNX_PYTHON), str(worker), "rows", str(path), work, str(texts_file), str(out)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            print(f"sentence-transformers ONNX int8: failed ({result.stderr.strip().splitlines()[-1:]})")
            return
        found = np.load(out)
        float32, int8 = found["float32"], found["int8"]
    config = json.loads(result.stdout.strip().splitlines()[-1])["config"]
    split = len(documents)
    truth = encoding_recall.top_k(float32[split:] @ float32[:split].T, K)
    value = encoding_recall.recall(encoding_recall.top_k(int8[split:] @ int8[:split].T, K), truth)
    cosines = row_cosines(int8, float32)
    print(f"sentence-transformers ONNX int8 ({config}) against its ONNX float32, same set: documents "
          f"{min_mean(cosines[:split])}, queries {min_mean(cosines[split:])}; recall@{K} {value:.5f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=300, help="the corpus's first N documents")
    parser.add_argument("--queries", type=int, default=300, help="the corpus's first N distinct queries")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma list; empty: none")
    parser.add_argument("--skip-recall", action="store_true", help="leave out retrieval (the longest part)")
    args = parser.parse_args()
    names = [name for name in args.families.split(",") if name]
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {','.join(FAMILIES)}")

    import transformers  # its progress bars only, while the families are built

    transformers.utils.logging.disable_progress_bar()
    started = time.perf_counter()
    print(f"CPU: {cpu_features().describe()}")
    codes = weight_range()
    print(f"int8 weights: {codes.describe()} ({'full range' if codes.full else 'narrowed: no VNNI'})")
    path = default_model_path()
    documents, queries = corpus.documents(args.docs), list(dict.fromkeys(corpus.queries()))[: args.queries]
    summary = minilm(documents, queries, path)
    if names:
        families(names, documents, queries, path)
    if not args.skip_recall:
        summary += recall(path)
    print(f"\n== summary ({time.perf_counter() - started:.0f} s in all)")
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
