"""MPNet against transformers and sentence-transformers, on tiny random-weight models.

The relative position bias only shows through the attention it shapes, so the weights are spread (attention far
from uniform), the bias table is spread like any embedding, and the packed batch holds sequences longer than
the 128-token distance where the buckets stop: a bucket off by one, a bias of the wrong sign or direction, or a
table sliced wrongly per sequence moves the token states far from the reference. The position table holds 512
tokens after the padding offset of 2, and one sequence is exactly 512 long, so an offset off by one either way
changes every position embedding or runs off the table."""

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
    set_tokenizer_limit,
)

from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine

POSITIONS = 514  # rows in the position table; MPNet's padding index 1 leaves 512 for tokens
LENGTHS = [1, 9, 40, 512, 77, 200]


def _config():
    from transformers import MPNetConfig

    return MPNetConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=POSITIONS,
    )  # fmt: skip


@pytest.fixture(scope="module")
def mpnet(tmp_path_factory, minilm_path: Path):
    from transformers import MPNetModel

    path = tmp_path_factory.mktemp("mpnet") / "hf"
    # With its classification pooler, as all-mpnet-base-v2 was saved: the loader must drop it.
    model = save_tiny(MPNetModel(_config(), add_pooling_layer=True), path, minilm_path)
    set_tokenizer_limit(path, POSITIONS - 2)
    return path, model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bare_model_matches_transformers_on_a_packed_batch(mpnet, dtype: str) -> None:
    path, model = mpnet
    assert_token_states_match(path, model, random_ids(LENGTHS), dtype)


def test_masked_lm_checkpoint_loads_without_its_head(tmp_path, minilm_path: Path) -> None:
    """`MPNetForMaskedLM` saves the encoder under `mpnet.` beside its `lm_head`."""
    from transformers import MPNetForMaskedLM

    model = save_tiny(MPNetForMaskedLM(_config()), tmp_path, minilm_path, seed=1)
    assert_token_states_match(tmp_path, model.mpnet, random_ids([3, 150, 20], seed=1), "float32")


def test_limit_is_the_position_table_less_the_offset(tmp_path, mpnet) -> None:
    path = tmp_path / "model"
    shutil.copytree(mpnet[0], path)
    set_tokenizer_limit(path, None)  # the loader then caps by max_position_embeddings (514) alone
    engine = Engine(EngineConfig(model_path=path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
    engine.close()
    assert engine.max_seq_length == POSITIONS - 2


@pytest.fixture(scope="module", params=[40, None], ids=["limit 40", "limit 512"])
def st_dirs(request, tmp_path_factory, mpnet) -> dict[str, Path]:
    return sentence_transformers_dirs(tmp_path_factory.mktemp("st"), mpnet[0], request.param)


@pytest.mark.parametrize("layout", ["current", "legacy"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_bouquet_embed_matches_sentence_transformers(tmp_path, st_dirs, layout: str, dtype: str, prompt_name) -> None:
    assert_bouquet_matches_sentence_transformers(tmp_path, st_dirs, layout, dtype, prompt_name)
