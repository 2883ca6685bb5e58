"""Mistral against transformers and sentence-transformers, on tiny random-weight models.

The window is small (12 tokens, on every layer) and most sequences are far longer than it, so a window off by
one or missing moves the token states far from the reference on either CPU backend. Heads of 32 dimensions on
a 64-wide model (`head_dim` set apart from hidden / heads, as Mistral's config allows) check the projections'
shapes are read from the config rather than derived."""

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

WINDOW = 12
LENGTHS = [1, 13, 40, 300, 77, 12]


def _config(sliding_window: int | None):
    from transformers import MistralConfig

    return MistralConfig(
        vocab_size=30522, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=sliding_window,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, minilm_path: Path):
    from transformers import MistralModel

    path = tmp_path_factory.mktemp("mistral") / "hf"
    return path, save_tiny(MistralModel(_config(WINDOW)), path, minilm_path)


@pytest.mark.parametrize("backend", ["cpu_varlen", "sdpa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bare_model_matches_transformers_on_a_packed_batch(mistral, dtype: str, backend: str) -> None:
    path, model = mistral
    assert_token_states_match(path, model, random_ids(LENGTHS), dtype, attention_backend=backend)


def test_causal_lm_checkpoint_without_a_window(tmp_path, minilm_path: Path) -> None:
    """`MistralForCausalLM` saves the decoder under `model.` beside `lm_head`; a null window attends to all."""
    from transformers import MistralForCausalLM

    model = save_tiny(MistralForCausalLM(_config(None)), tmp_path, minilm_path, seed=1)
    assert_token_states_match(tmp_path, model.model, random_ids([200, 3, 64], seed=1), "float32")


@pytest.fixture(scope="module", params=[40, None], ids=["limit 40", "limit 512"])
def st_dirs(request, tmp_path_factory, mistral) -> dict[str, Path]:
    return sentence_transformers_dirs(tmp_path_factory.mktemp("st"), mistral[0], request.param, "lasttoken")


@pytest.mark.parametrize("layout", ["current", "legacy"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_bouquet_embed_matches_sentence_transformers(tmp_path, st_dirs, layout: str, dtype: str, prompt_name) -> None:
    assert_bouquet_matches_sentence_transformers(tmp_path, st_dirs, layout, dtype, prompt_name)
