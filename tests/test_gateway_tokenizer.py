"""A model's tokenizer for the gateway without its directory: the replica's Info sends tokenizer.json when asked,
and the gateway's catalog builds the tokenizer from it unless a local directory of that model is given."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import corpus
import grpc
import pytest
from tokenizers import Tokenizer

from bouquet.config import SchedulerConfig
from bouquet.gateway.errors import NotFound, Unavailable
from bouquet.gateway.replicas.catalog import ModelCatalog
from bouquet.proto import embedding_pb2, embedding_pb2_grpc
from bouquet.replica.testing import ReplicaThread
from bouquet.tokenizer import TextTokenizer

TEXTS = [*corpus.queries(4), *corpus.NON_ASCII_TEXTS[:2]]


@pytest.fixture(scope="module")
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as pool:
        yield pool


def minilm_info(**fields: object) -> embedding_pb2.InfoResponse:
    """What a replica of the bundled model reports, with `fields` changed."""
    values = {"model_name": "model", "architecture": "BertModel", "dimension": 384, "max_seq_length": 256,
              "vocab_size": 30522, "pooling": "mean", "max_batch_tokens": 1024, **fields}  # fmt: skip
    return embedding_pb2.InfoResponse(**values)


def test_a_tokenizer_from_json_text_or_a_tokenizer_encodes_as_from_its_file(minilm_path: Path):
    path = minilm_path / "tokenizer.json"
    given = Tokenizer.from_file(str(path))
    expected = TextTokenizer(path, 256).encode(TEXTS)
    assert TextTokenizer(str(path), 256).encode(TEXTS) == expected
    assert TextTokenizer(path.read_text(), 256).encode(TEXTS) == expected
    assert TextTokenizer(given, 256).encode(TEXTS) == expected
    assert given.padding is not None, "the caller's tokenizer keeps its own padding"


def test_a_lone_text_encodes_as_it_does_among_others(minilm_path: Path):
    """A request of one text takes the tokenizer's single-text call: the same ids as a batch gives it, cut at the
    limit from either end or kept whole."""
    texts = [*TEXTS, " ".join(corpus.documents(40))]  # the last is over the 32-token limit below
    for direction in ("right", "left"):
        tokenizer = TextTokenizer(minilm_path / "tokenizer.json", 32, direction)
        for truncate in (True, False):
            batch = tokenizer.encode(texts, truncate=truncate)
            assert [tokenizer.encode([text], truncate=truncate)[0] for text in texts] == batch
            assert (len(batch[-1]) == 32) is truncate


def test_a_local_directory_of_the_model_is_preferred_with_the_bundled_names(minilm_path: Path, executor):
    catalog = ModelCatalog((minilm_path,), executor)
    info = minilm_info()
    assert not catalog.needs_tokenizer(info)
    model = catalog.register(info)
    assert model.id == "all-MiniLM-L6-v2" and "sentence-transformers/all-MiniLM-L6-v2" in model.names
    assert model.require_tokenizer().max_length == 256


def test_without_a_local_directory_the_tokenizer_comes_from_info(minilm_path: Path, executor):
    catalog = ModelCatalog((), executor)
    info = minilm_info(model_name="all-MiniLM-L6-v2")
    assert catalog.needs_tokenizer(info)
    info.tokenizer_json = (minilm_path / "tokenizer.json").read_text()
    model = catalog.register(info)
    assert not catalog.needs_tokenizer(info), "known now: a replica found again is not asked for it"
    assert (model.id, model.names) == ("all-MiniLM-L6-v2", ("all-MiniLM-L6-v2",))
    ids = asyncio.run(model.require_tokenizer().encode(TEXTS, "", truncate=True, direction="right"))
    assert ids == TextTokenizer(minilm_path / "tokenizer.json", 256).encode(TEXTS)


def test_another_model_under_the_bundled_models_name_is_not_given_its_tokenizer(minilm_path: Path, executor):
    catalog = ModelCatalog((minilm_path,), executor)
    qwen = minilm_info(architecture="Qwen3Model", dimension=64, vocab_size=151669)  # a directory also called model
    assert catalog.needs_tokenizer(qwen)
    model = catalog.register(qwen)  # a replica that sent no tokenizer: token ids only
    assert model.names == ("model",) and model.tokenizer is None


def test_info_sends_the_tokenizer_only_when_asked(minilm_fp32, minilm_path: Path):
    replica = ReplicaThread(minilm_fp32, SchedulerConfig(max_batch_tokens=256))
    try:
        with grpc.insecure_channel(replica.address) as channel:
            stub = embedding_pb2_grpc.EmbeddingStub(channel)
            plain = stub.Info(embedding_pb2.InfoRequest(), timeout=10)
            full = stub.Info(embedding_pb2.InfoRequest(include_tokenizer=True), timeout=10)
    finally:
        replica.stop()
    assert plain.tokenizer_json == "" and plain.ByteSize() < 1024  # round-trip measurements stay small
    assert full.tokenizer_json == (minilm_path / "tokenizer.json").read_text()
    full.ClearField("tokenizer_json")
    assert full == plain


def test_a_huge_text_is_cut_before_tokenizing_and_reads_as_the_whole_text_would(minilm_path: Path, executor):
    """A 2 MB text is cut to 64 characters a token of the limit before tokenizing: the ids are those of the whole
    text truncated (left and right), and the tokenizer never sees the megabytes. Without truncation it is
    refused by name, before tokenizing."""
    from bouquet.gateway.errors import TooLarge
    from bouquet.gateway.replicas.tokenization import ModelTokenizer

    tokenizer = ModelTokenizer(minilm_path / "tokenizer.json", 256, executor)
    huge = " ".join(corpus.documents(400)) * 3
    assert len(huge) > 50 * tokenizer.max_chars
    whole = {
        d: TextTokenizer(Tokenizer.from_file(str(minilm_path / "tokenizer.json")), 256, d) for d in ("left", "right")
    }
    for direction in ("left", "right"):
        ids = asyncio.run(tokenizer.encode([huge], "", truncate=True, direction=direction))
        assert ids == whole[direction].encode([huge], truncate=True)
    with pytest.raises(TooLarge) as refused:
        asyncio.run(tokenizer.encode([huge], "", truncate=False, direction="right"))
    assert refused.value.code == "input_too_long" and "characters" in refused.value.message


def test_a_model_of_the_gateway_not_reported_yet_is_a_503_not_a_404(minilm_path: Path, tmp_path: Path, executor):
    """`serve --model A --model B` listens once its replicas load; until B's replica has answered Info, a request
    for B is told to retry (503), not that B does not exist."""
    other = tmp_path / "other-model"
    shutil.copytree(minilm_path, other)
    catalog = ModelCatalog((minilm_path, other), executor)
    catalog.register(minilm_info())
    with pytest.raises(Unavailable, match="not served yet"):
        catalog.get("other-model")
    with pytest.raises(NotFound, match="does not exist"):
        catalog.get("no-such-model")


def test_no_default_model_until_the_first_model_of_the_gateway_reports(minilm_path: Path, tmp_path: Path, executor):
    """A request naming no model gets the first --model, never whichever replica happened to report first."""
    first = tmp_path / "first-model"
    shutil.copytree(minilm_path, first)
    catalog = ModelCatalog((first, minilm_path), executor)
    catalog.register(minilm_info())
    with pytest.raises(Unavailable, match="default model 'first-model' is not served yet"):
        catalog.get(None)
