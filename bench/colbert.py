"""ColBERT token vectors: bouquet's engine against PyLate's encode, in this process, on the same texts (issue 28).

The model: all-MiniLM-L6-v2's real encoder with a random 384 -> 128 projection, saved in PyLate's layout
(tests/colbert_models.py writes the files as PyLate's `ColBERT.save` does): the shape of answerai-colbert-small
and colbert-small models (6 layers, 384 wide, 128-dimensional vectors). PyLate itself does not install beside this
project's transformers (docs/late-interaction.md), so its `ColBERT.encode` is reimplemented here as its 1.6.0
source runs it: texts sorted by length, batches of 32 padded to their longest (queries to the query length with
[MASK]), the prefix token after [CLS], transformers' forward, the Dense projection on every token, L2
normalisation, a document's skiplist and padding dropped. bouquet runs the same layout packed, in batches of up to
`--batch-tokens` tokens, as its replica would.

Printed: token vectors a second and texts a second for documents and queries (medians over `--repeats`,
interleaved), one query's latency, the ratio, the bytes a document's vectors take in each encoding on the wire, and
the least cosine between the two implementations' vectors.

    .venv/bin/python bench/colbert.py [--repeats 3] [--docs 300] [--queries 300] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import string
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import corpus
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from colbert_models import PREFIXES, build_pylate_from

from bouquet.batch import RowOptions, token_budget_runs
from bouquet.config import EngineConfig, default_model_path
from bouquet.cpu_features import cpu_features
from bouquet.encodings import Encoding, encode_rows
from bouquet.engine.engine import Engine
from bouquet.gateway.late_interaction import lay_out, pack, token_limit
from bouquet.replica.server import multi_vector_info
from bouquet.tokenizer import TextTokenizer

DIMENSION = 128
QUERY_LENGTH, DOCUMENT_LENGTH = 32, 180  # PyLate's defaults
PYLATE_BATCH = 32


class PyLate:
    """PyLate 1.6.0's ColBERT.encode on transformers' BertModel (module docstring)."""

    def __init__(self, model_dir: Path, projection: torch.nn.Linear):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer.pad_token_id = self.tokenizer.mask_token_id
        self.model = AutoModel.from_pretrained(str(model_dir)).eval()
        self.projection = projection
        self.skiplist = torch.tensor(self.tokenizer.convert_tokens_to_ids(list(string.punctuation)))

    def encode(self, texts: list[str], is_query: bool) -> list[np.ndarray]:
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out: list[np.ndarray] = [np.empty(0)] * len(texts)
        for start in range(0, len(texts), PYLATE_BATCH):
            chosen = order[start : start + PYLATE_BATCH]
            for index, vectors in zip(chosen, self._batch([texts[i] for i in chosen], is_query), strict=True):
                out[index] = vectors
        return out

    @torch.inference_mode()
    def _batch(self, texts: list[str], is_query: bool) -> list[np.ndarray]:
        length = QUERY_LENGTH if is_query else DOCUMENT_LENGTH
        padding = "max_length" if is_query else "longest"
        encoded = self.tokenizer(texts, truncation=True, max_length=length - 1, padding=padding, return_tensors="pt")
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        prefix = self.tokenizer.convert_tokens_to_ids(PREFIXES[0] if is_query else PREFIXES[1])
        ids = torch.cat([ids[:, :1], torch.full((len(texts), 1), prefix), ids[:, 1:]], dim=1)
        mask = torch.cat([mask[:, :1], torch.ones(len(texts), 1, dtype=mask.dtype), mask[:, 1:]], dim=1)
        states = self.projection(self.model(input_ids=ids, attention_mask=mask).last_hidden_state)
        vectors = torch.nn.functional.normalize(states, p=2, dim=2)
        keep = torch.ones_like(mask, dtype=torch.bool) if is_query else ~torch.isin(ids, self.skiplist) & mask.bool()
        return [row[kept].numpy() for row, kept in zip(vectors, keep, strict=True)]


class Bouquet:
    """The engine on the layout the gateway sends (gateway/late_interaction.py), in token-budget batches."""

    def __init__(self, model_dir: Path, dtype: str, batch_tokens: int):
        self.engine = Engine(EngineConfig(model_path=model_dir, device="cpu", dtype=dtype))
        self.info = multi_vector_info(self.engine.spec.multi_vector, self.engine.max_seq_length)
        assert self.info is not None
        self.batch_tokens = batch_tokens
        self.tokenizers = {
            is_query: TextTokenizer(self.engine.spec.tokenizer_file, max_length=token_limit(self.info, is_query))
            for is_query in (True, False)
        }

    def encode(self, texts: list[str], is_query: bool) -> list[np.ndarray]:
        assert self.info is not None
        layout = lay_out(self.tokenizers[is_query].encode(texts), self.info, is_query)
        batch = pack(layout, RowOptions(normalize=True, token_vectors=True))
        parts = [
            self.engine.embed(batch.slice(start, stop))[:, :DIMENSION]
            for start, stop in token_budget_runs(batch.cu_seqlens, self.batch_tokens)
        ]
        return np.split(np.concatenate(parts), np.cumsum([len(spans) for spans in layout.spans])[:-1])


def timed(encode: Callable[[list[str], bool], list[np.ndarray]], texts: list[str], is_query: bool) -> float:
    started = time.perf_counter()
    encode(texts, is_query)
    return time.perf_counter() - started


def least_cosine(ours: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    return min(float(((a * b).sum(1)).min()) for a, b in zip(ours, theirs, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    args = parser.parse_args()
    documents, queries = corpus.documents(args.docs), list(dict.fromkeys(corpus.queries()))[: args.queries]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, projection = build_pylate_from(
            default_model_path(), Path(tmp) / "colbert-minilm", DIMENSION, QUERY_LENGTH, DOCUMENT_LENGTH
        )
        ours, theirs = Bouquet(model_dir, args.dtype, args.batch_tokens), PyLate(model_dir, projection)
        print(f"CPU: {cpu_features().describe()}; torch threads {torch.get_num_threads()}; bouquet {args.dtype}, "
              f"PyLate's encode reimplemented, float32")  # fmt: skip
        report(ours, theirs, documents, queries, args.repeats)
        ours.engine.close()


def report(ours: Bouquet, theirs: PyLate, documents: list[str], queries: list[str], repeats: int) -> None:
    for label, texts, is_query in (("documents", documents, False), ("queries", queries, True)):
        mine, reference = ours.encode(texts, is_query), theirs.encode(texts, is_query)
        vectors = sum(len(rows) for rows in mine)
        assert vectors == sum(len(rows) for rows in reference)
        seconds: dict[str, list[float]] = {"bouquet": [], "PyLate": []}
        for _ in range(repeats):
            seconds["bouquet"].append(timed(ours.encode, texts, is_query))
            seconds["PyLate"].append(timed(theirs.encode, texts, is_query))
        best = {name: statistics.median(values) for name, values in seconds.items()}
        print(f"\n{label}: {len(texts)} texts, {vectors} token vectors; least cosine bouquet/PyLate "
              f"{least_cosine(mine, reference):.6f}")  # fmt: skip
        for name, value in best.items():
            print(f"  {name:8s} {vectors / value:10,.0f} vectors/s {len(texts) / value:8,.1f} texts/s")
        print(f"  ratio    {best['PyLate'] / best['bouquet']:.2f}x")
        if not is_query:
            per_document = vectors / len(texts)
            for encoding in (Encoding.FLOAT32, Encoding.FLOAT16, Encoding.INT8, Encoding.UBINARY):
                size = encode_rows(mine[0][:1], encoding).nbytes * per_document
                name = encoding.name.lower()
                print(f"  {name:8s} {size:10,.0f} bytes a document on the wire ({size * 4 / 3:,.0f} in base64)")
    latencies: dict[str, list[float]] = {"bouquet": [], "PyLate": []}
    for query in queries[:100]:
        latencies["bouquet"].append(timed(ours.encode, [query], True))
        latencies["PyLate"].append(timed(theirs.encode, [query], True))
    p50 = {name: statistics.median(values) * 1e3 for name, values in latencies.items()}
    print(f"\none query at a time, p50: bouquet {p50['bouquet']:.2f} ms, PyLate {p50['PyLate']:.2f} ms "
          f"({p50['bouquet'] / p50['PyLate']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
