"""Offline throughput per model family: `bouquet embed` against sentence-transformers, measured as
bench/offline.py measures MiniLM (the same runners, interleaved, medians), on random-weight models of a small
realistic shape (bench/family_models.py) saved by sentence-transformers with the real MiniLM tokenizer.

    .venv/bin/python bench/families.py [--repeats 3] [--documents 48] [--families bert,qwen3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import corpus
import offline
import torch
from family_models import FAMILIES, MAX_SEQ_LENGTH, build_family

from bouquet.config import default_model_path
from bouquet.tokenizer import TextTokenizer

Row = tuple[str, str, float, float, float]  # family, dtype, bouquet tokens/s, sentence-transformers', ratio


def bench_family(name: str, texts: list[str], args: argparse.Namespace, root: Path) -> list[Row]:
    model_path = build_family(name, root / name, default_model_path())
    tokens = sum(len(ids) for ids in TextTokenizer(model_path / "tokenizer.json", MAX_SEQ_LENGTH).encode(texts))
    print(f"\n== {name}: {len(texts)} documents, {tokens} real tokens")
    samples = offline.measure(texts, model_path, args, root / name)
    rows = []
    for dtype in args.dtypes.split(","):
        rates = {
            system: tokens / statistics.median(samples[system, dtype])
            for system in ("bouquet", "sentence-transformers")
        }
        runs = {system: " ".join(f"{tokens / t:.0f}" for t in samples[system, dtype]) for system in rates}
        print(
            f"{dtype}: bouquet {rates['bouquet']:.0f} ({runs['bouquet']}), sentence-transformers "
            f"{rates['sentence-transformers']:.0f} ({runs['sentence-transformers']}) tokens/s"
        )
        rows.append((name, dtype, rates["bouquet"], rates["sentence-transformers"], offline.ratio(samples, dtype)))
    return rows


def print_table(rows: list[Row]) -> None:
    print("\n| family | dtype | bouquet tokens/s | sentence-transformers tokens/s | ratio |\n|---|---|---|---|---|")
    for family, dtype, ours, theirs, ratio in rows:
        flag = "" if ratio >= 1.0 else " (slower)"
        print(f"| {family} | {dtype} | {ours:,.0f} | {theirs:,.0f} | {ratio:.2f}x{flag} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    offline.add_measure_arguments(parser, repeats=3, st_search_texts=32)
    parser.add_argument("--documents", type=int, default=48, help="the corpus's first N documents")
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for dtype in args.dtypes.split(","):
        print(f"matrix-product ceiling {dtype}: {offline.matmul_ceiling(offline.DTYPES[dtype]):.0f} GFLOP/s")
    texts = corpus.documents(args.documents)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families.split(","):
            rows += bench_family(name, texts, args, Path(tmp))
    print_table(rows)


if __name__ == "__main__":
    main()
