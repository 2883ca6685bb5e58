"""Qwen3-Reranker, the decoder reranker: the score is sigmoid(logit("yes") - logit("no")) at the last token of the
pair read through its prompt template. On a tiny random Qwen3ForCausalLM with a byte-level BPE tokenizer (Qwen's
pre-tokenizer and chat tokens, trained here on the corpus), the reference is its model card's recipe: the template's
prefix and suffix tokenized alone, the instruction, query and document between them as one text truncated from its
end, transformers' causal-LM forward, and the two logits of the last token.

bouquet reads the same checkpoint three ways: as sentence-transformers' CrossEncoder saves it (Transformer then
LogitScore), as a plain directory with vLLM's override keys written into config.json, and converted offline to
Qwen3ForSequenceClassification (the seq-cls checkpoints, whose `score` row is W[yes] - W[no])."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from corpus import documents, queries
from family_models import spread_weights

from bouquet.batch import Batch, RowOptions
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.model_dir import read_model_dir
from bouquet.pair_templates import QWEN3_RERANKER
from bouquet.scoring import activate
from bouquet.tokenizer import TemplatePairTokenizer

LIMIT = 160
# Written out here, as the model card has them, rather than read from bouquet: a typo in either shows.
PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PAIRS = [
    ("What is the capital of China?", "The capital of China is Beijing."),
    ("Explain gravity", "Gravity is a force that attracts two bodies towards each other."),
    ("what is packed attention?", "Packed sequences run without padding, as an LLM's prefill does."),
    ("café", "Ünïcödé façade, naïve café: 東京で会いましょう."),
    ("long", "Every token of a long passage counts. " * 40),  # over the limit: the document is cut
]
BOUNDS = {"float32": 1e-4, "bfloat16": 1e-2}
# Qwen2's pre-tokenizer pattern, so that the template's pieces split where Qwen's tokenizer splits them.
_QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def save_qwen_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer shaped like Qwen's: its pre-tokenizer, chat tokens, no special tokens added."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(_QWEN_PATTERN), behavior="isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    texts = [*documents(200), *queries(100), *[PREFIX + SUFFIX + DEFAULT_INSTRUCTION + " yes no"] * 20]
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens(["<think>", "</think>"])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "model_max_length": LIMIT}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen-tokenizer")
    save_qwen_tokenizer(path)
    return path


def yes_no_ids(tokenizer_dir: Path) -> tuple[int, int]:
    from tokenizers import Tokenizer

    vocabulary = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    yes, no = vocabulary.token_to_id("yes"), vocabulary.token_to_id("no")
    assert yes is not None and no is not None
    return yes, no


def save_reranker(path: Path, tokenizer_dir: Path, tied: bool = True, seed: int = 0):
    """A tiny Qwen3ForCausalLM saved as Qwen3-Reranker is (its tokenizer beside it). Its weights are spread wide;
    the "yes" and "no" rows of its LM head are kept small so the scores spread over (0, 1) instead of saturating."""
    from tokenizers import Tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab_size = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=tied, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    model = Qwen3ForCausalLM(config)
    spread_weights(model, seed)
    with torch.no_grad():
        for token_id in yes_no_ids(tokenizer_dir):
            model.lm_head.weight[token_id] *= 0.15 if tied else 1.0
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return model.eval()


def reference_ids(tokenizer_dir: Path, pairs, instruction: str = DEFAULT_INSTRUCTION) -> list[list[int]]:
    """The model card's `process_inputs`, with transformers' tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    prefix = tokenizer.encode(PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(SUFFIX, add_special_tokens=False)
    bodies = [f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}" for query, document in pairs]
    encoded = tokenizer(bodies, truncation="longest_first", max_length=LIMIT - len(prefix) - len(suffix))
    return [prefix + ids + suffix for ids in encoded["input_ids"]]


def reference_scores(model, ids: list[list[int]], yes: int, no: int) -> np.ndarray:  # [N] p("yes")
    """transformers' causal LM, one sequence at a time: softmax over the "no" and "yes" logits of the last token."""
    with torch.no_grad():
        logits = torch.stack([model(torch.tensor([seq])).logits[0, -1] for seq in ids])
    return torch.softmax(logits[:, [no, yes]].float(), dim=1)[:, 1].numpy()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, tokenizer_dir: Path):
    path = tmp_path_factory.mktemp("qwen3-reranker") / "Qwen3-Reranker-tiny"
    return path, save_reranker(path, tokenizer_dir)


def test_pairs_are_tokenized_as_the_model_card_does(reranker, tokenizer_dir: Path) -> None:
    path, _ = reranker
    ours = TemplatePairTokenizer(path / "tokenizer.json", QWEN3_RERANKER, LIMIT)
    expected = reference_ids(tokenizer_dir, PAIRS)
    assert ours.encode_pairs(PAIRS) == expected
    assert len(expected[-1]) == LIMIT and expected[-1][-len(ours.suffix) :] == ours.suffix  # cut, suffix kept
    instruction = "Find the passage that answers the question"
    assert ours.encode_pairs(PAIRS[:2], instruction=instruction) == reference_ids(tokenizer_dir, PAIRS[:2], instruction)


