"""The client libraries people point at an embedding server, each against the real gateway and a replica (in this
process, tests/in_process.py) and each result compared with sentence-transformers: huggingface_hub's InferenceClient
(TEI's `POST /`), openai (`models.retrieve`, raw headers), langchain-openai, litellm (`infinity/`, `huggingface/`) and
haystack's Hugging Face API embedders.

Nothing here reaches the internet: every client is given the loopback URL, and each library's hub lookups, cost
maps and telemetry are switched off below (before any of them is imported; each test imports its own client, so a
skipped one costs no import time)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import corpus
import numpy as np
import pytest
from conftest import row_cosines
from in_process import served

from bouquet.engine.engine import Engine

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else litellm fetches its cost map on import
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("LANGSMITH_TRACING", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

MODEL = "all-MiniLM-L6-v2"
API_KEY = "clients-key"
TEXTS = [*corpus.documents(3), *corpus.queries(3)]
MIN_COSINE = 0.99999


@pytest.fixture(scope="module")
def server(minilm_path: Path, minilm_fp32: Engine) -> Iterator[str]:
    """Text only (`token_id_input=False`, as `--no-token-id-input`): every client here sends text, except
    langchain-openai's default, which sends tiktoken ids and must be refused. In process (tests/in_process.py), on a
    loopback port of the gateway's own HTTP server: these clients take a URL, not an httpx client."""
    options = {"model_dirs": (minilm_path,), "api_key": API_KEY, "token_id_input": False}
    with served([minilm_fp32], listen=True, **options) as running:
        yield running.url


@pytest.fixture(scope="module")
def expected(sentence_transformer) -> np.ndarray:
    return sentence_transformer.encode(TEXTS, convert_to_numpy=True)


def assert_parity(rows, expected: np.ndarray) -> None:
    rows = np.asarray(rows, dtype=np.float32)
    assert rows.shape == expected.shape
    assert row_cosines(rows, expected).min() >= MIN_COSINE


def run(coroutine):
    return asyncio.run(coroutine)


def need(module: str):
    """The client library, or a skip that says it is missing (all of them are in the `test` extra)."""
    return pytest.importorskip(module, reason=f"{module} is not installed: pip install -e '.[test]'")


# huggingface_hub: InferenceClient(model=URL) POSTs to the URL itself, i.e. TEI's `POST /`.


@pytest.fixture
def hf_online(monkeypatch):
    """huggingface_hub, allowed to send: HF_HUB_OFFLINE=1 (read once, when huggingface_hub is imported) blocks
    every request it makes, the loopback server's too; a client given a URL never asks the Hub for anything."""
    constants = need("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_huggingface_hub_feature_extraction(server, expected, hf_online):
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    client = InferenceClient(model=server, token=API_KEY, timeout=120)
    assert_parity(client.feature_extraction(TEXTS), expected)
    one = client.feature_extraction(TEXTS[0], truncate=True, normalize=True)
    assert_parity(np.asarray(one).reshape(1, -1), expected[:1])
    with pytest.raises(HfHubHTTPError, match="is an empty string") as refused:  # TEI's {"error", "error_type"}
        client.feature_extraction(["a", ""])
    assert refused.value.response.status_code == 400


def test_huggingface_hub_feature_extraction_async(server, expected, hf_online):
    from huggingface_hub import AsyncInferenceClient

    async def embed():
        async with AsyncInferenceClient(model=server, token=API_KEY, timeout=120) as client:
            return await client.feature_extraction(TEXTS)

    assert_parity(run(embed()), expected)


def test_huggingface_hub_sentence_similarity(server, expected, hf_online):
    from huggingface_hub import AsyncInferenceClient, InferenceClient

    unit = expected / np.linalg.norm(expected, axis=1, keepdims=True)
    cosines = unit[1:] @ unit[0]
    values = InferenceClient(model=server, token=API_KEY, timeout=120).sentence_similarity(TEXTS[0], TEXTS[1:])
    assert np.allclose(values, cosines, atol=1e-5)

    async def similarity():
        async with AsyncInferenceClient(model=server, token=API_KEY, timeout=120) as client:
            return await client.sentence_similarity(TEXTS[0], TEXTS[1:])

    assert np.allclose(run(similarity()), cosines, atol=1e-5)


# openai


def test_openai_models_retrieve(server):
    openai = need("openai")

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "bouquet")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")

    async def retrieve():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60) as aclient:
            return await aclient.models.retrieve(MODEL)

    assert run(retrieve()).id == MODEL


def test_openai_raw_response_headers(server, expected):
    openai = need("openai")

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=TEXTS)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("application/json")
    request_id = raw.headers["x-request-id"]
    assert len(request_id) == 32
    response = raw.parse()
    assert response._request_id == request_id
    assert_parity([item.embedding for item in response.data], expected)
    sent = client.embeddings.with_raw_response.create(
        model=MODEL, input=TEXTS[:1], extra_headers={"x-request-id": "my-trace-7"}
    )
    assert sent.headers["x-request-id"] == "my-trace-7"

    async def create():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120) as aclient:
            return await aclient.embeddings.with_raw_response.create(model=MODEL, input=TEXTS)

    araw = run(create())
    assert len(araw.headers["x-request-id"]) == 32
    assert_parity([item.embedding for item in araw.parse().data], expected)


