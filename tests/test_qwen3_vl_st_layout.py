"""Qwen3-VL-Embedding in sentence-transformers' layout: a tiny random-weight Qwen3-VL saved by sentence-transformers'
own saver (its Transformer over Qwen3VLModel with Qwen3VLProcessor, last-token Pooling, Normalize), as
Qwen3-VL-Embedding's checkpoints are saved (the generation prompt in its processing_kwargs, the embedder's
instructions as its prompts) and as it saves one by default (neither), served by bouquet and compared with
sentence-transformers' own encode() on texts (plain strings and objects), images (PIL, of sizes other than the
processor's) and the query prompt (float32, cosine >= 0.99999), /tokenize's ids against its own preprocessing;
processing kwargs bouquet cannot follow refused.

Without torchvision (as in `.venv`), transformers cannot build Qwen3VLProcessor at all: ProcessorMixin.__init__
checks the video processor against `transformers.VideoProcessorMixin` (processing_utils.check_argument_for_proper_
class), which transformers exports only where torchvision is installed, and its fallback reads the torchvision-only
VIDEO_PROCESSOR_MAPPING, a dummy. The video processor class itself needs torchvision only to process videos, so the
fixture builds transformers' own Qwen3VLVideoProcessor from its module, hands it (and the tokenizer, which would
otherwise keep it among its own init kwargs) to the processor's loading, and names the base class where that check
looks for it. Texts and images never reach the video processor; the image processor is the Pillow backend,
transformers' default where torchvision is absent."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import row_cosines
from in_process import engines, served
from qwen3_vl_models import MERGE, PATCH, TEMPORAL, images, png_uri, save_qwen3_vl_with_tokenizer
from st_image_checks import response_rows

BOUND = 0.99999
MODEL = "tiny-qwen3-vl-st"
PLAIN = "tiny-qwen3-vl-st-plain"  # no prompts, no processing_kwargs
DOCUMENT = "Represent the user's input."
QUERY = "Retrieve images or text relevant to the user's query."
TEXTS = ["A photo of a cat on a red sofa.", "Find the chart of revenue.", "The quick brown fox jumps over the dog."]
SIZES = [(40, 24), (100, 33), (17, 90), (64, 48)]


def _processor_parts(path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The video processor and tokenizer Qwen3VLProcessor's loading is handed (the module docstring says why)."""
    from transformers import AutoTokenizer, processing_utils
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_processing_utils import VideoProcessorMixin

    monkeypatch.setattr(processing_utils.transformers_module, "VideoProcessorMixin", VideoProcessorMixin, False)
    video = Qwen3VLVideoProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL)
    return {"video_processor": video, "tokenizer": AutoTokenizer.from_pretrained(path)}


def _save(root: Path, name: str, settings: dict, prompts: dict[str, str], default: str | None) -> object:
    """The tiny model saved by sentence-transformers in root/name; its SentenceTransformer, the reference."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    source = root / f"{name}-transformers"
    save_qwen3_vl_with_tokenizer(source)
    with pytest.MonkeyPatch.context() as monkeypatch:
        parts = _processor_parts(source, monkeypatch)
        transformer = Transformer(str(source), processor_kwargs=parts, processing_kwargs=settings)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    model = SentenceTransformer(
        modules=[transformer, pooling, Normalize()], prompts=prompts, default_prompt_name=default
    )
    model.save(str(root / name))
    shutil.rmtree(source)
    return model


@pytest.fixture(scope="module")
def st_models(tmp_path_factory) -> tuple[Path, dict[str, object]]:
    """As Qwen3-VL-Embedding's checkpoints are saved (the generation prompt, the embedder's instructions as
    prompts, document the default), and as sentence-transformers saves one by default (neither)."""
    root = tmp_path_factory.mktemp("qwen3-vl-st")
    return root, {
        MODEL: _save(root, MODEL, {"chat_template": {"add_generation_prompt": True}},
                     {"query": QUERY, "document": DOCUMENT}, "document"),
        PLAIN: _save(root, PLAIN, {}, {}, None),
    }  # fmt: skip


@pytest.fixture(scope="module")
def client(st_models) -> Iterator[httpx.Client]:
    root, _ = st_models
    with engines(root / MODEL, root / PLAIN) as built, served(built) as running:
        yield running.client


def test_the_directory_is_sentence_transformers_own(st_models) -> None:
    """What the saver wrote, read back: the layout under test, not transformers' (no preprocessor_config.json; the
    image processor nested in processor_config.json; the base model's weights; three modules)."""
    path = st_models[0] / MODEL
    names = {entry.name for entry in path.iterdir()}
    assert {"modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "processor_config.json",
            "1_Pooling", "2_Normalize"} <= names, names  # fmt: skip
    assert "preprocessor_config.json" not in names
    assert '"Qwen3VLModel"' in (path / "config.json").read_text()


@pytest.mark.parametrize("name", [MODEL, PLAIN])
def test_texts_match_sentence_transformers(client: httpx.Client, st_models, name: str) -> None:
    """Plain strings and Jina's `{"text"}` objects alike: each a conversation, as encode() writes a text (with the
    default prompt a system message, or none; the generation prompt as the config says)."""
    expected = st_models[1][name].encode(TEXTS, convert_to_numpy=True)
    for inputs in (TEXTS, [{"text": text} for text in TEXTS]):
        rows = response_rows(client.post("/v1/embeddings", json={"model": name, "input": inputs}))
        cosines = row_cosines(rows, expected)
        assert cosines.min() >= BOUND, (inputs, cosines)


