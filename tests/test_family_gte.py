"""GTE (transformers' GteModel) against transformers and sentence-transformers, on tiny random-weight models.

Rotary positions only act through differences between positions, so the packed batch holds sequences of
several lengths (each must restart at position 0) and texts long enough that a wrong base or a wrong pairing
of rotated dimensions moves the scores far from the reference."""

from __future__ import annotations

import shutil
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


def _model(type_vocab_size: int, rope_theta: float):
    from transformers import GteConfig, GteModel

    config = GteConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=512, type_vocab_size=type_vocab_size,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )  # fmt: skip
    return GteModel(config)


@pytest.fixture(scope="module")
def gte(tmp_path_factory, minilm_path: Path):
    path = tmp_path_factory.mktemp("gte") / "hf"
    return path, save_tiny(_model(type_vocab_size=1, rope_theta=160000.0), path, minilm_path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bare_model_matches_transformers_on_a_packed_batch(gte, dtype: str) -> None:
    path, model = gte
    assert_token_states_match(path, model, random_ids(LENGTHS), dtype)


def test_without_token_types_and_with_another_rotary_base(tmp_path, minilm_path: Path) -> None:
    # gte-base-en-v1.5's shape: type_vocab_size 0, no token-type table in the checkpoint.
    model = save_tiny(_model(type_vocab_size=0, rope_theta=10000.0), tmp_path, minilm_path, seed=1)
    assert_token_states_match(tmp_path, model, random_ids([200, 3, 64], seed=1), "float32")


def test_checkpoint_under_the_released_wrapper_prefix(tmp_path, gte) -> None:
    """Alibaba's task models save under `new.`, which transformers' own GTE conversion mapping removes."""
    from safetensors.torch import load_file, save_file

    path, model = gte
    shutil.copytree(path, tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    save_file({f"new.{name}": tensor for name, tensor in load_file(weights).items()}, weights)
    assert_token_states_match(tmp_path / "model", model, random_ids([5, 30]), "float32")


@pytest.fixture(scope="module", params=[40, None], ids=["limit 40", "limit 512"])
def st_dirs(request, tmp_path_factory, gte) -> dict[str, Path]:
    return sentence_transformers_dirs(tmp_path_factory.mktemp("st"), gte[0], request.param)


@pytest.mark.parametrize("layout", ["current", "legacy"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_bouquet_embed_matches_sentence_transformers(tmp_path, st_dirs, layout: str, dtype: str, prompt_name) -> None:
    assert_bouquet_matches_sentence_transformers(tmp_path, st_dirs, layout, dtype, prompt_name)