# langchain-openai


def _langchain(server: str, **kwargs):
    return need("langchain_openai").OpenAIEmbeddings(
        base_url=f"{server}/v1", api_key=API_KEY, model=MODEL, max_retries=0, **kwargs
    )


def test_langchain_openai_sends_text(server, expected):
    embeddings = _langchain(server, check_embedding_ctx_length=False)
    assert_parity(embeddings.embed_documents(TEXTS), expected)
    assert_parity([embeddings.embed_query(TEXTS[-1])], expected[-1:])

    async def embed():
        return await embeddings.aembed_documents(TEXTS), await embeddings.aembed_query(TEXTS[-1])

    documents, query = run(embed())
    assert_parity(documents, expected)
    assert_parity([query], expected[-1:])


def _tiktoken_files() -> str | None:
    """tiktoken's cl100k_base without the internet: the copy litellm ships (litellm points TIKTOKEN_CACHE_DIR
    there itself when imported), or one already cached."""
    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        return os.environ["TIKTOKEN_CACHE_DIR"]
    spec = importlib.util.find_spec("litellm")
    if spec is None or spec.origin is None:
        return None
    return str(Path(spec.origin).parent / "litellm_core_utils" / "tokenizers")


def test_langchain_openai_default_sends_tiktoken_ids_and_is_refused(server, monkeypatch):
    """With its default check_embedding_ctx_length=True, langchain-openai tokenizes with tiktoken (OpenAI's
    vocabulary) and sends the ids: any other model would embed them as if they were its own. A server started
    with --no-token-id-input answers 400 `token_ids_refused` instead of wrong vectors."""
    openai = need("openai")

    files = _tiktoken_files()
    blob = "9b5ad71b2ce5302211f9c61530b329a4922fc6a4"  # sha1 of cl100k_base's URL: tiktoken's cache key
    if files is None or not (Path(files) / blob).exists():
        pytest.skip("tiktoken's cl100k_base is not cached here and there is no internet to fetch it")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", files)
    embeddings = _langchain(server)
    with pytest.raises(openai.BadRequestError) as refused:
        embeddings.embed_documents(TEXTS[:2])
    assert refused.value.status_code == 400 and refused.value.code == "token_ids_refused"
    with pytest.raises(openai.BadRequestError) as arefused:
        run(embeddings.aembed_query(TEXTS[-1]))
    assert arefused.value.code == "token_ids_refused"


# litellm


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
@pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")  # litellm's own types
def test_litellm_infinity(server, expected):
    litellm = need("litellm")

    kwargs = {"model": f"infinity/{MODEL}", "api_base": server, "api_key": API_KEY, "input": TEXTS, "timeout": 120}
    response = litellm.embedding(**kwargs)
    assert_parity([item["embedding"] for item in response.data], expected)
    assert response.usage.prompt_tokens > 0
    aresponse = run(litellm.aembedding(**kwargs))
    assert_parity([item["embedding"] for item in aresponse.data], expected)


@pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")  # litellm's own types
def test_litellm_huggingface(server, expected):
    """`huggingface/` POSTs TEI's `{"inputs"}` to api_base itself. input_type names the pipeline: without it
    litellm asks huggingface.co for the model's pipeline tag, and a model name holding "sentence-transformers"
    makes it send a similarity request instead."""
    litellm = need("litellm")

    kwargs = {"model": f"huggingface/{MODEL}", "api_base": server, "api_key": API_KEY, "input": TEXTS,
              "input_type": "feature-extraction", "timeout": 120}  # fmt: skip
    response = litellm.embedding(**kwargs)
    assert_parity([item["embedding"] for item in response.data], expected)
    aresponse = run(litellm.aembedding(**kwargs))
    assert_parity([item["embedding"] for item in aresponse.data], expected)


# haystack (haystack-ai 3's Hugging Face API embedders are the huggingface-api-haystack integration)


def _haystack_kwargs(server: str) -> dict:
    secret = need("haystack.utils").Secret.from_token(API_KEY)
    return {"api_type": "text_embeddings_inference", "api_params": {"url": server}, "token": secret}


def test_haystack_text_embedder(server, expected, hf_online):
    embedders = need("haystack_integrations.components.embedders.huggingface_api")
    embedder = embedders.HuggingFaceAPITextEmbedder(**_haystack_kwargs(server))
    assert_parity([embedder.run(TEXTS[-1])["embedding"]], expected[-1:])
    assert_parity([run(embedder.run_async(TEXTS[-2]))["embedding"]], expected[-2:-1])


def test_haystack_document_embedder(server, expected, hf_online):
    embedders = need("haystack_integrations.components.embedders.huggingface_api")
    Document = need("haystack").Document
    embedder = embedders.HuggingFaceAPIDocumentEmbedder(**_haystack_kwargs(server), batch_size=4, progress_bar=False)
    documents = embedder.run([Document(content=text) for text in TEXTS])["documents"]
    assert_parity([document.embedding for document in documents], expected)
    documents = run(embedder.run_async([Document(content=text) for text in TEXTS]))["documents"]
    assert_parity([document.embedding for document in documents], expected)
