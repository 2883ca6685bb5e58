"""Checks every model family's parity tests share: a tiny random transformers model saved beside the real
MiniLM tokenizer, the bare model's token states on a packed batch against transformers' `last_hidden_state`,
and `bouquet embed` against sentence-transformers on a directory in the current and the legacy layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conftest import row_cosines
from family_models import TOKENIZER_FILES, save_sentence_transformer, spread_weights
from st_models import to_legacy_layout
from test_st_layouts import PROMPTS, assert_same_rows, embed_with_bouquet, embed_with_sentence_transformers

from bouquet.batch import Batch
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.engine.inputs import prepare_inputs

VOCAB_SIZE = 30522  # the bundled MiniLM tokenizer's
TOKEN_BOUNDS = {"float32": 0.99999, "bfloat16": 0.999}


def save_tiny(
    model: torch.nn.Module, path: Path, tokenizer_dir: Path, seed: int = 0, scale: float = 0.15
) -> torch.nn.Module:
    """Spreads `model`'s weights (projections of std `scale`), saves it with `save_pretrained` and the MiniLM
    tokenizer files beside it."""
    spread_weights(model, seed, scale)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    return model.eval()


def set_tokenizer_limit(path: Path, model_max_length: int | None) -> None:
    """Sets (or, with None, removes) tokenizer_config.json's `model_max_length`."""
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("model_max_length", None)
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    config_file.write_text(json.dumps(config))


def random_ids(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Ordinary word-piece ids (no special or padding ids), one list per length."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, VOCAB_SIZE, (length,), generator=generator).tolist() for length in lengths]


def engine_token_states(engine: Engine, ids: list[list[int]]) -> np.ndarray:  # [T, D] float32
    batch = Batch.pack(ids)
    with torch.inference_mode():
        hidden = engine.runner.encode(prepare_inputs(batch, engine.device), engine.attn_backend.prepare)
    return hidden.float().numpy()


def reference_token_states(model: torch.nn.Module, ids: list[list[int]]) -> np.ndarray:  # [T, D]
    """transformers, one sequence at a time: no padding in the reference."""
    with torch.no_grad():
        return np.concatenate([model(torch.tensor([seq])).last_hidden_state[0].numpy() for seq in ids])


def assert_token_states_match(
    path: Path, reference: torch.nn.Module, ids: list[list[int]], dtype: str, attention_backend: str = "auto"
) -> float:
    engine = Engine(
        EngineConfig(
            model_path=path, device="cpu", dtype=dtype, attention_backend=attention_backend, cpu_warmup_tokens=0
        )
    )
    try:
        cosines = row_cosines(engine_token_states(engine, ids), reference_token_states(reference, ids))
    finally:
        engine.close()
    print(f"min token cosine {cosines.min():.7f}")  # shown with -rP
    assert cosines.min() >= TOKEN_BOUNDS[dtype], f"min token cosine {cosines.min():.7f}"
    return float(cosines.min())


def sentence_transformers_dirs(
    root: Path,
    hf_dir: Path,
    max_seq_length: int | None,
    pooling_mode: str = "mean",
    dense: list[dict[str, Any]] | None = None,
) -> dict[str, Path]:
    """The model saved by sentence-transformers (the pooling, prompts, any Dense modules, Normalize) and its
    legacy rewrite."""
    current = save_sentence_transformer(
        root / "current", hf_dir, pooling_mode, prompts=PROMPTS, max_seq_length=max_seq_length, dense=dense
    )
    limit = max_seq_length or json.loads((current / "tokenizer_config.json").read_text())["model_max_length"]
    return {"current": current, "legacy": to_legacy_layout(current, root / "legacy", limit, transformer_subdir=True)}


def assert_bouquet_matches_sentence_transformers(
    tmp_path: Path, dirs: dict[str, Path], layout: str, dtype: str, prompt_name: str | None
) -> None:
    expected = embed_with_sentence_transformers(dirs["current"], prompt_name)  # the float32 reference
    rows = embed_with_bouquet(tmp_path, dirs[layout], dtype, prompt_name)
    print(f"min cosine {row_cosines(rows, expected).min():.7f}")  # shown with -rP
    assert_same_rows(rows, expected, dtype)
