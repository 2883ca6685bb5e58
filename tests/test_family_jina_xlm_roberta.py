"""Jina's rotary XLM-RoBERTa (jina-colbert-v2's encoder) against transformers' JinaEmbeddingsV3Model, on tiny
random-weight models saved by transformers (Jina's own tensor names): the bare encoder's token states on a packed
batch of several lengths (rotary positions restart at 0 in each), in transformers' config form and in Jina's
remote-code form (`XLMRobertaModel` with `position_embedding_type: rotary` and `rotary_emb_base`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from family_checks import assert_token_states_match, random_ids, save_tiny

LENGTHS = [1, 9, 40, 300, 77]


def _model(rope_theta: float):
    from transformers import JinaEmbeddingsV3Config, JinaEmbeddingsV3Model

    config = JinaEmbeddingsV3Config(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )  # fmt: skip
    return JinaEmbeddingsV3Model(config, add_pooling_layer=False)


@pytest.fixture(scope="module")
def jina(tmp_path_factory, minilm_path: Path):
    path = tmp_path_factory.mktemp("jina") / "hf"
    return path, save_tiny(_model(20000.0), path, minilm_path, scale=0.3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bare_model_matches_transformers_on_a_packed_batch(jina, dtype: str) -> None:
    path, model = jina
    assert_token_states_match(path, model, random_ids(LENGTHS), dtype)


def test_jinas_remote_code_config_reads_the_same(tmp_path, minilm_path: Path) -> None:
    """Jina's config names XLMRobertaModel and gives the base as rotary_emb_base (here not transformers' default)."""
    model = save_tiny(_model(10000.0), tmp_path, minilm_path, seed=1, scale=0.3)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters")
    config |= {"architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta", "position_embedding_type": "rotary",
               "rotary_emb_base": 10000.0}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_token_states_match(tmp_path, model, random_ids([200, 3, 64], seed=1), "float32")
