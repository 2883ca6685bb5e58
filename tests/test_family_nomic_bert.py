"""NomicBERT against transformers and sentence-transformers, on tiny random-weight models.

Rotary positions only act through differences between positions, so the packed batch holds sequences of
several lengths (each must restart at position 0) and texts long enough that a wrong base or a wrong pairing
of rotated dimensions moves the scores far from the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
from family_checks import (
    assert_bouquet_matches_sentence_transformers,
    assert_token_states_match,
    random_ids,
    save_tiny,
    sentence_transformers_dirs,
)

LENGTHS = [1, 9, 40, 300, 77]


def _model(head_dim: int, rope_theta: float):
    from transformers import NomicBertConfig, NomicBertModel

    config = NomicBertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=64 // head_dim, head_dim=head_dim,
        intermediate_size=128, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )  # fmt: skip
    return NomicBertModel(config)


@pytest.fixture(scope="module")
def nomic(tmp_path_factory, minilm_path: Path):
    path = tmp_path_factory.mktemp("nomic") / "hf"
    return path, save_tiny(_model(head_dim=16, rope_theta=1000.0), path, minilm_path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bare_model_matches_transformers_on_a_packed_batch(nomic, dtype: str) -> None:
    path, model = nomic
    assert_token_states_match(path, model, random_ids(LENGTHS), dtype)


def test_head_dim_and_rotary_base_come_from_the_config(tmp_path, minilm_path: Path) -> None:
    model = save_tiny(_model(head_dim=32, rope_theta=10000.0), tmp_path, minilm_path, seed=1)
    assert_token_states_match(tmp_path, model, random_ids([200, 3, 64], seed=1), "float32")


@pytest.fixture(scope="module", params=[40, None], ids=["limit 40", "limit 512"])
def st_dirs(request, tmp_path_factory, nomic) -> dict[str, Path]:
    return sentence_transformers_dirs(tmp_path_factory.mktemp("st"), nomic[0], request.param)


@pytest.mark.parametrize("layout", ["current", "legacy"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_bouquet_embed_matches_sentence_transformers(tmp_path, st_dirs, layout: str, dtype: str, prompt_name) -> None:
    assert_bouquet_matches_sentence_transformers(tmp_path, st_dirs, layout, dtype, prompt_name)