@pytest.mark.parametrize("name", [MODEL, PLAIN])
def test_images_match_sentence_transformers(client: httpx.Client, st_models, name: str) -> None:
    model = st_models[1][name]
    pictures = images(SIZES, seed=3)
    expected = model.encode(pictures, convert_to_numpy=True)
    rows = response_rows(
        client.post("/embeddings_image", json={"model": name, "input": [png_uri(p) for p in pictures]})
    )
    cosines = row_cosines(rows, expected)
    assert cosines.min() >= BOUND, cosines
    # One space: a text's row against an image's is sentence-transformers' text row against its image row.
    text = response_rows(client.post("/v1/embeddings", json={"model": name, "input": TEXTS[0]}))
    reference = model.encode(TEXTS[:1], convert_to_numpy=True)
    assert abs(float(text[0] @ rows[0]) - float(reference[0] @ expected[0])) < 1e-4


def test_a_query_prompt_is_the_system_message(client: httpx.Client, st_models) -> None:
    """sentence-transformers' prompt_name "query" puts its prompt in a system message: vLLM's messages form with that
    system message (a text; an image with a text), TEI's prompt_name on a text and Cohere's search_query give its
    rows."""
    model = st_models[1][MODEL]
    chart = images([(72, 40)], seed=8)[0]
    expected = model.encode([TEXTS[1], {"image": chart, "text": "Q3"}], prompt_name="query", convert_to_numpy=True)
    parts = [
        [{"type": "text", "text": TEXTS[1]}],
        [{"type": "image_url", "image_url": {"url": png_uri(chart)}}, {"type": "text", "text": "Q3"}],
    ]
    rows = np.concatenate([
        response_rows(client.post("/v1/embeddings", json={"model": MODEL, "messages": [
            {"role": "system", "content": QUERY}, {"role": "user", "content": content}]}))
        for content in parts
    ])  # fmt: skip
    cosines = row_cosines(rows, expected)
    assert cosines.min() >= BOUND, cosines
    tei = client.post("/embed", json={"model": MODEL, "inputs": [TEXTS[1]], "prompt_name": "query"})
    assert tei.status_code == 200, tei.text
    assert row_cosines(np.array(tei.json(), np.float32), expected[:1]).min() >= BOUND
    content = [{"type": "image_url", "image_url": {"url": png_uri(chart)}}, {"type": "text", "text": "Q3"}]
    body = {"model": MODEL, "input_type": "search_query", "embedding_types": ["float"], "inputs": [
        {"content": [{"type": "text", "text": TEXTS[1]}]}, {"content": content}]}  # fmt: skip
    cohere = client.post("/v2/embed", json=body)  # Cohere's search_query: the model's "query" prompt
    assert cohere.status_code == 200, cohere.text
    assert row_cosines(np.array(cohere.json()["embeddings"]["float"], np.float32), expected).min() >= BOUND


def test_processing_kwargs_bouquet_does_not_follow_are_refused(st_models, tmp_path: Path) -> None:
    """An image's pixel bounds or another chat template argument would make other inputs: refused, naming them."""
    from bouquet.model_dir import read_model_dir

    read = read_model_dir(st_models[0] / PLAIN).st_messages
    assert read is not None and (read.generation_prompt, read.flat) == (False, False), read
    path = tmp_path / "copy"
    shutil.copytree(st_models[0] / MODEL, path)
    config = json.loads((path / "sentence_bert_config.json").read_text())
    assert config["processing_kwargs"] == {"chat_template": {"add_generation_prompt": True}}  # as saved
    config["processing_kwargs"] = {"image": {"max_pixels": 4096}, "chat_template": {"enable_thinking": False}}
    (path / "sentence_bert_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"processing_kwargs image, chat_template.enable_thinking not supported"):
        read_model_dir(path)


@pytest.mark.parametrize("name", [MODEL, PLAIN])
def test_tokenize_answers_the_conversation(client: httpx.Client, st_models, name: str) -> None:
    """TEI's /tokenize on plain texts: the conversation's tokens (the default prompt's system message, the generation
    prompt where saved), as sentence-transformers' own preprocessing gives them for encode()."""
    model = st_models[1][name]
    response = client.post("/tokenize", json={"model": name, "inputs": TEXTS[:2]})
    assert response.status_code == 200, response.text
    expected = [model.preprocess([text], prompt=model.prompts.get(model.default_prompt_name or ""))["input_ids"][0]
                for text in TEXTS[:2]]  # fmt: skip
    assert [[token["id"] for token in tokens] for tokens in response.json()] == [ids.tolist() for ids in expected]


def test_a_chat_template_that_does_not_compile_leaves_the_model_served(st_models, tmp_path: Path) -> None:
    """A directory whose chat template jinja cannot compile (sentence-transformers fails on every input): the gateway
    still discovers the model, rather than its replica's discovery failing for good, and refuses its images naming
    the template's error."""
    copy = tmp_path / "broken-template"
    shutil.copytree(st_models[0] / PLAIN, copy)
    (copy / "chat_template.jinja").write_text("{% for message in messages %}{{ message.role }}")
    with engines(copy) as built, served(built) as running:
        assert running.client.get("/health").status_code == 200
        body = {"model": copy.name, "input": [png_uri(images(SIZES[:1])[0])]}
        response = running.client.post("/embeddings_image", json=body)
        assert response.status_code == 400 and "does not compile" in response.text, response.text
