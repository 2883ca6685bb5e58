"""Rerankers whose Transformer takes chat messages, as sentence-transformers 6 builds and saves a CrossEncoder from a
directory whose tokenizer has a chat template ("message" in its modality_config): its predict() writes each (query,
document) pair as a 'query' and a 'document' message (modality.py's pair_to_messages), a prompt as a system message
before them, renders them through the chat template, cuts a pair over the limit with the template's tail written
back, and refuses a pair where the template drops either role (transformer.py's _verify_pair_roles_supported).

Two tiny random rerankers with Qwen3-Reranker's tokenizer shape (test_qwen3_reranker.py's), each given a chat template
that renders Qwen3-Reranker's prompt from the roles: its causal LM as the CrossEncoder builds it (Transformer, then
LogitScore on "yes" and "no") and the sequence classifier converted from it. Served over HTTP against the library's
own predict(), float32 scores within 1e-4."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from in_process import engines, served
from test_qwen3_reranker import LIMIT, PAIRS, _converted, save_qwen_tokenizer, save_reranker

BOUND = 1e-4
INSTRUCTION = "Given a question, find the passage that answers it"
# Qwen3-Reranker's prompt, its instruction, query and document read from the messages' roles.
TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "{% for message in messages %}{% if message.role == 'system' %}<Instruct>: {{ message.content }}\n"
    "{% elif message.role == 'query' %}<Query>: {{ message.content }}\n"
    "{% elif message.role == 'document' %}<Document>: {{ message.content }}{% endif %}{% endfor %}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
DROPS_DOCUMENT = TEMPLATE.replace("{% elif message.role == 'document' %}<Document>: {{ message.content }}", "")
# A template that fails on a query with a Python error (an int and None added), not through raise_exception.
FAILS_ON_QUERY = TEMPLATE.replace("<Query>: {{ message.content }}", "<Query>: {{ message.content | length + none }}")
CAUSAL, CLASSIFIER, BLIND, FAILING = "causal-reranker", "classifier-reranker", "blind-reranker", "failing-reranker"


def _with_template(tokenizer_dir: Path, template: str) -> None:
    config_file = tokenizer_dir / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": template}))


def _save_cross_encoder(source: Path, out: Path) -> object:
    """The CrossEncoder sentence-transformers builds from `source`, saved to `out` and loaded back from it."""
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(source), device="cpu", max_length=LIMIT).save(str(out))
    return CrossEncoder(str(out), device="cpu")


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory) -> tuple[Path, dict[str, object]]:
    root = tmp_path_factory.mktemp("st-message-rerankers")
    save_qwen_tokenizer(root / "tokenizer")
    _with_template(root / "tokenizer", TEMPLATE)
    save_reranker(root / "hf", root / "tokenizer")
    built = {CAUSAL: _save_cross_encoder(root / "hf", root / CAUSAL)}
    built[CLASSIFIER] = _save_cross_encoder(_converted(root / "hf", root / "seq-cls"), root / CLASSIFIER)
    shutil.copytree(root / "hf", root / "blind-hf")
    _with_template(root / "blind-hf", DROPS_DOCUMENT)
    built[BLIND] = _save_cross_encoder(root / "blind-hf", root / BLIND)
    shutil.copytree(root / "hf", root / "failing-hf")
    _with_template(root / "failing-hf", FAILS_ON_QUERY)
    built[FAILING] = _save_cross_encoder(root / "failing-hf", root / FAILING)
    return root, built


@pytest.fixture(scope="module")
def client(rerankers) -> Iterator[httpx.Client]:
    root, _ = rerankers
    with engines(root / CAUSAL, root / CLASSIFIER, root / BLIND, root / FAILING) as built, served(built) as running:
        yield running.client


def test_sentence_transformers_saves_messages_and_renders_pairs(rerankers) -> None:
    """The premise: the saver writes "message" for both, and a pair's row is the rendered conversation's."""
    root, models = rerankers
    for name in (CAUSAL, CLASSIFIER):
        modalities = json.loads((root / name / "sentence_bert_config.json").read_text())["modality_config"]
        assert set(modalities) == {"text", "message"}, modalities
    features = models[CAUSAL].preprocess([PAIRS[0]])  # type: ignore[attr-defined]
    rendered = models[CAUSAL].tokenizer.decode(features["input_ids"][0])  # type: ignore[attr-defined]
    assert f"<Query>: {PAIRS[0][0]}\n<Document>: {PAIRS[0][1]}<|im_end|>" in rendered, rendered


@pytest.mark.parametrize("name", [CAUSAL, CLASSIFIER])
def test_pairs_match_sentence_transformers(client: httpx.Client, rerankers, name: str) -> None:
    """TEI's /predict on every pair, one over the limit (cut, the template's tail restored)."""
    expected = np.asarray(rerankers[1][name].predict(PAIRS, convert_to_numpy=True), np.float32)
    response = client.post("/predict", json={"model": name, "inputs": [list(pair) for pair in PAIRS]})
    assert response.status_code == 200, response.text
    scores = np.array([answer[0]["score"] for answer in response.json()], np.float32)
    np.testing.assert_allclose(scores, expected, atol=BOUND, rtol=0)
    assert np.ptp(expected) > 10 * BOUND  # scores that differ: a wrong prompt would show


@pytest.mark.parametrize("name", [CAUSAL, CLASSIFIER])
def test_an_instruction_is_the_system_message(client: httpx.Client, rerankers, name: str) -> None:
    """Cohere's /v1/rerank with an instruction: sentence-transformers' prompt, a system message before the pair."""
    query, documents = PAIRS[0][0], [document for _, document in PAIRS]
    model = rerankers[1][name]
    expected = model.predict([(query, d) for d in documents], prompt=INSTRUCTION, convert_to_numpy=True)
    body = {"model": name, "query": query, "documents": documents, "instruction": INSTRUCTION}
    response = client.post("/v1/rerank", json=body)
    assert response.status_code == 200, response.text
    scores = {item["index"]: item["relevance_score"] for item in response.json()["results"]}
    np.testing.assert_allclose([scores[i] for i in range(len(documents))], expected, atol=BOUND, rtol=0)
    plain = model.predict([(query, d) for d in documents], convert_to_numpy=True)
    assert np.abs(plain - expected).max() > 10 * BOUND  # the premise: the instruction moves the scores


def test_a_template_that_drops_a_role_is_refused(client: httpx.Client, rerankers) -> None:
    """A template without the document's branch scores no document: sentence-transformers refuses the pair, and so
    does the gateway, naming why."""
    with pytest.raises(ValueError, match="cannot carry a 'query'/'document' pair"):
        rerankers[1][BLIND].predict(PAIRS[:1])
    response = client.post("/rerank", json={"model": BLIND, "query": PAIRS[0][0], "texts": [PAIRS[0][1]]})
    assert response.status_code in (400, 413, 422), response.text
    assert "'document' content does not reach" in response.text, response.text


def test_a_template_that_fails_on_a_pair_is_refused(client: httpx.Client, rerankers) -> None:
    """A template whose render of a pair raises a Python error: sentence-transformers' probe reports the exception and
    refuses the pair; the gateway serves the model all the same (its discovery probes the template too) and refuses
    the pair naming the error, a 4xx and not a 500."""
    with pytest.raises(ValueError, match="it raised TypeError"):
        rerankers[1][FAILING].predict(PAIRS[:1])
    response = client.post("/v1/rerank", json={"model": FAILING, "query": PAIRS[0][0], "documents": [PAIRS[0][1]]})
    assert response.status_code == 400, response.text
    assert "it raised TypeError" in response.text, response.text


def test_a_template_that_drops_a_role_is_said_once_at_discovery(rerankers, caplog: pytest.LogCaptureFixture) -> None:
    """The operator learns of it from the log when the replica is discovered, once, not only from clients' 400s."""
    root, _ = rerankers
    with caplog.at_level(logging.WARNING), engines(root / BLIND) as built, served(built) as running:
        for _ in range(2):
            running.client.post("/rerank", json={"model": BLIND, "query": PAIRS[0][0], "texts": [PAIRS[0][1]]})
    said = [r.getMessage() for r in caplog.records if "cannot score pairs" in r.getMessage()]
    assert len(said) == 1 and BLIND in said[0] and "'document' content does not reach" in said[0], said
