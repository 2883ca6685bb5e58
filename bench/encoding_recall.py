"""What each encoding costs in retrieval: recall@10 of its ranking against float32's, on real text.

The bundled model embeds every paragraph of the standard library's docstrings (the documents, about 2,700) and
every docstring's first line (the queries, about 1,350) through bouquet's engine in float32, normalised as
served. Each encoding then encodes those rows exactly as a replica does (bouquet/encodings.py), and each query
ranks the documents by that encoding's own similarity: the dot product of the floats or of the int8 values, the
Hamming distance of the bits (ties by document order). Recall@10 is the share of float32's ten nearest documents
that the encoding's ten nearest hold, averaged over the queries. Sizes: a row's bytes on the wire, and its share
of a /v1/embeddings answer as the gateway writes it (orjson, as served).

    .venv/bin/python bench/encoding_recall.py [--k 10] [--dimensions 0] [--rescore 40]
"""

from __future__ import annotations

import argparse
import time

import corpus
import numpy as np
import orjson

from bouquet.batch import Batch, RowOptions, token_budget_runs
from bouquet.config import EngineConfig, default_model_path
from bouquet.encodings import FORMATS, LAYOUTS, Encoding, ResponseFormat, decode_rows, encode_rows
from bouquet.engine.engine import Engine
from bouquet.gateway.api.openai import openai_response
from bouquet.tokenizer import TextTokenizer

MODEL = "all-MiniLM-L6-v2"


def embed(engine: Engine, tokenizer: TextTokenizer, texts: list[str], dimensions: int) -> np.ndarray:
    """[N, D] float32 rows in the texts' order, computed in length-sorted batches of up to 4,096 tokens."""
    ids = tokenizer.encode(texts)
    order = np.argsort([len(sequence) for sequence in ids], kind="stable")
    batch = Batch.pack([ids[i] for i in order], RowOptions(dimensions, normalize=True))
    rows = np.empty((len(texts), dimensions or engine.dimension), np.float32)
    for start, stop in token_budget_runs(batch.cu_seqlens, 4096):
        rows[order[start:stop]] = engine.embed(batch.slice(start, stop))[:, : rows.shape[1]]  # zeros beyond
    return rows


def top_k(scores: np.ndarray, k: int) -> np.ndarray:  # [Q, k] document indices, best first, ties by index
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / truth.shape[1] for a, b in zip(found, truth, strict=True)]))


def hamming(queries: np.ndarray, documents: np.ndarray) -> np.ndarray:  # packed bits -> [Q, N] differing bits
    out = np.empty((len(queries), len(documents)), np.int32)
    for start in range(0, len(queries), 64):
        xor = np.bitwise_xor(queries[start : start + 64, None, :], documents[None, :, :])
        out[start : start + 64] = np.bitwise_count(xor).sum(axis=2, dtype=np.int32)
    return out


def similarity(encoding: Encoding, queries: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """The encoding's own similarity of its encoded rows: higher is nearer."""
    if LAYOUTS[encoding].values_per_element == 8:
        return -hamming(queries.view(np.uint8), documents.view(np.uint8)).astype(np.float32)
    if encoding in (Encoding.INT8, Encoding.UINT8):  # integer dot products, uint8 shifted back by 128 first
        shift = 128 if encoding is Encoding.UINT8 else 0
        return (queries.astype(np.float32) - shift) @ (documents.astype(np.float32) - shift).T
    dimension = queries.shape[1]
    return decode_rows(queries, encoding, dimension) @ decode_rows(documents, encoding, dimension).T


def absmax_int8(rows: np.ndarray) -> np.ndarray:  # the scheme not taken: each row scaled by its own largest value
    return np.rint(rows * (127 / np.abs(rows).max(axis=1, keepdims=True))).astype(np.float32)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a / np.linalg.norm(a, axis=1, keepdims=True)) @ (b / np.linalg.norm(b, axis=1, keepdims=True)).T


def answer_bytes(rows: np.ndarray, response_format: ResponseFormat) -> float:
    """A row's share of the /v1/embeddings body the gateway writes for these rows."""
    body = openai_response(encode_rows(rows, response_format.encoding), MODEL, 0, response_format)
    return len(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)) / len(rows)


