"""A text model whose tokenizer has a chat template, in sentence-transformers 6's layouts: a tiny random-weight Qwen3
(transformers' Qwen3Model, a Qwen-style tokenizer with a chat template as Qwen3-Embedding's tokenizer_config.json
has one) wrapped by sentence-transformers' own Transformer, last-token Pooling and Normalize, and saved by its saver.

sentence-transformers 6 infers the "message" modality for it (transformer.py's `infer_modalities`: the tokenizer has a
chat template) and saves that in sentence_bert_config.json, and its encode() then writes every plain string as a user
message through the template (`preprocess`: "Always convert to the message format if it's supported"), the prompt a
system message. A directory without modality_config (saved before it existed, as Qwen3-Embedding's is) loads
text-only (`load_config`), and its strings are tokenized as they are. bouquet's rows against encode() in both, float32,
cosine >= 0.99999: plain strings, the query prompt, and texts over the limit (cut, the template's tail restored)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import row_cosines
from family_models import spread_weights
from in_process import engines, served
from qwen3_vl_models import qwen_tokenizer

BOUND = 0.99999
LIMIT = 24  # max_seq_length: the long text is cut
MESSAGES = "tiny-qwen3-st-messages"  # built by sentence-transformers 6: its texts are conversations
LEGACY = "tiny-qwen3-st-text"  # the same without modality_config: texts as they are
QUERY = "Instruct: find the passage\nQuery:"
LONG = "The quick brown fox jumps over the lazy dog. " * 4  # over LIMIT tokens in its conversation
TEXTS = ["A photo of a cat on a red sofa.", "Find the chart of revenue.", LONG]
# Qwen3's template for system and user messages: its content a string, so sentence-transformers infers "flat".
TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
BOS = "tiny-qwen3-st-bos"  # a template that reads a message's parts and begins with the tokenizer's bos_token
# As Gemma's and Mistral's begin: {{ bos_token }}, which transformers hands the template; "structured" (its 'type').
BOS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endfor %}"
)


def _save(root: Path, name: str, template: str) -> object:
    """The tiny Qwen3, its tokenizer given `template`, as sentence-transformers 6 builds and saves it (root/name); its
    SentenceTransformer."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = template
    tokenizer.bos_token = "<|endoftext|>"
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    model = Qwen3Model(config)
    spread_weights(model, seed=0, scale=0.15)
    source = root / f"{name}-transformers"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    transformer = Transformer(str(source), max_seq_length=LIMIT)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    st = SentenceTransformer(modules=[transformer, pooling, Normalize()], prompts={"query": QUERY})
    st.save(str(root / name))
    shutil.rmtree(source)
    return st


def _without_modalities(root: Path, name: str, copy: str) -> Path:
    """root/name copied to root/copy without modality_config, as saved before sentence-transformers had it."""
    shutil.copytree(root / name, root / copy)
    config_file = root / copy / "sentence_bert_config.json"
    saved = json.loads(config_file.read_text())
    del saved["modality_config"], saved["module_output_name"]
    config_file.write_text(json.dumps(saved))
    return root / copy


@pytest.fixture(scope="module")
def st_models(tmp_path_factory) -> tuple[Path, dict[str, object]]:
    from sentence_transformers import SentenceTransformer

    root = tmp_path_factory.mktemp("qwen3-st-messages")
    built = {MESSAGES: _save(root, MESSAGES, TEMPLATE), BOS: _save(root, BOS, BOS_TEMPLATE)}
    return root, {**built, LEGACY: SentenceTransformer(str(_without_modalities(root, MESSAGES, LEGACY)))}


@pytest.fixture(scope="module")
def client(st_models) -> Iterator[httpx.Client]:
    root, _ = st_models
    with engines(root / MESSAGES, root / LEGACY, root / BOS) as built, served(built) as running:
        yield running.client


def _rows(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], np.float32)


def test_sentence_transformers_templates_only_the_layout_with_messages(st_models) -> None:
    """The premise: the saver writes "message" (format "flat", or "structured" for a template that reads parts) for a
    text model whose tokenizer has a chat template, its encode() of plain strings is a conversation's row, and
    without modality_config it is the raw text's."""
    root, models = st_models
    modalities = json.loads((root / MESSAGES / "sentence_bert_config.json").read_text())["modality_config"]
    assert set(modalities) == {"text", "message"} and modalities["message"]["format"] == "flat", modalities
    bos = json.loads((root / BOS / "sentence_bert_config.json").read_text())["modality_config"]["message"]
    assert bos["format"] == "structured", bos
    assert set(models[LEGACY][0].modality_config) == {"text"}  # type: ignore[index]
    templated = models[MESSAGES].encode(TEXTS[:2], convert_to_numpy=True)  # type: ignore[attr-defined]
    raw = models[LEGACY].encode(TEXTS[:2], convert_to_numpy=True)  # type: ignore[attr-defined]
    assert row_cosines(templated, raw).max() < 0.99


@pytest.mark.parametrize("name", [MESSAGES, LEGACY, BOS])
def test_texts_match_sentence_transformers(client: httpx.Client, st_models, name: str) -> None:
    """Plain strings, one over the limit: the conversation's row (cut with its tail) or the raw text's."""
    expected = st_models[1][name].encode(TEXTS, convert_to_numpy=True)
    cosines = row_cosines(_rows(client.post("/v1/embeddings", json={"model": name, "input": TEXTS})), expected)
    assert cosines.min() >= BOUND, cosines


def test_conversations_are_cut_not_windowed(client: httpx.Client, st_models) -> None:
    """long_input "chunk" averages windows of a text; a window of a conversation is none, so its texts are cut as
    sentence-transformers cuts them."""
    expected = st_models[1][MESSAGES].encode([LONG], convert_to_numpy=True)
    body = {"model": MESSAGES, "input": [LONG], "long_input": "chunk"}
    assert row_cosines(_rows(client.post("/v1/embeddings", json=body)), expected).min() >= BOUND


@pytest.mark.parametrize("name", [MESSAGES, LEGACY, BOS])
def test_a_query_prompt_matches_sentence_transformers(client: httpx.Client, st_models, name: str) -> None:
    """TEI's prompt_name: a system message where the texts are conversations, else the prompt before the text."""
    expected = st_models[1][name].encode(TEXTS, prompt_name="query", convert_to_numpy=True)
    response = client.post("/embed", json={"model": name, "inputs": TEXTS, "prompt_name": "query"})
    assert response.status_code == 200, response.text
    cosines = row_cosines(np.array(response.json(), np.float32), expected)
    assert cosines.min() >= BOUND, cosines
