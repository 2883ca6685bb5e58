"""Gemma3 text models against transformers and sentence-transformers, on tiny random-weight models: causal
(Gemma3ForCausalLM) and bidirectional (EmbeddingGemma's Gemma3TextModel, with its two Dense modules).

The sliding window is small (8: the 7 keys before a causal query; 4 either side of a bidirectional one) and the
packed batch holds sequences far longer than it, so a window one token off, sliding layers rotating with the
full layers' base, a missing embedding scale or the wrong attention scale moves the token states far from the
reference; sequences of several lengths must each restart at position 0."""

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
from torch import nn

from bouquet.models import create_model

LENGTHS = [1, 9, 40, 300, 77]
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _config(bidirectional: bool, **overrides):
    from transformers import Gemma3TextConfig

    settings = dict(
        vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, query_pre_attn_scalar=24,
        sliding_window=8, layer_types=LAYER_TYPES, use_bidirectional_attention=bidirectional,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        pad_token_id=0, bos_token_id=101, eos_token_id=102,
    )  # fmt: skip
    return Gemma3TextConfig(**{**settings, **overrides})


@pytest.fixture(scope="module", params=["bidirectional", "causal"])
def gemma(request, tmp_path_factory, minilm_path: Path):
    """EmbeddingGemma's shape as Gemma3TextModel; the causal model as Gemma3ForCausalLM (weights under
    `model.`), with its bare decoder as the reference."""
    from transformers import Gemma3ForCausalLM, Gemma3TextModel

    path = tmp_path_factory.mktemp(f"gemma3-{request.param}") / "hf"
    if request.param == "bidirectional":
        return path, save_tiny(Gemma3TextModel(_config(bidirectional=True)), path, minilm_path)
    return path, save_tiny(Gemma3ForCausalLM(_config(bidirectional=False)), path, minilm_path).model


@pytest.mark.parametrize("backend", ["cpu_varlen", "sdpa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bare_model_matches_transformers_on_a_packed_batch(gemma, dtype: str, backend: str) -> None:
    path, model = gemma
    assert_token_states_match(path, model, random_ids(LENGTHS), dtype, attention_backend=backend)


def test_released_config_keys(tmp_path, gemma) -> None:
    """Released checkpoints give the bases as `rope_theta` and `rope_local_base_freq` and the layer kinds as a
    pattern (every n-th layer full), without the `rope_parameters` and `layer_types` transformers 5 writes."""
    path, model = gemma
    shutil.copytree(path, tmp_path / "model")
    config_file = tmp_path / "model" / "config.json"
    config = json.loads(config_file.read_text())
    del config["layer_types"], config["rope_parameters"]
    config.update(sliding_window_pattern=3, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling=None)
    config_file.write_text(json.dumps(config))
    assert_token_states_match(tmp_path / "model", model, random_ids([120, 7]), "float32")


def test_attention_bias_and_an_odd_causal_window(tmp_path, minilm_path: Path) -> None:
    from transformers import Gemma3TextModel

    config = _config(bidirectional=False, attention_bias=True, sliding_window=5, query_pre_attn_scalar=256)
    model = save_tiny(Gemma3TextModel(config), tmp_path, minilm_path, seed=1)
    assert_token_states_match(tmp_path, model, random_ids([200, 3, 64], seed=1), "float32")


@pytest.mark.parametrize("setting", ["attn_logit_softcapping", "rope_type"])
def test_what_it_cannot_run_is_refused_by_name(setting: str) -> None:
    config = _config(bidirectional=True).to_dict()
    create_model("Gemma3TextModel", config)  # the unchanged config loads
    if setting == "attn_logit_softcapping":
        config["attn_logit_softcapping"] = 50.0  # Gemma2's soft-capping: no attention backend applies it
    else:
        config["rope_parameters"]["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    with pytest.raises(ValueError, match=f"unsupported {setting}"):
        create_model("Gemma3TextModel", config)


# EmbeddingGemma's head: two Dense modules without bias or activation, widening four times and back.
DENSE = [
    {"out_features": 256, "bias": False, "activation_function": nn.Identity()},
    {"out_features": 64, "bias": False, "activation_function": nn.Identity()},
]


@pytest.fixture(scope="module", params=[40, None], ids=["limit 40", "limit 512"])
def st_dirs(request, tmp_path_factory, minilm_path: Path) -> dict[str, Path]:
    from transformers import Gemma3TextModel

    root = tmp_path_factory.mktemp("st")
    save_tiny(Gemma3TextModel(_config(bidirectional=True)), root / "hf", minilm_path, seed=3)
    return sentence_transformers_dirs(root, root / "hf", request.param, dense=DENSE)


@pytest.mark.parametrize("layout", ["current", "legacy"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_bouquet_embed_matches_sentence_transformers(tmp_path, st_dirs, layout: str, dtype: str, prompt_name) -> None:
    assert_bouquet_matches_sentence_transformers(tmp_path, st_dirs, layout, dtype, prompt_name)
