"""Cross-encoder rerankers (sequence-classification heads) in the engine, against sentence-transformers'
CrossEncoder on the same (query, passage) pairs: the directory CrossEncoder saves today and a plain Hugging Face
one (how older CrossEncoders were saved), one label (sigmoid) and several (raw), float32 and bfloat16."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from family_checks import VOCAB_SIZE, save_tiny
from tokenizers import Tokenizer

from bouquet.batch import Batch, RowOptions
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.model_dir import read_model_dir
from bouquet.scoring import activate

PAIRS = [
    ("what is packed attention", "Packed sequences run without padding, as an LLM's prefill does."),
    ("what is packed attention", "The weather in Lisbon is mild in December."),
    ("café", "Ünïcödé façade, naïve café: 東京で会いましょう."),
    ("long", "Every token of a long passage counts. " * 40),  # over the 64-token limit: truncated
    ("q", "one"),
]
BOUNDS = {"float32": 1e-4, "bfloat16": 2e-2}
LIMIT = 64


def _tiny_classifier(kind: str, path: Path, tokenizer_dir: Path, labels: int) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, XLMRobertaConfig
    from transformers import XLMRobertaForSequenceClassification as XLMRClassifier

    shape = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, num_labels=labels)  # fmt: skip
    if kind == "bert":
        model = BertForSequenceClassification(BertConfig(**shape, max_position_embeddings=LIMIT))
    else:  # two token types: the MiniLM tokenizer the test uses marks the passage as type 1
        config = XLMRobertaConfig(**shape, max_position_embeddings=LIMIT + 2, type_vocab_size=2, pad_token_id=1)
        model = XLMRClassifier(config)
    save_tiny(model, path, tokenizer_dir)
    return path


def _pairs_batch(model_dir: Path, limit: int) -> Batch:
    """The pairs as the model's tokenizer pairs them ([CLS] q [SEP] p [SEP], token types 0 then 1), the longest
    part truncated first, as the CrossEncoder's tokenizer call does."""
    tokenizer = Tokenizer.from_file(str(read_model_dir(model_dir).tokenizer_file))
    tokenizer.no_padding()
    tokenizer.enable_truncation(limit, strategy="longest_first")
    encodings = tokenizer.encode_batch(PAIRS)
    return Batch.pack([e.ids for e in encodings], RowOptions(normalize=False), [e.type_ids for e in encodings])


@pytest.mark.parametrize("kind", ["bert", "xlm_roberta"])
@pytest.mark.parametrize("labels", [1, 3])
@pytest.mark.parametrize("layout", ["current", "plain Hugging Face"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scores_match_cross_encoder(tmp_path, minilm_path, kind: str, labels: int, layout: str, dtype: str) -> None:
    from sentence_transformers import CrossEncoder

    hf_dir = _tiny_classifier(kind, tmp_path / "hf", minilm_path, labels)
    reference = CrossEncoder(str(hf_dir), device="cpu", max_length=LIMIT)
    expected = reference.predict(PAIRS, convert_to_numpy=True).reshape(len(PAIRS), -1)
    model_dir = hf_dir
    if layout == "current":
        reference.save(str(tmp_path / "current"))
        model_dir = tmp_path / "current"
    spec = read_model_dir(model_dir)
    assert spec.score_activation == ("Sigmoid" if labels == 1 else "Identity")
    engine = Engine(EngineConfig(model_path=model_dir, device="cpu", dtype=dtype))
    try:
        assert (engine.task, engine.dimension) == ("score", labels)
        logits = engine.embed(_pairs_batch(model_dir, LIMIT))
    finally:
        engine.close()
    np.testing.assert_allclose(activate(logits, spec.score_activation), expected, atol=BOUNDS[dtype], rtol=0)
    assert np.ptp(expected) > 10 * BOUNDS["float32"]  # scores that differ: a wrong head would show


def test_an_embedding_layout_on_a_classifier_is_refused(tmp_path, minilm_path) -> None:
    import json

    hf_dir = _tiny_classifier("bert", tmp_path / "hf", minilm_path, 1)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (hf_dir / "modules.json").write_text(json.dumps(modules))
    (hf_dir / "1_Pooling").mkdir()
    (hf_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    with pytest.raises(ValueError, match="give the task 'embed', but BertForSequenceClassification computes 'score'"):
        Engine(EngineConfig(model_path=hf_dir, device="cpu", dtype="float32")).close()