def _layout(kind: str, hf_dir: Path, root: Path) -> Path:
    if kind == "sentence-transformers":
        from sentence_transformers import CrossEncoder

        CrossEncoder(str(hf_dir), device="cpu").save(str(root / "st"))
        return root / "st"
    if kind == "vLLM keys":
        shutil.copytree(hf_dir, root / "vllm")
        config_file = root / "vllm" / "config.json"
        config = json.loads(config_file.read_text())
        config.update(classifier_from_token=["no", "yes"], is_original_qwen3_reranker=True)
        config_file.write_text(json.dumps(config))
        return root / "vllm"
    assert kind == "converted seq-cls"
    return _converted(hf_dir, root / "seq-cls")


def _converted(hf_dir: Path, out: Path) -> Path:
    """Qwen3-Reranker-seq-cls's conversion: Qwen3ForSequenceClassification, one label, score = W[yes] - W[no]."""
    from transformers import Qwen3ForCausalLM, Qwen3ForSequenceClassification

    causal = Qwen3ForCausalLM.from_pretrained(str(hf_dir))
    config = causal.config
    config.num_labels, config.architectures = 1, ["Qwen3ForSequenceClassification"]
    classifier = Qwen3ForSequenceClassification(config)
    classifier.model.load_state_dict(causal.model.state_dict())
    yes, no = yes_no_ids(hf_dir)
    with torch.no_grad():
        classifier.score.weight.copy_(causal.lm_head.weight[yes] - causal.lm_head.weight[no])
    classifier.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / name, out / name)
    return out


def engine_scores(model_dir: Path, dtype: str) -> np.ndarray:  # [N] activated as the model says
    spec = read_model_dir(model_dir)
    assert (spec.architecture, spec.score_activation) == ("Qwen3ForSequenceClassification", "Sigmoid")
    ids = TemplatePairTokenizer(spec.tokenizer_file, QWEN3_RERANKER, LIMIT).encode_pairs(PAIRS)
    engine = Engine(EngineConfig(model_path=model_dir, device="cpu", dtype=dtype, cpu_warmup_tokens=0))
    try:
        assert (engine.task, engine.dimension, engine.pooling.name) == ("score", 1, "lasttoken")
        logits = engine.embed(Batch.pack(ids, RowOptions(normalize=False)))
    finally:
        engine.close()
    return activate(logits, spec.score_activation)[:, 0]


@pytest.mark.parametrize("kind", ["sentence-transformers", "vLLM keys", "converted seq-cls"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scores_match_the_causal_lm(tmp_path, reranker, tokenizer_dir: Path, kind: str, dtype: str) -> None:
    path, model = reranker
    expected = reference_scores(model, reference_ids(tokenizer_dir, PAIRS), *yes_no_ids(tokenizer_dir))
    scores = engine_scores(_layout(kind, path, tmp_path), dtype)
    print(f"max score difference {np.abs(scores - expected).max():.2e}")  # shown with -rP
    np.testing.assert_allclose(scores, expected, atol=BOUNDS[dtype], rtol=0)
    assert np.ptp(expected) > 0.1  # scores spread over (0, 1): a wrong token, row or position would show


def test_untied_lm_head(tmp_path, tokenizer_dir: Path) -> None:
    """Qwen3-Reranker-4B and -8B keep an LM head of their own beside the token embeddings."""
    model = save_reranker(tmp_path / "hf", tokenizer_dir, tied=False, seed=1)
    expected = reference_scores(model, reference_ids(tokenizer_dir, PAIRS), *yes_no_ids(tokenizer_dir))
    scores = engine_scores(_layout("vLLM keys", tmp_path / "hf", tmp_path), "float32")
    np.testing.assert_allclose(scores, expected, atol=BOUNDS["float32"], rtol=0)


def test_a_plain_causal_lm_stays_an_embedding_model(reranker) -> None:
    """Without a LogitScore module or vLLM's keys nothing says the directory is a reranker (Qwen3-Embedding's
    config names Qwen3ForCausalLM too)."""
    spec = read_model_dir(reranker[0])
    assert spec.architecture == "Qwen3ForCausalLM" and spec.task is None


def test_vllm_keys_it_cannot_read_are_refused(tmp_path, reranker) -> None:
    shutil.copytree(reranker[0], tmp_path / "m")
    config_file = tmp_path / "m" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "classifier_from_token": ["no", "yes"]}))
    with pytest.raises(ValueError, match="classifier_from_token"):
        read_model_dir(tmp_path / "m")
    config_file.write_text(json.dumps({**config, "classifier_from_token": ["nope-not-a-token"]}))
    with pytest.raises(ValueError, match="is no token"):
        read_model_dir(tmp_path / "m")


def test_a_gateway_without_the_directory_reads_pairs_through_the_template(reranker, tokenizer_dir: Path) -> None:
    """What the gateway learns from a replica's Info alone (no local copy of the model): the template, from the
    architecture, and transformers' label name."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from bouquet.gateway.replicas.catalog import ModelCatalog
    from bouquet.proto import embedding_pb2

    tokenizer_json = (reranker[0] / "tokenizer.json").read_text()
    info = embedding_pb2.InfoResponse(
        model_name="reranker", architecture="Qwen3ForSequenceClassification", task="score", dimension=1,
        max_seq_length=LIMIT, vocab_size=2005, tokenizer_json=tokenizer_json, score_activation="Sigmoid",
    )  # fmt: skip
    with ThreadPoolExecutor(1) as executor:
        model = ModelCatalog((), executor).register(info)
        assert model.pair_template is QWEN3_RERANKER and model.labels == ("LABEL_0",)
        ids, types = asyncio.run(model.require_tokenizer().encode_pairs(PAIRS, truncate=True))
    assert ids == reference_ids(tokenizer_dir, PAIRS) and types is None
