"""Qwen3-VL-Embedding in sentence-transformers' layout: a tiny random-weight Qwen3-VL saved by sentence-transformers'
own saver (its Transformer module over Qwen3VLModel with Qwen3VLProcessor, last-token Pooling, Normalize; the
generation prompt in its processing_kwargs and the embedder's instructions as its prompts, as Qwen3-VL-Embedding's
sentence-transformers checkpoints are saved), served by bouquet and compared with sentence-transformers' own
encode() on texts, images (PIL, of sizes other than the processor's) and a query prompt (float32, cosine >= 0.99999).

Without torchvision (as in `.venv`), transformers cannot build Qwen3VLProcessor at all: ProcessorMixin.__init__
checks the video processor against `transformers.VideoProcessorMixin` (processing_utils.check_argument_for_proper_
class), which transformers exports only where torchvision is installed, and its fallback reads the torchvision-only
VIDEO_PROCESSOR_MAPPING, a dummy. The video processor class itself needs torchvision only to process videos, so the
fixture builds transformers' own Qwen3VLVideoProcessor from its module, hands it (and the tokenizer, which would
otherwise keep it among its own init kwargs) to the processor's loading, and names the base class where that check
looks for it. Texts and images never reach the video processor; the image processor is the Pillow backend,
transformers' default where torchvision is absent."""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import row_cosines
from in_process import engines, served
from PIL import Image
from qwen3_vl_models import MERGE, PATCH, TEMPORAL, images, save_qwen3_vl_with_tokenizer

BOUND = 0.99999
MODEL = "tiny-qwen3-vl-st"
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


@pytest.fixture(scope="module")
def st_model(tmp_path_factory) -> Iterator[tuple[Path, object]]:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    root = tmp_path_factory.mktemp("qwen3-vl-st")
    save_qwen3_vl_with_tokenizer(root / "transformers")
    with pytest.MonkeyPatch.context() as monkeypatch:
        transformer = Transformer(
            str(root / "transformers"),
            processor_kwargs=_processor_parts(root / "transformers", monkeypatch),
            processing_kwargs={"chat_template": {"add_generation_prompt": True}},
        )
        pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
        model = SentenceTransformer(
            modules=[transformer, pooling, Normalize()],
            prompts={"query": QUERY, "document": DOCUMENT},
            default_prompt_name="document",
        )
        model.save(str(root / MODEL))
        shutil.rmtree(root / "transformers")
        yield root / MODEL, model


@pytest.fixture(scope="module")
def client(st_model) -> Iterator[httpx.Client]:
    with engines(st_model[0]) as built, served(built) as running:
        yield running.client


def _uri(picture: Image.Image) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _rows(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], np.float32)


def test_the_directory_is_sentence_transformers_own(st_model) -> None:
    """What the saver wrote, read back: the layout under test, not transformers' (no preprocessor_config.json; the
    image processor nested in processor_config.json; the base model's weights; three modules)."""
    path, _ = st_model
    names = {entry.name for entry in path.iterdir()}
    assert {"modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "processor_config.json",
            "1_Pooling", "2_Normalize"} <= names, names  # fmt: skip
    assert "preprocessor_config.json" not in names
    assert '"Qwen3VLModel"' in (path / "config.json").read_text()


def test_texts_match_sentence_transformers(client: httpx.Client, st_model) -> None:
    """Texts as Jina's `{"text"}` objects: each a conversation in the model's template with its default instruction,
    as sentence-transformers' encode() writes a text under its default prompt."""
    _, model = st_model
    expected = model.encode(TEXTS, convert_to_numpy=True)
    body = {"model": MODEL, "input": [{"text": text} for text in TEXTS]}
    cosines = row_cosines(_rows(client.post("/v1/embeddings", json=body)), expected)
    assert cosines.min() >= BOUND, cosines


@pytest.mark.xfail(
    strict=True,
    reason="plain strings in `input` are embedded as texts (the default prompt put before each, no chat template), "
    "where sentence-transformers writes each as a conversation with the prompt as its system message",
)
def test_plain_text_inputs_match_sentence_transformers(client: httpx.Client, st_model) -> None:
    _, model = st_model
    expected = model.encode(TEXTS, convert_to_numpy=True)
    rows = _rows(client.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS}))
    assert row_cosines(rows, expected).min() >= BOUND


def test_images_match_sentence_transformers(client: httpx.Client, st_model) -> None:
    _, model = st_model
    pictures = images(SIZES, seed=3)
    expected = model.encode(pictures, convert_to_numpy=True)
    rows = _rows(client.post("/embeddings_image", json={"model": MODEL, "input": [_uri(p) for p in pictures]}))
    cosines = row_cosines(rows, expected)
    assert cosines.min() >= BOUND, cosines
    # One space: a text's row against an image's is sentence-transformers' text row against its image row.
    text = _rows(client.post("/v1/embeddings", json={"model": MODEL, "input": [{"text": TEXTS[0]}]}))
    reference = model.encode(TEXTS[:1], convert_to_numpy=True)
    assert abs(float(text[0] @ rows[0]) - float(reference[0] @ expected[0])) < 1e-4


def test_a_query_prompt_is_the_system_message(client: httpx.Client, st_model) -> None:
    """sentence-transformers' prompt_name "query" puts its prompt in a system message; vLLM's messages form
    with that system message gives the same rows, for a text and for an image with a text."""
    _, model = st_model
    chart = images([(72, 40)], seed=8)[0]
    expected = model.encode([TEXTS[1], {"image": chart, "text": "Q3"}], prompt_name="query", convert_to_numpy=True)
    parts = [
        [{"type": "text", "text": TEXTS[1]}],
        [{"type": "image_url", "image_url": {"url": _uri(chart)}}, {"type": "text", "text": "Q3"}],
    ]
    rows = np.concatenate([
        _rows(client.post("/v1/embeddings", json={"model": MODEL, "messages": [
            {"role": "system", "content": QUERY}, {"role": "user", "content": content}]}))
        for content in parts
    ])  # fmt: skip
    cosines = row_cosines(rows, expected)
    assert cosines.min() >= BOUND, cosines
