"""XLM-RoBERTa and RoBERTa against transformers and sentence-transformers, on tiny random-weight models.

The position table is small (130 rows, so 128 tokens after the padding offset of 2) and the tokenizer's limit
is set to 128 as released XLM-RoBERTa models set it, so the longest texts use the table's last row: an offset
off by one either way changes every token's position embedding or runs off the table."""

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

POSITIONS = 130  # rows in the position table; pad_token_id 1 leaves 128 for tokens
LENGTHS = [1, 9, 40, 128, 77]


def _config(config_class: type, **overrides: int):
    sizes = dict(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=POSITIONS, type_vocab_size=1, pad_token_id=1,
    )  # fmt: skip
    return config_class(**{**sizes, **overrides})


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory, minilm_path: Path):
    from transformers import XLMRobertaConfig, XLMRobertaModel

    path = tmp_path_factory.mktemp("xlmr") / "hf"
    model = save_tiny(XLMRobertaModel(_config(XLMRobertaConfig), add_pooling_layer=False), path, minilm_path)
    set_tokenizer_limit(path, POSITIONS - 2)
    return path, model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bare_model_matches_transformers_on_a_packed_batch(xlmr, dtype: str) -> None:
    path, model = xlmr
    assert_token_states_match(path, model, random_ids(LENGTHS), dtype)


def test_roberta_masked_lm_checkpoint_loads_without_its_head(tmp_path, minilm_path: Path) -> None:
    from transformers import RobertaConfig, RobertaForMaskedLM

    # Two token types and padding index 0 here: neither is hard-coded.
    config = _config(RobertaConfig, type_vocab_size=2, pad_token_id=0)
    model = save_tiny(RobertaForMaskedLM(config), tmp_path, minilm_path)
    assert_token_states_match(tmp_path, model.roberta, random_ids([3, 129, 50], seed=1), "float32")


def test_limit_is_the_position_table_less_the_offset(tmp_path, xlmr) -> None:
    path = tmp_path / "model"
    shutil.copytree(xlmr[0], path)
    set_tokenizer_limit(path, None)  # the loader then caps by max_position_embeddings (130) alone
    engine = Engine(EngineConfig(model_path=path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
    engine.close()
    assert engine.max_seq_length == POSITIONS - 2


@pytest.fixture(scope="module", params=[40, None], ids=["limit 40", "limit 128"])
def st_dirs(request, tmp_path_factory, xlmr) -> dict[str, Path]:
    return sentence_transformers_dirs(tmp_path_factory.mktemp("st"), xlmr[0], request.param)


@pytest.mark.parametrize("layout", ["current", "legacy"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_bouquet_embed_matches_sentence_transformers(tmp_path, st_dirs, layout: str, dtype: str, prompt_name) -> None:
    assert_bouquet_matches_sentence_transformers(tmp_path, st_dirs, layout, dtype, prompt_name)
