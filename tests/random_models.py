"""Small random-weight models in the sentence-transformers layout, for paths no real model covers here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

VOCAB_SIZE = 30522  # the bundled tokenizer's, so the real tokenizer.json can serve the random models too


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # Norm weights away from 1 and larger projections, so a wrong norm or a missed op shows in the cosine.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name.lower():
                param.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                param.copy_(0.05 * noise)


def write_sentence_transformers_files(path: Path, tokenizer_source: Path, pooling: str, max_len: int) -> None:
    shutil.copy(tokenizer_source / "tokenizer.json", path / "tokenizer.json")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": pooling}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len}))


def make_qwen3(path: Path, tokenizer_source: Path, bidirectional: bool, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if bidirectional:
        config.use_bidirectional_attention = True
    model = Qwen3Model(config)
    _randomize(model, seed)
    model.save_pretrained(path)
    write_sentence_transformers_files(path, tokenizer_source, "lasttoken", max_len=512)
    return model.eval()


def make_bert(path: Path, tokenizer_source: Path, seed: int = 0) -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    model = BertModel(config, add_pooling_layer=True)
    _randomize(model, seed)
    model.save_pretrained(path)
    write_sentence_transformers_files(path, tokenizer_source, "cls", max_len=512)
    return model.eval()
