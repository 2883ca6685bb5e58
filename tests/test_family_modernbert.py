"""ModernBERT against transformers and sentence-transformers, on tiny random-weight models.

The local window is small (16 tokens, 8 either side) and the packed batch holds sequences far longer than it,
so a window one token too wide or narrow, local layers rotating with the global base, or a layer of the wrong
kind moves the token states far from the reference; sequences of several lengths must each restart at
position 0."""

from __future__ import annotations

import json
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


def _config(**overrides):
    from transformers import ModernBertConfig

    settings = dict(
        vocab_size=30522, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=512, local_attention=16, global_attn_every_n_layers=3,
        global_rope_theta=160000.0, local_rope_theta=10000.0,
        pad_token_id=0, bos_token_id=101, eos_token_id=102, cls_token_id=101, sep_token_id=102,
    )  # fmt: skip
    return ModernBertConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory, minilm_path: Path):
    from transformers import ModernBertModel

    path = tmp_path_factory.mktemp("modernbert") / "hf"
    return path, save_tiny(ModernBertModel(_config()), path, minilm_path)


@pytest.mark.parametrize("backend", ["cpu_varlen", "sdpa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bare_model_matches_transformers_on_a_packed_batch(modernbert, dtype: str, backend: str) -> None:
    path, model = modernbert
    assert_token_states_match(path, model, random_ids(LENGTHS), dtype, attention_backend=backend)


def test_biases_another_layer_pattern_and_rotary_bases(tmp_path, minilm_path: Path) -> None:
    from transformers import ModernBertModel

    config = _config(
        norm_bias=True, attention_bias=True, mlp_bias=True, global_attn_every_n_layers=2, local_attention=10,
        global_rope_theta=50000.0, local_rope_theta=500.0,
    )  # fmt: skip
    model = save_tiny(ModernBertModel(config), tmp_path, minilm_path, seed=1)
    assert_token_states_match(tmp_path, model, random_ids([200, 3, 64], seed=1), "float32")


def test_released_config_keys(tmp_path, modernbert) -> None:
    """Released checkpoints name the layer pattern and bases as ModernBERT first did, without `layer_types` and
    `rope_parameters` (which transformers 5 writes)."""
    path, model = modernbert
    shutil.copytree(path, tmp_path / "model")
    config_file = tmp_path / "model" / "config.json"
    config = json.loads(config_file.read_text())
    del config["layer_types"], config["rope_parameters"]
    config.update(global_attn_every_n_layers=3, global_rope_theta=160000.0, local_rope_theta=10000.0)
    config_file.write_text(json.dumps(config))
    assert_token_states_match(tmp_path / "model", model, random_ids([120, 7]), "float32")


def test_masked_lm_checkpoint(tmp_path, minilm_path: Path) -> None:
    """ModernBERT-base is released as ModernBertForMaskedLM: the encoder under `model.`, a head beside it."""
    from transformers import ModernBertForMaskedLM

    model = save_tiny(ModernBertForMaskedLM(_config()), tmp_path, minilm_path, seed=2)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["ModernBertForMaskedLM"]
    assert_token_states_match(tmp_path, model.model, random_ids([90, 5], seed=2), "float32")


@pytest.fixture(scope="module", params=[40, None], ids=["limit 40", "limit 512"])
def st_dirs(request, tmp_path_factory, modernbert) -> dict[str, Path]:
    return sentence_transformers_dirs(tmp_path_factory.mktemp("st"), modernbert[0], request.param)


@pytest.mark.parametrize("layout", ["current", "legacy"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_bouquet_embed_matches_sentence_transformers(tmp_path, st_dirs, layout: str, dtype: str, prompt_name) -> None:
    assert_bouquet_matches_sentence_transformers(tmp_path, st_dirs, layout, dtype, prompt_name)
