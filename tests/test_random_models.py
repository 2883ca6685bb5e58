"""Qwen3 (last-token pooling, causal and bidirectional) and BERT with CLS pooling against `transformers`,
on small random-weight models loaded through the same loader as real ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import embed_ids, row_cosines
from corpus import NON_ASCII_TEXTS, documents, queries
from random_models import make_bert, make_qwen3

from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.model_dir import PoolingMethod, PoolingSpec, read_model_dir
from bouquet.tokenizer import TextTokenizer

BOUNDS = {"float32": 0.9999, "bfloat16": 0.999}


@pytest.fixture(scope="module")
def token_ids(minilm_path: Path) -> list[list[int]]:
    tokenizer = TextTokenizer(minilm_path / "tokenizer.json", max_length=300)
    return tokenizer.encode([*documents(40), *queries(20), *NON_ASCII_TEXTS[:10], "a"])


def _reference(model: torch.nn.Module, ids: list[list[int]], pick: int, **kwargs) -> np.ndarray:
    rows = []
    with torch.no_grad():
        for seq in ids:  # one at a time: no padding in the reference
            hidden = model(torch.tensor([seq]), **kwargs).last_hidden_state[0]
            rows.append(torch.nn.functional.normalize(hidden[pick], dim=0).numpy())
    return np.stack(rows)


def _engine(path: Path, dtype: str) -> Engine:
    return Engine(EngineConfig(model_path=path, device="cpu", dtype=dtype, cpu_warmup_tokens=0))


def _assert_engine_matches(path: Path, dtype: str, token_ids: list[list[int]], reference: np.ndarray) -> None:
    engine = _engine(path, dtype)
    try:
        cosines = row_cosines(embed_ids(engine, token_ids), reference)
    finally:
        engine.close()
    assert cosines.min() >= BOUNDS[dtype], f"min cosine {cosines.min():.6f}"


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_matches_transformers(tmp_path, minilm_path, token_ids, bidirectional, dtype) -> None:
    reference_model = make_qwen3(tmp_path, minilm_path, bidirectional)
    assert read_model_dir(tmp_path).pooling == PoolingSpec((PoolingMethod.LAST,))
    if bidirectional:
        # transformers' Qwen3 has no bidirectional switch: eager attention with no mask attends to all.
        reference_model.config._attn_implementation = "eager"
        reference = _reference(reference_model, token_ids, -1, attention_mask={"full_attention": None})
    else:
        reference = _reference(reference_model, token_ids, -1)
    _assert_engine_matches(tmp_path, dtype, token_ids, reference)


def test_qwen3_causal_differs_from_bidirectional(tmp_path, minilm_path, token_ids) -> None:
    # Guards the test above: if the flag were ignored, both modes would agree.
    make_qwen3(tmp_path / "causal", minilm_path, bidirectional=False)
    make_qwen3(tmp_path / "bidi", minilm_path, bidirectional=True)
    causal, bidi = _engine(tmp_path / "causal", "float32"), _engine(tmp_path / "bidi", "float32")
    try:
        long_ids = [seq for seq in token_ids if len(seq) > 20]
        assert row_cosines(embed_ids(causal, long_ids), embed_ids(bidi, long_ids)).max() < 0.999
    finally:
        causal.close()
        bidi.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bert_cls_pooling_matches_transformers(tmp_path, minilm_path, token_ids, dtype) -> None:
    reference = _reference(make_bert(tmp_path, minilm_path), token_ids, 0)
    _assert_engine_matches(tmp_path, dtype, token_ids, reference)
