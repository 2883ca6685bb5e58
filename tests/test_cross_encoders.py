"""Cross-encoder rerankers (sequence-classification heads: BERT, XLM-RoBERTa, ModernBERT) in the engine, against
sentence-transformers' CrossEncoder on the same (query, passage) pairs: the directory CrossEncoder saves today and a
plain Hugging Face one (how older CrossEncoders were saved), one label (sigmoid) and several (raw), float32 and
bfloat16."""

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
BOUNDS = {"float32": 1e-4, "bfloat16": 1e-2}  # absolute, on scores (a sigmoid's) and float32 logits
# bfloat16 raw logits (several labels, no activation): relative to the largest. transformers' own bfloat16 forward is
# as far from its float32 one (1.5% on ModernBERT's three labels, 1.4% on BERT's).
RAW_BFLOAT16 = 1.5e-2
LIMIT = 64


def _tiny_classifier(kind: str, path: Path, tokenizer_dir: Path, labels: int, **options) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, XLMRobertaConfig
    from transformers import XLMRobertaForSequenceClassification as XLMRClassifier

    shape = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, num_labels=labels, **options)  # fmt: skip
    if kind == "bert":
        model = BertForSequenceClassification(BertConfig(**shape, max_position_embeddings=LIMIT))
    elif kind == "modernbert":
        model = _tiny_modernbert(shape)
    else:  # two token types: the MiniLM tokenizer the test uses marks the passage as type 1
        config = XLMRobertaConfig(**shape, max_position_embeddings=LIMIT + 2, type_vocab_size=2, pad_token_id=1)
        model = XLMRClassifier(config)
    save_tiny(model, path, tokenizer_dir)
    return path


def _tiny_modernbert(shape: dict):
    """Three layers, a global one between local ones of a 16-token window (the 64-token pairs are longer): a
    layer of the wrong kind, or the head's pooling, norm or activation wrong, moves the scores."""
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    config = ModernBertConfig(
        **{**shape, "num_hidden_layers": 3}, max_position_embeddings=LIMIT, local_attention=16,
        global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=101, eos_token_id=102, cls_token_id=101,
        sep_token_id=102,
    )  # fmt: skip
    return ModernBertForSequenceClassification(config)


def _pairs_batch(model_dir: Path, limit: int) -> Batch:
    """The pairs as the model's tokenizer pairs them ([CLS] q [SEP] p [SEP], token types 0 then 1), the longest
    part truncated first, as the CrossEncoder's tokenizer call does."""
    tokenizer = Tokenizer.from_file(str(read_model_dir(model_dir).tokenizer_file))
    tokenizer.no_padding()
    tokenizer.enable_truncation(limit, strategy="longest_first")
    encodings = tokenizer.encode_batch(PAIRS)
    return Batch.pack([e.ids for e in encodings], RowOptions(normalize=False), [e.type_ids for e in encodings])


@pytest.mark.parametrize("kind", ["bert", "xlm_roberta", "modernbert"])
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
    assert read_model_dir(model_dir).score_activation == ("Sigmoid" if labels == 1 else "Identity")
    _assert_scores_match(model_dir, expected, dtype)


def test_modernbert_mean_pooling_biases_and_activation(tmp_path, minilm_path) -> None:
    """`classifier_pooling: mean`, a biased dense and norm in the head, and another activation than GELU."""
    from sentence_transformers import CrossEncoder

    options = dict(classifier_pooling="mean", classifier_bias=True, norm_bias=True, classifier_activation="silu")
    hf_dir = _tiny_classifier("modernbert", tmp_path / "hf", minilm_path, 2, **options)
    expected = CrossEncoder(str(hf_dir), device="cpu", max_length=LIMIT).predict(PAIRS, convert_to_numpy=True)
    _assert_scores_match(hf_dir, expected, "float32")


def _assert_scores_match(model_dir: Path, expected: np.ndarray, dtype: str) -> None:
    spec = read_model_dir(model_dir)
    engine = Engine(EngineConfig(model_path=model_dir, device="cpu", dtype=dtype, cpu_warmup_tokens=0))
    try:
        assert (engine.task, engine.dimension) == ("score", expected.shape[1])
        logits = engine.embed(_pairs_batch(model_dir, LIMIT))
    finally:
        engine.close()
    scores = activate(logits, spec.score_activation)
    print(f"max score difference {np.abs(scores - expected).max():.2e}")  # shown with -rP
    np.testing.assert_allclose(scores, expected, atol=_bound(dtype, spec.score_activation, expected), rtol=0)
    assert np.ptp(expected) > 10 * BOUNDS["float32"]  # scores that differ: a wrong head would show


def _bound(dtype: str, activation: str, expected: np.ndarray) -> float:
    raw = dtype == "bfloat16" and activation == "Identity"
    return RAW_BFLOAT16 * float(np.abs(expected).max()) if raw else BOUNDS[dtype]


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
        Engine(EngineConfig(model_path=hf_dir, device="cpu", dtype="float32", cpu_warmup_tokens=0)).close()
