"""Tiny random-weight ColBERT models beside the MiniLM tokenizer, in the layouts people have them: PyLate's
(a BERT encoder, then PyLate's Dense projection over every token; its settings in config_sentence_transformers.json),
Stanford's HF_ColBERT (`bert.*` and `linear.weight` in one checkpoint, artifact.metadata), jina-colbert-v2's
(HF_ColBERT over Jina's rotary XLM-R, `roberta.*`, its marker tokens added to the tokenizer), and bge-m3's
`colbert_linear.pt` beside its dense model.

PyLate itself is not installed here: every release pins sentence-transformers and transformers to versions older
than the project's (1.6.0: sentence-transformers==5.3.0, transformers<=5.3.0), so the files are written as its
`ColBERT.save` and `Dense.save` write them (read from its 1.6.0 source), and `pylate_encode` reimplements its
`tokenize` and `encode` on transformers' forward."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from family_checks import TOKENIZER_FILES, VOCAB_SIZE, save_tiny
from safetensors.torch import save_file

LIMIT = 64
WEIGHT_SCALE = 0.3  # projections' std: attention far from uniform
QUERY_LENGTH = 16
DOCUMENT_LENGTH = 40
_SHAPE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
PREFIXES = ("[unused0]", "[unused1]")  # tokens of the MiniLM vocabulary, standing for PyLate's added "[Q] ", "[D] "


# PyLate checkpoints exist on other encoders: GTE-ModernColBERT on ModernBERT (its local attention windowed to 16
# tokens here, so that a window bug shows on 40-token documents), and XLM-R (whose padding id is 1, so its prefixes
# must be other tokens than [unused0]).
ENCODERS = ("bert", "modernbert", "xlm-roberta")
XLM_R_PREFIXES = ("[unused2]", "[unused3]")
PYLATE_PREFIXES = ("[Q] ", "[D] ")  # PyLate's defaults, which it adds to the tokenizer (ids 30522 and 30523 here)


def _encoder(family: str = "bert") -> torch.nn.Module:
    import transformers

    if family == "modernbert":
        config = transformers.ModernBertConfig(
            **_SHAPE, max_position_embeddings=LIMIT, local_attention=16, global_attn_every_n_layers=2,
            pad_token_id=0, bos_token_id=101, eos_token_id=102, cls_token_id=101, sep_token_id=102,
        )  # fmt: skip
        return transformers.ModernBertModel(config)
    if family == "xlm-roberta":
        config = transformers.XLMRobertaConfig(**_SHAPE, max_position_embeddings=LIMIT + 2, pad_token_id=1)
        return transformers.XLMRobertaModel(config, add_pooling_layer=False)
    assert family == "bert", f"no ColBERT test encoder {family!r}: {ENCODERS}"
    return transformers.BertModel(
        transformers.BertConfig(**_SHAPE, max_position_embeddings=LIMIT), add_pooling_layer=False
    )


def _projection(hidden: int, dimension: int, seed: int, bias: bool = False) -> torch.nn.Linear:
    linear = torch.nn.Linear(hidden, dimension, bias=bias)
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        linear.weight.copy_(WEIGHT_SCALE * torch.randn(linear.weight.shape, generator=generator))
        if bias:
            linear.bias.copy_(0.1 * torch.randn(linear.bias.shape, generator=generator))
    return linear.eval()


def build_pylate(
    out: Path, tokenizer_dir: Path, attend_to_expansion: bool = False, seed: int = 0, encoder: str = "bert",
    added_prefixes: bool = False,
) -> Path:  # fmt: skip
    """PyLate's layout: the encoder at the root, `1_Dense` (PyLate's Dense, 64 -> 24, no bias). `added_prefixes`:
    its default prefixes "[Q] " and "[D] " added to the tokenizer and the word embeddings resized, as PyLate's
    ColBERT.__init__ does before it saves (BERT only), instead of tokens of the vocabulary."""
    model = _encoder(encoder)
    if added_prefixes:
        model.resize_token_embeddings(VOCAB_SIZE + len(PYLATE_PREFIXES))
    save_tiny(model, out, tokenizer_dir, seed, WEIGHT_SCALE)
    prefixes = XLM_R_PREFIXES if encoder == "xlm-roberta" else PREFIXES
    if added_prefixes:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(out))
        tokenizer.add_tokens(list(PYLATE_PREFIXES))
        tokenizer.save_pretrained(str(out))
        prefixes = PYLATE_PREFIXES
    _write_pylate_modules(out, _projection(64, 24, seed), prefixes, QUERY_LENGTH, DOCUMENT_LENGTH, attend_to_expansion)
    return out


def _write_pylate_modules(
    out: Path, projection: torch.nn.Linear, prefixes: tuple[str, str], query_length: int, document_length: int,
    attend_to_expansion: bool,
) -> None:  # fmt: skip
    """modules.json, PyLate's Dense (`1_Dense`, no bias) and config_sentence_transformers.json, as PyLate saves them."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": document_length - 1}))
    dense = out / "1_Dense"
    dense.mkdir()
    config = {"in_features": projection.in_features, "out_features": projection.out_features, "bias": False,
              "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False}  # fmt: skip
    (dense / "config.json").write_text(json.dumps(config))
    save_file({"linear.weight": projection.weight.detach().contiguous()}, str(dense / "model.safetensors"))
    settings = {"query_prefix": prefixes[0], "document_prefix": prefixes[1], "query_length": query_length,
                "document_length": document_length, "attend_to_expansion_tokens": attend_to_expansion,
                "skiplist_words": list(string.punctuation), "do_query_expansion": True, "prompts": {},
                "default_prompt_name": None, "similarity_fn_name": "MaxSim"}  # fmt: skip
    (out / "config_sentence_transformers.json").write_text(json.dumps(settings))


def build_pylate_from(
    encoder_dir: Path, out: Path, dimension: int, query_length: int, document_length: int, seed: int = 0
) -> tuple[Path, torch.nn.Linear]:
    """PyLate's layout around a real encoder's files (bench/colbert.py: MiniLM's), with a random projection to
    `dimension`; returns the directory and the projection."""
    import shutil

    out.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", *TOKENIZER_FILES):
        shutil.copy(encoder_dir / name, out / name)
    hidden = int(json.loads((encoder_dir / "config.json").read_text())["hidden_size"])
    projection = _projection(hidden, dimension, seed)
    _write_pylate_modules(out, projection, PREFIXES, query_length, document_length, attend_to_expansion=False)
    return out, projection


def build_hf_colbert(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Stanford's layout: config.json names HF_ColBERT; `bert.*` and `linear.weight` (64 -> 24) in one file."""
    from safetensors.torch import load_file

    save_tiny(_encoder(), out, tokenizer_dir, seed, WEIGHT_SCALE)
    state = {f"bert.{name}": tensor for name, tensor in load_file(str(out / "model.safetensors")).items()}
    state["linear.weight"] = _projection(64, 24, seed).weight.detach().contiguous()
    save_file(state, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"]}))
    metadata = {"query_maxlen": QUERY_LENGTH, "doc_maxlen": DOCUMENT_LENGTH, "attend_to_mask_tokens": False, "dim": 24}
    (out / "artifact.metadata").write_text(json.dumps(metadata))
    return out


# jina-colbert-v2's marker tokens, which its tokenizer adds after the vocabulary (250002 and 250003 there).
JINA_MARKERS = ("[QueryMarker]", "[DocumentMarker]")
JINA_DIMENSION = 32


def build_jina_colbert(out: Path, tokenizer_dir: Path, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """jina-colbert-v2's layout around a tiny JinaEmbeddingsV3Model (transformers' class for Jina's rotary XLM-R),
    saved by `save_pretrained` (which writes Jina's own tensor names: emb_ln, encoder.layers.N.mixer.Wqkv, ...):
    the tensors under `roberta.` with HF_ColBERT's `linear.weight` (64 -> 32, no bias) in the one checkpoint, the
    config as Jina's remote code has it (HF_ColBERT, model_type xlm-roberta, position_embedding_type rotary,
    rotary_emb_base), artifact.metadata, and the marker tokens added to the tokenizer. Returns the directory and
    transformers' encoder (the reference forward)."""
    import transformers
    from safetensors.torch import load_file
    from tokenizers import AddedToken, Tokenizer

    config = transformers.JinaEmbeddingsV3Config(
        **{**_SHAPE, "vocab_size": VOCAB_SIZE + len(JINA_MARKERS)}, max_position_embeddings=LIMIT, type_vocab_size=1,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
    )  # fmt: skip
    encoder = save_tiny(transformers.JinaEmbeddingsV3Model(config, add_pooling_layer=False), out, tokenizer_dir, seed,
                        WEIGHT_SCALE)  # fmt: skip
    state = {f"roberta.{name}": tensor for name, tensor in load_file(str(out / "model.safetensors")).items()}
    state["linear.weight"] = _projection(64, JINA_DIMENSION, seed).weight.detach().contiguous()
    save_file(state, str(out / "model.safetensors"))
    saved = json.loads((out / "config.json").read_text())
    saved.pop("rope_parameters")
    remote = "jinaai/xlm-roberta-flash-implementation--"
    jina = {"architectures": ["HF_ColBERT"], "model_type": "xlm-roberta", "position_embedding_type": "rotary",
            "rotary_emb_base": 20000.0, "use_flash_attn": True, "lora_adaptations": None,
            "auto_map": {"AutoConfig": f"{remote}configuration_xlm_roberta.XLMRobertaFlashConfig",
                         "AutoModel": f"{remote}modeling_xlm_roberta.XLMRobertaModel"}}  # fmt: skip
    (out / "config.json").write_text(json.dumps({**saved, **jina}))
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(marker, special=True) for marker in JINA_MARKERS])
    tokenizer.save(str(out / "tokenizer.json"))
    # jina-colbert-v2's own keys (its doc_maxlen is 300); without the markers, which its card passes PyLate instead
    metadata = {"query_maxlen": QUERY_LENGTH,
                "doc_maxlen": DOCUMENT_LENGTH, "attend_to_mask_tokens": True, "mask_punctuation": True,
                "dim": JINA_DIMENSION, "similarity": "cosine"}  # fmt: skip
    (out / "artifact.metadata").write_text(json.dumps(metadata))
    return out, encoder


def pylate_encode(
    model_dir: Path, projection: torch.nn.Linear, texts: list[str], is_query: bool, attend_to_expansion: bool = False,
    prefixes: tuple[str, str] = PREFIXES, encoder: torch.nn.Module | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """PyLate's ColBERT.encode (1.6.0), one text at a time on transformers' encoder: tokenized to length - 1
    (queries padded with [MASK] to it, the padding's attention mask 0 unless attend_to_expansion_tokens), the
    prefix id inserted after [CLS] with mask 1, the Dense projection on every token's state, a query's every token
    kept, a document's skiplist (string.punctuation's ids) and padding left out, each vector L2-normalised.
    `encoder`: the transformers model to run (else AutoModel's of the directory)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.pad_token_id = tokenizer.mask_token_id
    model = (encoder or AutoModel.from_pretrained(str(model_dir))).eval()
    length = QUERY_LENGTH if is_query else DOCUMENT_LENGTH
    prefix_id = tokenizer.convert_tokens_to_ids(prefixes[0] if is_query else prefixes[1])
    skiplist = torch.tensor(tokenizer.convert_tokens_to_ids(list(string.punctuation)))
    out = []
    for text in texts:
        padding = "max_length" if is_query else False
        encoded = tokenizer([text], truncation=True, max_length=length - 1, padding=padding, return_tensors="pt")
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        ids = torch.cat([ids[:, :1], torch.tensor([[prefix_id]]), ids[:, 1:]], dim=1)
        mask = torch.cat([mask[:, :1], torch.ones(1, 1, dtype=mask.dtype), mask[:, 1:]], dim=1)
        if is_query and attend_to_expansion:
            mask.fill_(1)
        with torch.no_grad():
            states = projection(model(input_ids=ids, attention_mask=mask).last_hidden_state)[0]
        keep = (
            torch.ones(ids.shape[1], dtype=torch.bool) if is_query else ~torch.isin(ids[0], skiplist) & mask[0].bool()
        )
        out.append(torch.nn.functional.normalize(states[keep], p=2, dim=1))
    return out
