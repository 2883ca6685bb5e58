"""Random-weight models of every family bouquet runs, built with the transformers class and saved by
sentence-transformers beside the real MiniLM tokenizer: for the per-family benchmark and the tests.

Encoders take MiniLM's shape (6 layers, hidden 384, 12 heads of 32, intermediate 1536); families with a gated
MLP (three matrices, not two) take intermediate 1024 so a token costs the same dense FLOPs, and decoders 6 query
heads of 64 over 2 key-value heads. Every model is limited to 256 tokens, as MiniLM is.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
MAX_SEQ_LENGTH = 256

_ENCODER = dict(
    vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
    max_position_embeddings=512,
)  # fmt: skip
_GATED = {**_ENCODER, "intermediate_size": 1024}
_DECODER = {**_GATED, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64}
# The tests' shape: small enough to build, save and load every family in a second or two.
_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, head_dim=32)
_SPECIAL_IDS = dict(pad_token_id=0, bos_token_id=101, eos_token_id=102)  # the MiniLM tokenizer's
_MODERNBERT = {**_GATED, **_SPECIAL_IDS, "cls_token_id": 101, "sep_token_id": 102}
# EmbeddingGemma's arrangement: bidirectional, mean-pooled, five sliding layers to one full.
_GEMMA3 = dict(
    **_DECODER, **_SPECIAL_IDS, query_pre_attn_scalar=64, sliding_window=512, use_bidirectional_attention=True
)


@dataclass(frozen=True)
class Family:
    config_class: str  # in transformers
    model_class: str
    pooling: str  # sentence-transformers' pooling mode
    kwargs: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "bert": Family("BertConfig", "BertModel", "mean", _ENCODER),
    # Positions start after the padding index (1), so the table holds two rows more than the limit.
    "xlm-roberta": Family("XLMRobertaConfig", "XLMRobertaModel", "mean", {**_ENCODER, "pad_token_id": 1}),
    "nomic-bert": Family("NomicBertConfig", "NomicBertModel", "mean", {**_GATED, "head_dim": 32}),
    "gte": Family("GteConfig", "GteModel", "cls", _GATED),
    "mpnet": Family("MPNetConfig", "MPNetModel", "mean", _ENCODER),
    "modernbert": Family("ModernBertConfig", "ModernBertModel", "mean", _MODERNBERT),
    "qwen2": Family("Qwen2Config", "Qwen2Model", "lasttoken", _DECODER),
    "qwen3": Family("Qwen3Config", "Qwen3Model", "lasttoken", _DECODER),
    "mistral": Family("MistralConfig", "MistralModel", "lasttoken", _DECODER),
    "gemma3": Family("Gemma3TextConfig", "Gemma3TextModel", "mean", _GEMMA3),
}


def spread_weights(model: torch.nn.Module, seed: int, scale: float = 0.15) -> None:
    """Random weights wide enough that attention is far from uniform (a position or window bug then shows):
    projections of std `scale`, norm weights around 1, embeddings of std 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name.lower():
                param.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.1 * noise)
            elif "embed" in name.lower():
                param.copy_(noise)
            else:
                param.copy_(scale * noise)


def save_sentence_transformer(
    out: Path,
    hf_dir: Path,
    pooling_mode: str | tuple[str, ...] = "mean",
    include_prompt: bool = True,
    dense: list[dict[str, Any]] | None = None,
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    max_seq_length: int | None = None,
    seed: int = 0,
) -> Path:
    """Builds the pipeline from sentence-transformers' own modules and saves it with its current `save`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(str(hf_dir), max_seq_length=max_seq_length)
    width = transformer.get_embedding_dimension()
    modules: list[torch.nn.Module] = [transformer, Pooling(width, pooling_mode, include_prompt=include_prompt)]
    width *= 1 if isinstance(pooling_mode, str) else len(pooling_mode)
    generator = torch.Generator().manual_seed(seed + 1)
    for layer in dense or []:
        module = Dense(width, **layer)
        with torch.no_grad():
            for param in module.parameters():
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
        modules.append(module)
        width = layer["out_features"]
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, device="cpu", prompts=prompts)
    model.save(str(out))
    return out


def build_family(name: str, out: Path, tokenizer_dir: Path, tiny: bool = False, seed: int = 0) -> Path:
    """`out/hf` (the transformers model, saved by `save_pretrained`) and `out/st` (the sentence-transformers
    directory to load); returns the latter."""
    import transformers

    family = FAMILIES[name]
    kwargs = {**family.kwargs, **{k: v for k, v in _TINY.items() if tiny and k in family.kwargs}}
    config = getattr(transformers, family.config_class)(**kwargs)
    model = getattr(transformers, family.model_class)(config)
    spread_weights(model, seed)
    model.save_pretrained(out / "hf")
    for file in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / file, out / "hf" / file)
    return save_sentence_transformer(out / "st", out / "hf", family.pooling, max_seq_length=MAX_SEQ_LENGTH)
