"""Qwen2 against transformers and sentence-transformers, on tiny random-weight models.

The window is small (8 tokens) and slides on the last two of three layers only (`max_window_layers` 1), and
most sequences are far longer than it: a window off by one, one on the wrong layers, or none at all moves the
token states far from the reference, on either CPU backend (bouquet's C kernel reads only the keys a query
tile may see; SDPA masks them out)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from family_checks import (
    assert_bouquet_matches_sentence_transformers,
    assert_token_states_match,
    random_ids,
    save_tiny,
    sentence_transformers_dirs,
)

from bouquet.models.qwen2 import Qwen2Model

WINDOW = 8
LENGTHS = [1, 9, 40, 300, 77, 8]


def _model(use_sliding_window: bool, num_layers: int = 3):
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(
        vocab_size=30522, hidden_size=64, intermediate_size=160, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=use_sliding_window, sliding_window=WINDOW, max_window_layers=1,
    )  # fmt: skip
    return Qwen2Model(config)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, minilm_path: Path):
    path = tmp_path_factory.mktemp("qwen2") / "hf"
    return path, save_tiny(_model(use_sliding_window=True), path, minilm_path)


def test_windows_land_on_the_layers_transformers_slides(qwen2) -> None:
    """Read back from the saved config.json, and from the same config without transformers' `layer_types`."""
    config = json.loads((qwen2[0] / "config.json").read_text())
    assert [layer.self_attn.attn.sliding_window for layer in Qwen2Model.from_hf_config(config).layers] == [
        None, (WINDOW - 1, 0), (WINDOW - 1, 0),
    ]  # fmt: skip
    del config["layer_types"]
    assert Qwen2Model.from_hf_config(config).config.windows == (None, WINDOW, WINDOW)
    config["use_sliding_window"] = False  # released gte-Qwen2 configs carry a window they never use
    assert Qwen2Model.from_hf_config(config).config.windows == (None, None, None)


@pytest.mark.parametrize("backend", ["cpu_varlen", "sdpa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bare_model_matches_transformers_on_a_packed_batch(qwen2, dtype: str, backend: str) -> None:
    path, model = qwen2
    assert_token_states_match(path, model, random_ids(LENGTHS), dtype, attention_backend=backend)


def test_without_a_window(tmp_path, minilm_path: Path) -> None:
    model = save_tiny(_model(use_sliding_window=False, num_layers=2), tmp_path, minilm_path, seed=1)
    assert_token_states_match(tmp_path, model, random_ids([200, 3, 64], seed=1), "float32")


def test_causal_lm_checkpoint_loads_without_its_head(tmp_path, minilm_path: Path) -> None:
    """`Qwen2ForCausalLM` (gte-Qwen2's architecture) saves the decoder under `model.` beside `lm_head`."""
    from transformers import Qwen2ForCausalLM

    model = save_tiny(Qwen2ForCausalLM(_model(use_sliding_window=True).config), tmp_path, minilm_path, seed=2)
    assert_token_states_match(tmp_path, model.model, random_ids([30, 5], seed=2), "float32")


@pytest.fixture(scope="module", params=[40, None], ids=["limit 40", "limit 512"])
def st_dirs(request, tmp_path_factory, qwen2) -> dict[str, Path]:
    return sentence_transformers_dirs(tmp_path_factory.mktemp("st"), qwen2[0], request.param, "lasttoken")


@pytest.mark.parametrize("layout", ["current", "legacy"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_bouquet_embed_matches_sentence_transformers(tmp_path, st_dirs, layout: str, dtype: str, prompt_name) -> None:
    assert_bouquet_matches_sentence_transformers(tmp_path, st_dirs, layout, dtype, prompt_name)
