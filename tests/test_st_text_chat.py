"""vLLM's chat form of /v1/embeddings (`messages`) for a text model whose texts are conversations
(gateway/chat_text.py), on the tiny Qwen3s of test_st_text_messages.py saved by sentence-transformers 6: a user
message, after an optional system message, embeds as encode() embeds that conversation (float32, cosine >= 0.99999),
its content a string or a text part (written in the saved format, as vLLM writes a content in its template's form),
one over the limit cut; a model with a default prompt takes it before a lone user message, as encode() does; usage
counts the conversation's tokens; any other conversation is refused naming why."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import row_cosines
from in_process import engines, served
from test_st_text_messages import (
    BOS,
    BOS_TEMPLATE,
    BOUND,
    LIMIT,
    LONG,
    MESSAGES,
    QUERY,
    TEMPLATE,
    TEXTS,
    _save,
    _st_ids,
)

DEFAULT = "tiny-qwen3-st-default-prompt"  # MESSAGES with default_prompt_name "query"
SYSTEM = "Represent this sentence for searching relevant passages."
USER = {"role": "user", "content": TEXTS[0]}


def _with_default_prompt(root: Path) -> Path:
    """root/MESSAGES copied with its query prompt made the default, as a config saved with default_prompt_name is."""
    shutil.copytree(root / MESSAGES, root / DEFAULT)
    config_file = root / DEFAULT / "config_sentence_transformers.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "default_prompt_name": "query"}))
    return root / DEFAULT


@pytest.fixture(scope="module")
def st_models(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    from sentence_transformers import SentenceTransformer

    root = tmp_path_factory.mktemp("qwen3-st-chat")
    built = {name: _save(root, name, template) for name, template in ((MESSAGES, TEMPLATE), (BOS, BOS_TEMPLATE))}
    return root, {**built, DEFAULT: SentenceTransformer(str(_with_default_prompt(root)))}


@pytest.fixture(scope="module")
def client(st_models) -> Iterator[httpx.Client]:
    root, _ = st_models
    with engines(root / MESSAGES, root / BOS, root / DEFAULT) as built, served(built) as running:
        yield running.client


def _conversation(text: str, system: str | None, parts: bool) -> list[dict[str, Any]]:
    content = (lambda value: [{"type": "text", "text": value}]) if parts else (lambda value: value)
    user = [{"role": "user", "content": content(text)}]
    return user if system is None else [{"role": "system", "content": content(system)}, *user]


def _as_saved(st: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation in the model's saved message format, by sentence-transformers' own normalize_messages: its
    encode() renders a content as it is given (a flat template's concatenation fails on parts, a structured one's loop
    reads a string as no parts), where the server writes each text in the template's form, as vLLM does."""
    normalized: list[dict[str, Any]] = st[0].input_formatter.normalize_messages(messages)
    return normalized


def _chat(client: httpx.Client, model: str, messages: list[dict[str, Any]]) -> httpx.Response:
    return client.post("/v1/embeddings", json={"model": model, "messages": messages})


def _row(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([response.json()["data"][0]["embedding"]], np.float32)


@pytest.mark.parametrize("name", [MESSAGES, BOS])
@pytest.mark.parametrize("system", [None, SYSTEM], ids=["user", "system"])
@pytest.mark.parametrize("parts", [False, True], ids=["string", "parts"])
def test_a_conversation_matches_sentence_transformers(client, st_models, name: str, system, parts: bool) -> None:
    """encode() of the same conversation; the usage its tokens (a long one's cut to the limit)."""
    st = st_models[1][name]
    for text in (TEXTS[0], LONG):
        messages = _conversation(text, system, parts)
        response = _chat(client, name, messages)
        expected = st.encode([_as_saved(st, messages)], convert_to_numpy=True)
        assert row_cosines(_row(response), expected).min() >= BOUND, (text, row_cosines(_row(response), expected))
        tokens = min(len(_st_ids(st, text, system)), LIMIT)
        usage = response.json()["usage"]
        assert (usage["prompt_tokens"], usage["total_tokens"]) == (tokens, tokens), (text, usage)


def test_the_system_message_is_the_prompt(client, st_models) -> None:
    """The premise: a system message is encode()'s prompt word for word, and changes the row."""
    st = st_models[1][MESSAGES]
    prompted = st.encode([TEXTS[0]], prompt=QUERY, convert_to_numpy=True)
    assert row_cosines(_row(_chat(client, MESSAGES, _conversation(TEXTS[0], QUERY, False))), prompted).min() >= BOUND
    assert row_cosines(_row(_chat(client, MESSAGES, [USER])), prompted).max() < 0.99


def test_a_default_prompt_precedes_a_lone_user_message(client, st_models) -> None:
    """encode() puts the model's default prompt as a system message before the conversation's own messages: a user
    message alone takes it; beside a system message it would be a second one, refused naming it."""
    st = st_models[1][DEFAULT]
    expected = st.encode([[USER]], convert_to_numpy=True)
    assert row_cosines(_row(_chat(client, DEFAULT, [USER])), expected).min() >= BOUND
    assert row_cosines(st.encode([TEXTS[0]], prompt="", convert_to_numpy=True), expected).max() < 0.99
    response = _chat(client, DEFAULT, _conversation(TEXTS[0], SYSTEM, False))
    assert response.status_code == 400 and "default prompt" in response.json()["error"]["message"], response.text


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
REFUSED = [
    ([USER, USER], "messages", "holds 2 user messages"),
    ([{"role": "system", "content": SYSTEM}], "messages", "holds 0 user messages"),
    ([USER, {"role": "assistant", "content": "ok"}], "messages", "'messages[1]' has the role 'assistant'"),
    ([USER, {"role": "system", "content": SYSTEM}], "messages", "'messages[1]' is a system message after"),
    ([{"role": "user", "content": [IMAGE]}], "messages[0].content[0]", "is an image"),
    (
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "messages[0].content",
        "holds 2 text parts",
    ),
]


@pytest.mark.parametrize(("messages", "param", "why"), REFUSED)
def test_other_conversations_are_refused(client, messages: list[dict[str, Any]], param: str, why: str) -> None:
    """OpenAI's error body, 400, the field and the reason named."""
    response = _chat(client, MESSAGES, messages)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert why in error["message"] and error["param"] == param and error["type"] == "invalid_request_error", error
