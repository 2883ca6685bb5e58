"""Tiny random-weight sparse models beside the MiniLM tokenizer, for the sparse tests (and the sparse route's):
a SPLADE model (a transformers masked LM saved by sentence-transformers' SparseEncoder) and bge-m3's shape (an
XLM-RoBERTa embedding model saved by sentence-transformers, with FlagEmbedding's `sparse_linear.pt` at its root)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from family_checks import VOCAB_SIZE, save_tiny
from family_models import save_sentence_transformer

LIMIT = 64  # tokens a sequence keeps
WEIGHT_SCALE = 0.3  # projections' std: attention far from uniform
# Taken off the MLM's output bias so that most logits are negative and the rows sparse, as a trained SPLADE's are
# (the tied decoder's logits have a std of about 8 here).
LOGIT_SHIFT = 12.0
_SHAPE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def masked_lm(family: str) -> torch.nn.Module:
    """BERT's or XLM-RoBERTa's masked LM (XLM-RoBERTa's positions start after its padding index, 1)."""
    from transformers import BertConfig, BertForMaskedLM, XLMRobertaConfig, XLMRobertaForMaskedLM

    if family == "bert":
        return BertForMaskedLM(BertConfig(**_SHAPE, max_position_embeddings=LIMIT))
    config = XLMRobertaConfig(**_SHAPE, max_position_embeddings=LIMIT + 2, type_vocab_size=1, pad_token_id=1)
    return XLMRobertaForMaskedLM(config)


def build_splade(
    out: Path, tokenizer_dir: Path, family: str = "bert", module: str = "MLMTransformer", pooling: str = "max",
    activation: str = "relu", seed: int = 0,
) -> Path:  # fmt: skip
    """`out/hf` (the masked LM) and `out/st`, the SparseEncoder saved from it; returns the latter. `module`:
    MLMTransformer (sentence-transformers 5.0-5.3's class, still loaded) or Transformer (fill-mask, today's)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling, Transformer

    model = masked_lm(family)
    save_tiny(model, out / "hf", tokenizer_dir, seed, WEIGHT_SCALE)
    _sparsen(out / "hf", model, seed)
    if module == "MLMTransformer":
        transformer = MLMTransformer(str(out / "hf"), max_seq_length=LIMIT)
    else:
        transformer = Transformer(str(out / "hf"), transformer_task="fill-mask", max_seq_length=LIMIT)
    encoder = SparseEncoder(modules=[transformer, SpladePooling(pooling, activation)], device="cpu")
    encoder.save(str(out / "st"))
    return out / "st"


def _sparsen(path: Path, model: torch.nn.Module, seed: int) -> None:
    """Word embeddings (the tied decoder) of std 1 whatever name the tied tensor goes by, and the output bias
    lowered by LOGIT_SHIFT; saved again."""
    generator = torch.Generator().manual_seed(seed + 3)
    embeddings = model.get_input_embeddings().weight
    with torch.no_grad():
        embeddings.copy_(torch.randn(embeddings.shape, generator=generator))
        model.get_output_embeddings().bias -= LOGIT_SHIFT
    model.save_pretrained(path)


def build_bge_m3(out: Path, tokenizer_dir: Path, seed: int = 0) -> tuple[Path, torch.nn.Linear]:
    """bge-m3's layout at a tiny shape: XLM-RoBERTa, CLS pooling and Normalize (saved by sentence-transformers),
    and `sparse_linear.pt` (Linear(hidden, 1)) at the root. The MiniLM tokenizer's [SEP] is named its eos token,
    as XLM-RoBERTa's </s> is, so that every special token FlagEmbedding leaves out occurs in the texts."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    config = XLMRobertaConfig(**_SHAPE, max_position_embeddings=LIMIT + 2, type_vocab_size=1, pad_token_id=1)
    save_tiny(XLMRobertaModel(config, add_pooling_layer=False), out / "hf", tokenizer_dir, seed, WEIGHT_SCALE)
    tokenizer_config = out / "hf" / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "eos_token": "[SEP]"}))
    model_dir = save_sentence_transformer(out / "st", out / "hf", "cls", max_seq_length=LIMIT)
    sparse_linear = torch.nn.Linear(config.hidden_size, 1)
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        sparse_linear.weight.copy_(WEIGHT_SCALE * torch.randn(sparse_linear.weight.shape, generator=generator))
        sparse_linear.bias.fill_(0.1)
    torch.save(sparse_linear.state_dict(), model_dir / "sparse_linear.pt")
    return model_dir, sparse_linear.eval()