# encoding_format (and embed_dtype) as a client asks for it: the format, and the label the table gives it.
ANSWERS = [
    ("float", FORMATS["float"]),
    ("base64", FORMATS["base64"]),
    ("base64, embed_dtype float16", ResponseFormat(Encoding.FLOAT16, base64=True)),
    ("base64, embed_dtype bfloat16", ResponseFormat(Encoding.BFLOAT16, base64=True)),
    ("int8", FORMATS["int8"]),
    ("base64_int8", FORMATS["base64_int8"]),
    ("uint8", FORMATS["uint8"]),
    ("binary", FORMATS["binary"]),
    ("ubinary", FORMATS["ubinary"]),
    ("base64_binary", FORMATS["base64_binary"]),
]
METRIC = {
    Encoding.FLOAT32: "dot",
    Encoding.FLOAT16: "dot",
    Encoding.BFLOAT16: "dot",
    Encoding.INT8: "int dot",
    Encoding.UINT8: "int dot of (v - 128)",
    Encoding.BINARY: "Hamming",
    Encoding.UBINARY: "Hamming",
    Encoding.UBINARY_LSB: "Hamming",
}


def uses(queries: np.ndarray, documents: np.ndarray, k: int, rescore: int) -> list[tuple[str, np.ndarray]]:
    """Each way's top k documents for every query: float queries against compact documents, binary candidates
    rescored with int8 documents (sentence-transformers' recipe), uint8 without its shift, and int8 scaled row by
    row (each row's largest value to 127) instead of by its length."""
    dimension = queries.shape[1]
    bits = [encode_rows(rows, Encoding.UBINARY) for rows in (queries, documents)]
    candidates = top_k(similarity(Encoding.UBINARY, *bits), rescore)  # [Q, rescore]
    int8_documents = encode_rows(documents, Encoding.INT8).astype(np.float32)
    rescored = top_k(np.einsum("qd,qcd->qc", queries, int8_documents[candidates]), k)
    uint8 = [encode_rows(rows, Encoding.UINT8).astype(np.float32) for rows in (queries, documents)]
    absmax = [absmax_int8(rows) for rows in (queries, documents)]
    return [
        ("uint8, plain dot (no - 128)", top_k(uint8[0] @ uint8[1].T, k)),
        ("float32 query, int8 documents", top_k(queries @ int8_documents.T, k)),
        ("float32 query, binary documents", top_k(queries @ decode_rows(bits[1], Encoding.UBINARY, dimension).T, k)),
        (f"binary top {rescore}, int8 rescored", np.take_along_axis(candidates, rescored, axis=1)),
        ("int8 by each row's max |x|, cosine", top_k(cosines(*absmax), k)),
        ("int8 by each row's max |x|, dot", top_k(absmax[0] @ absmax[1].T, k)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--dimensions", type=int, default=0, help="Matryoshka truncation first (0: the full width)")
    parser.add_argument("--rescore", type=int, default=40, help="binary candidates rescored with int8")
    args = parser.parse_args()

    path = default_model_path()
    documents, queries = corpus.paragraphs(), list(dict.fromkeys(corpus.queries()))
    engine = Engine(EngineConfig(model_path=path, device="cpu", dtype="float32"))
    tokenizer = TextTokenizer(path / "tokenizer.json", engine.max_seq_length)
    started = time.perf_counter()
    try:
        doc_rows = embed(engine, tokenizer, documents, args.dimensions)
        query_rows = embed(engine, tokenizer, queries, args.dimensions)
    finally:
        engine.close()
    seconds = time.perf_counter() - started
    dimension = doc_rows.shape[1]
    truth = top_k(query_rows @ doc_rows.T, args.k)
    float_json = answer_bytes(doc_rows, FORMATS["float"])

    print(f"{MODEL} (bundled): {len(documents)} documents, {len(queries)} queries, {dimension} dimensions, "
          f"embedded in {seconds:.1f} s; recall@{args.k} against float32's ranking")  # fmt: skip
    print(f"{'encoding_format':30} {'wire B/row':>10} {'JSON B/row':>10} {'x float':>8} {'recall':>7}  similarity")
    for label, response_format in ANSWERS:
        encoding = response_format.encoding
        layout = LAYOUTS[encoding]
        wire = layout.elements(dimension) * layout.dtype.itemsize
        json_bytes = answer_bytes(doc_rows, response_format)
        found = top_k(similarity(encoding, encode_rows(query_rows, encoding), encode_rows(doc_rows, encoding)), args.k)
        print(f"{label:30} {wire:10d} {json_bytes:10.0f} {float_json / json_bytes:7.1f}x "
              f"{recall(found, truth):7.4f}  {METRIC[encoding]}")  # fmt: skip

    print("how compact rows can be used, and the int8 scheme not taken:")
    for label, found in uses(query_rows, doc_rows, args.k, args.rescore):
        print(f"  {label:40} {recall(found, truth):7.4f}")


if __name__ == "__main__":
    main()
