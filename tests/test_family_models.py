"""The per-family benchmark's model builder (bench/family_models.py), at a tiny shape: every family's directory
loads in bouquet and in sentence-transformers, and both embed the same texts alike, so the benchmark compares
the same computation. No timing here."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import embed_ids, row_cosines
from corpus import documents, queries
from family_models import FAMILIES, MAX_SEQ_LENGTH, build_family

from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.tokenizer import TextTokenizer


@pytest.mark.parametrize("family", FAMILIES)
def test_built_directory_loads_and_matches_sentence_transformers(tmp_path, minilm_path: Path, family: str) -> None:
    from sentence_transformers import SentenceTransformer

    model_path = build_family(family, tmp_path, minilm_path, tiny=True)
    texts = [*documents(4), *queries(4)]
    engine = Engine(EngineConfig(model_path=model_path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
    try:
        assert engine.max_seq_length == MAX_SEQ_LENGTH
        ids = TextTokenizer(engine.spec.tokenizer_file, engine.max_seq_length).encode(texts)
        rows = embed_ids(engine, ids)
    finally:
        engine.close()
    expected = SentenceTransformer(str(model_path), device="cpu").encode(texts)
    assert row_cosines(rows, expected).min() >= 0.99999
