"""A text model whose tokenizer has a chat template, in sentence-transformers 6's layouts: a tiny random-weight Qwen3
(transformers' Qwen3Model, a Qwen-style tokenizer with a chat template as Qwen3-Embedding's tokenizer_config.json
has one) wrapped by sentence-transformers' own Transformer, last-token Pooling and Normalize, and saved by its saver.

sentence-transformers 6 infers the "message" modality for it (transformer.py's `infer_modalities`: the tokenizer has a
chat template) and saves that in sentence_bert_config.json, and its encode() then writes every plain string as a user
message through the template (`preprocess`: "Always convert to the message format if it's supported"), the prompt a
system message. A directory without modality_config (saved before it existed, as Qwen3-Embedding's is) loads
text-only (`load_config`), and its strings are tokenized as they are. bouquet's rows against encode() in both, float32,
cosine >= 0.99999 (bfloat16 >= 0.999): plain strings, the query prompt, and texts over the limit (cut, the template's
tail restored, from either side); and every route that tokenizes texts against the library's own tokenization:
/tokenize, contextual chunks, /embed_all."""

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
from in_process import engines, runs_an_event_loop, served
from qwen3_vl_models import qwen_tokenizer

from bouquet.text_messages import TextMessages

BOUND = 0.99999
BFLOAT16_BOUND = 0.999
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

