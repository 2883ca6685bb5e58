"""Model directories as sentence-transformers saves them today (6.x, through its own `save`), and the same
models rewritten in the layout 2.x-4.x saved (module paths `sentence_transformers.models.*`, legacy pooling
flags, the length in sentence_bert_config.json, Dense weights as pytorch_model.bin, optionally the
Transformer in `0_Transformer/`), for the loader's parity tests. The current-layout builder,
`save_sentence_transformer`, lives in bench/family_models.py, which the per-family benchmark shares."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from family_models import TOKENIZER_FILES, spread_weights

_LEGACY_TYPES = {
    "Transformer": "sentence_transformers.models.Transformer",
    "Pooling": "sentence_transformers.models.Pooling",
    "Dense": "sentence_transformers.models.Dense",
    "Normalize": "sentence_transformers.models.Normalize",
}
_LEGACY_FLAGS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


def tiny_bert(path: Path, tokenizer_dir: Path, seed: int = 0, max_positions: int = 512) -> Path:
    """A 2-layer random BERT saved with `save_pretrained`, the real MiniLM tokenizer beside it."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=max_positions,
    )  # fmt: skip
    model = BertModel(config, add_pooling_layer=False)
    spread_weights(model, seed)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def to_legacy_layout(current: Path, out: Path, max_seq_length: int, transformer_subdir: bool = False) -> Path:
    """`current` (a 6.x save) as sentence-transformers 2.x-4.x wrote it."""
    shutil.copytree(current, out)
    modules = json.loads((out / "modules.json").read_text())
    for module in modules:
        kind = module["type"].rsplit(".", 1)[-1]
        module["type"] = _LEGACY_TYPES[kind]
        folder = out / module["path"]
        if kind == "Transformer":
            _legacy_transformer(out, folder, max_seq_length)
            if transformer_subdir:
                module["path"] = _move_transformer(out)
        elif kind == "Pooling":
            _legacy_pooling(folder / "config.json")
        elif kind == "Dense":
            _legacy_dense(folder)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    return out


def _legacy_transformer(root: Path, folder: Path, max_seq_length: int) -> None:
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
    )
    # Old tokenizer configs often carried no limit, or one the model was not trained for: the sentence-bert
    # config must win over it.
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = 1000000000000000019884624838656
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def _move_transformer(root: Path) -> str:
    target = root / "0_Transformer"
    target.mkdir()
    names = ["config.json", "model.safetensors", "sentence_bert_config.json", *TOKENIZER_FILES]
    for name in names:
        if (root / name).exists():
            shutil.move(str(root / name), target / name)
    return "0_Transformer"


def _legacy_pooling(config_file: Path) -> None:
    config = json.loads(config_file.read_text())
    modes = config.pop("pooling_mode")
    modes = [modes] if isinstance(modes, str) else modes
    legacy: dict[str, Any] = {"word_embedding_dimension": config.pop("embedding_dimension")}
    legacy.update({flag: mode in modes for mode, flag in _LEGACY_FLAGS.items()})
    legacy["include_prompt"] = config.pop("include_prompt", True)
    config_file.write_text(json.dumps(legacy, indent=2))


def _legacy_dense(folder: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    config = json.loads((folder / "config.json").read_text())
    config.pop("module_input_name", None)
    config.pop("module_output_name", None)
    (folder / "config.json").write_text(json.dumps(config))