DATED = "tiny-qwen3-st-dated"  # a template that reads what transformers' renderer gives beyond the messages
# As Mistral Small 3's and Llama 3's date their system prompt (strftime_now; the year, so a render at midnight
# agrees), a check of `documents` (transformers passes tools and documents, None when there are none), and a reply
# marked for assistant masks ({% generation %}, transformers' own tag).
DATED_TEMPLATE = (
    "{%- set year = strftime_now('%Y') %}{%- if documents is defined %}{{ 'no documents\n' }}{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\n' }}"
    "{%- if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}"
    "{%- else %}{{ message.content }}{%- endif %}{{ '<|im_end|>\n' }}{%- endfor %}{{ 'year ' + year }}"
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


TEMPLATES = {MESSAGES: TEMPLATE, BOS: BOS_TEMPLATE, DATED: DATED_TEMPLATE}


@pytest.fixture(scope="module")
def st_models(tmp_path_factory) -> tuple[Path, dict[str, object]]:
    from sentence_transformers import SentenceTransformer

    root = tmp_path_factory.mktemp("qwen3-st-messages")
    built = {name: _save(root, name, template) for name, template in TEMPLATES.items()}
    return root, {**built, LEGACY: SentenceTransformer(str(_without_modalities(root, MESSAGES, LEGACY)))}


@pytest.fixture(scope="module")
def client(st_models) -> Iterator[httpx.Client]:
    root, _ = st_models
    with engines(root / MESSAGES, root / LEGACY, root / BOS, root / DATED) as built, served(built) as running:
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


@pytest.mark.parametrize("name", [MESSAGES, LEGACY, BOS, DATED])
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


def _st_ids(model: object, text: str, prompt: str | None) -> list[int]:
    """The ids sentence-transformers' own preprocessing gives one text, untruncated (as TEI's /tokenize answers)."""
    untruncated = {"text": {"truncation": False}}
    features = model.preprocess([text], prompt=prompt, processing_kwargs=untruncated)  # type: ignore[attr-defined]
    ids: list[int] = features["input_ids"][0].tolist()
    return ids


@pytest.mark.parametrize("name", [MESSAGES, LEGACY, BOS, DATED])
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_tokenize_answers_the_tokens_embedded(client: httpx.Client, st_models, name: str, prompt_name: str | None):
    """TEI's /tokenize and vLLM's body: a conversation's tokens (its template's, the system prompt's), as
    sentence-transformers tokenizes it for encode(); the raw text's (the prompt before it) for a text-only layout."""
    st = st_models[1][name]
    prompt = QUERY if prompt_name else None
    body = {"model": name, "inputs": TEXTS[:2], "prompt_name": prompt_name}
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    assert [[token["id"] for token in tokens] for tokens in response.json()] == [
        _st_ids(st, text, prompt) for text in TEXTS[:2]
    ]
    if prompt is None:
        vllm = client.post("/tokenize", json={"model": name, "prompt": TEXTS[0]})
        assert vllm.status_code == 200, vllm.text
        assert vllm.json()["tokens"] == _st_ids(st, TEXTS[0], None)


def test_tokenize_spans_are_the_rendered_conversation(client: httpx.Client, st_models) -> None:
    """Each token's text is its span of the conversation the template renders (the tokenizer's chat template)."""
    tokenizer = st_models[1][MESSAGES].tokenizer
    response = client.post("/tokenize", json={"model": MESSAGES, "inputs": TEXTS[0]})
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": TEXTS[0]}], tokenize=False)
    assert "".join(token["text"] for token in response.json()[0]) == rendered


def test_tokenize_without_special_tokens_is_refused_for_conversations(client: httpx.Client) -> None:
    """A conversation's tokens without "special tokens" would be no sequence it embeds: refused, naming why."""
    for body in ({"inputs": TEXTS[0]}, {"prompt": TEXTS[0]}):
        response = client.post("/tokenize", json={"model": MESSAGES, **body, "add_special_tokens": False})
        assert response.status_code in (400, 422) and "conversation" in response.text, response.text
    legacy = client.post("/tokenize", json={"model": LEGACY, "inputs": TEXTS[0], "add_special_tokens": False})
    assert legacy.status_code == 200, legacy.text


def test_conversations_are_rendered_off_the_event_loop(client: httpx.Client, monkeypatch) -> None:
    """A chat template's render is Python work per text (and /tokenize's answer a dict per token): both run on the
    gateway's executor, in a thread that runs no event loop, for embeddings and /tokenize alike."""
    on_a_loop: list[bool] = []
    render = TextMessages.render

    def recording(self: TextMessages, *args: object) -> str:
        on_a_loop.append(runs_an_event_loop())
        return render(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(TextMessages, "render", recording)
    requests = (("/embed", {"inputs": TEXTS}), ("/tokenize", {"inputs": TEXTS}), ("/tokenize", {"prompt": LONG}))
    for path, body in requests:
        response = client.post(path, json={"model": MESSAGES, **body})
        assert response.status_code == 200, response.text
    assert len(on_a_loop) >= 2 * len(TEXTS) + 1 and not any(on_a_loop), on_a_loop


def test_left_truncation_matches_sentence_transformers(client: httpx.Client, st_models) -> None:
    """TEI's truncation_direction "left": sentence-transformers with its tokenizer cutting from the left keeps the
    conversation's last tokens, which end in the template's tail."""
    st = st_models[1][MESSAGES]
    st.tokenizer.truncation_side = "left"
    try:
        expected = st.encode([LONG], convert_to_numpy=True)
    finally:
        st.tokenizer.truncation_side = "right"
    body = {"model": MESSAGES, "inputs": [LONG], "truncate": True, "truncation_direction": "left"}
    response = client.post("/embed", json=body)
    assert response.status_code == 200, response.text
    assert row_cosines(np.array(response.json(), np.float32), expected).min() >= BOUND
    right = st.encode([LONG], convert_to_numpy=True)
    assert row_cosines(right, expected).max() < 0.99  # the premise: the two cuts differ


def _mean_span(states: np.ndarray, ids: list[int], part: list[int]) -> np.ndarray:
    """The mean of the states of `part`'s tokens, found as a run inside `ids`."""
    start = next(i for i in range(len(ids)) if ids[i : i + len(part)] == part)
    return np.asarray(states[start : start + len(part)], np.float32).mean(axis=0)


def test_contextual_chunks_are_framed_as_a_conversation(client: httpx.Client, st_models) -> None:
    """Late chunking: a document's chunks joined are one conversation's user text, as encode() renders it, and each
    chunk's vector is the mean of its tokens' states in sentence-transformers' own forward of that conversation."""
    st = st_models[1][MESSAGES]
    chunks = [TEXTS[0], " " + TEXTS[1]]  # a space before the second: tokenized alone as inside the whole
    document = "".join(chunks)
    ids = _st_ids(st, document, None)
    states = st.encode([document], output_value="token_embeddings", convert_to_numpy=True)[0]
    parts = [st.tokenizer(chunk, add_special_tokens=False)["input_ids"] for chunk in chunks]
    expected = np.stack([_mean_span(states, ids, part) for part in parts])
    body = {"model": MESSAGES, "input": [chunks]}
    response = client.post("/v1/contextualizedembeddings", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["total_tokens"] == len(ids)
    rows = np.array([item["embedding"] for item in response.json()["data"][0]["data"]], np.float32)
    assert row_cosines(rows, expected).min() >= BOUND


def test_embed_all_gives_the_conversation_tokens_states(client: httpx.Client, st_models) -> None:
    """TEI's /embed_all: one state per token of the conversation encode() embeds, as its forward computes them."""
    st = st_models[1][MESSAGES]
    expected = st.encode([TEXTS[0]], output_value="token_embeddings", convert_to_numpy=True)[0]
    response = client.post("/embed_all", json={"model": MESSAGES, "inputs": TEXTS[0]})
    assert response.status_code == 200, response.text
    rows = np.array(response.json()[0], np.float32)
    assert rows.shape == np.asarray(expected).shape
    assert row_cosines(rows, np.asarray(expected, np.float32)).min() >= BOUND


@pytest.fixture(scope="module")
def bfloat16_client(st_models) -> Iterator[httpx.Client]:
    root, _ = st_models
    with engines(root / MESSAGES, root / BOS, dtype="bfloat16") as built, served(built) as running:
        yield running.client


@pytest.mark.parametrize("name", [MESSAGES, BOS])
def test_bfloat16_matches_sentence_transformers(bfloat16_client: httpx.Client, st_models, name: str) -> None:
    """Served in bfloat16 (a GPU's dtype, a CPU's option): conversations, one cut, with and without the query
    prompt, against encode()'s float32 rows at cosine >= 0.999."""
    model = st_models[1][name]
    for prompt_name in (None, "query"):
        expected = model.encode(TEXTS, prompt_name=prompt_name, convert_to_numpy=True)
        body = {"model": name, "inputs": TEXTS, "prompt_name": prompt_name}
        response = bfloat16_client.post("/embed", json=body)
        assert response.status_code == 200, response.text
        cosines = row_cosines(np.array(response.json(), np.float32), expected)
        assert cosines.min() >= BFLOAT16_BOUND, cosines


@pytest.mark.parametrize(
    ("template", "why"),
    [(None, "no chat template to write them with"), ("{% for message in messages %}", "does not compile.*endfor")],
)
def test_a_directory_without_a_usable_chat_template_is_refused(st_models, tmp_path: Path, template, why) -> None:
    """Texts that are conversations cannot be written without the template, or with one jinja cannot compile: the
    replica refuses to serve such a directory and `bouquet embed` to embed it, naming why, at start rather than on
    every text (or by embedding the raw texts)."""
    from bouquet.offline.embed import offline_tokenizer

    root, _ = st_models
    copy = tmp_path / "unusable-template"
    shutil.copytree(root / MESSAGES, copy)
    config_file = copy / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": template}))
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    with engines(copy) as (engine,):
        with pytest.raises(ValueError, match=why):
            offline_tokenizer(engine.spec, engine.max_seq_length)
        with pytest.raises(ValueError, match=why), served([engine]):
            pass


@pytest.mark.parametrize("name", [MESSAGES, LEGACY])
def test_offline_embedding_matches_sentence_transformers(st_models, name: str) -> None:
    """`bouquet embed` and `bouquet.ray`'s pipeline (offline.embed.embed_texts with the model's offline tokenizer):
    the same rows as encode(), conversations where the texts are conversations, one cut, the prompt too."""
    from bouquet.offline.embed import embed_texts, offline_tokenizer

    root, models = st_models
    with engines(root / name) as (engine,):
        for prompt_name in (None, "query"):
            rows = np.empty((len(TEXTS), engine.dimension), np.float32)
            tokenizer = offline_tokenizer(engine.spec, engine.max_seq_length)
            embed_texts(engine, tokenizer, TEXTS, rows, prompt=engine.spec.prompt(prompt_name))
            expected = models[name].encode(TEXTS, prompt_name=prompt_name, convert_to_numpy=True)
            assert row_cosines(rows, expected).min() >= BOUND, (prompt_name, row_cosines(rows, expected))
