"""What transformers' tokenizer class adds to a directory's tokenizer.json: the class `AutoTokenizer` loads for it,
read from its files as transformers 5 reads them, and what that class does on top of the file (a Lowercase
normaliser put first; the side it pads texts on when tokenizer_config.json names none). Only the classes whose
additions change a model's rows are listed; any other class uses tokenizer.json as it is and pads on the right
(transformers' default). No torch.

transformers 5 loads a `siglip2` directory's tokenizer as Siglip2Tokenizer whatever tokenizer_config.json's
`tokenizer_class` says (siglip2 is among the model types whose hub tokenizer class it calls wrong); Siglip2Tokenizer
keeps the file's vocabulary, merges and post-processor, rebuilds Gemma's normaliser with Lowercase in front of it
(SigLIP 2 was trained on lowercased text), and pads on the left, so the text tower's last position, which it
pools, is the text's last token rather than a pad.

tokenizer_config.json's `add_bos_token` and `add_eos_token` (released SigLIP 2's say false and true) are not rules
here: transformers 5 drops both whenever it loads a tokenizer.json, so the file's post-processor alone decides which
special tokens a text gets, as it does for `tokenizers` (transformers 4's GemmaTokenizerFast rebuilt the
post-processor from them instead).

SiglipTokenizer (SigLIP v1's) reads the directory's sentencepiece model, `spiece.model`, even beside a
tokenizer.json; bouquet rebuilds it as a `tokenizers` Tokenizer (sentencepiece_tokenizer.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bouquet.st_layout import read_optional_json, require

PADDING_SIDES = ("right", "left")


@dataclass(frozen=True)
class ClassRules:
    lowercase: bool  # a Lowercase normaliser goes before the file's
    padding_side: str  # when neither tokenizer_config.json nor tokenizer.json says


CLASS_RULES = {
    "Siglip2Tokenizer": ClassRules(lowercase=True, padding_side="left"),
    "GemmaTokenizer": ClassRules(lowercase=False, padding_side="left"),
}
DEFAULT_RULES = ClassRules(lowercase=False, padding_side="right")
# The classes that read a sentencepiece model rather than tokenizer.json, and the file they read.
SENTENCEPIECE_CLASSES = ("SiglipTokenizer",)
SPIECE_FILE = "spiece.model"
# Model types whose tokenizer class transformers picks itself, ignoring the one tokenizer_config.json names.
MODEL_TYPE_CLASSES = {"siglip2": "Siglip2Tokenizer"}
# Model types whose class transformers takes from its own table where the files name none (only those that matter).
MODEL_TYPE_DEFAULTS = {"siglip": "SiglipTokenizer"}


def tokenizer_class(folder: Path) -> str | None:
    """The tokenizer class transformers' AutoTokenizer loads for `folder` (None where its files name none and its
    model type has no default here)."""
    tokenizer_config = read_optional_json(folder / "tokenizer_config.json") or {}
    model_config = read_optional_json(folder / "config.json") or {}
    if "auto_map" not in tokenizer_config and model_config.get("model_type") in MODEL_TYPE_CLASSES:
        return MODEL_TYPE_CLASSES[model_config["model_type"]]
    named = tokenizer_config.get("tokenizer_class") or model_config.get("tokenizer_class")
    if isinstance(named, str):
        return named.removesuffix("Fast")
    return MODEL_TYPE_DEFAULTS.get(model_config.get("model_type") or "")


def tokenizer_file(folder: Path) -> Path:
    """The file transformers' tokenizer for `folder` is read from: SiglipTokenizer's sentencepiece model where that
    is the class and the file is there, else tokenizer.json (FileNotFoundError naming it when missing)."""
    spiece = folder / SPIECE_FILE
    if tokenizer_class(folder) in SENTENCEPIECE_CLASSES and spiece.is_file():
        return spiece
    return require(folder / "tokenizer.json")


def class_rules(folder: Path) -> ClassRules:
    return CLASS_RULES.get(tokenizer_class(folder) or "", DEFAULT_RULES)


def padding_side(folder: Path, saved_padding: dict[str, Any] | None) -> str:
    """The side transformers' tokenizer pads on: tokenizer_config.json's `padding_side`, else the padding saved in
    tokenizer.json (`saved_padding`, as `tokenizers` reads it), else its class's default."""
    tokenizer_config = read_optional_json(folder / "tokenizer_config.json") or {}
    direction = (saved_padding or {}).get("direction")
    side = tokenizer_config.get("padding_side") or (direction.lower() if isinstance(direction, str) else None)
    side = side or class_rules(folder).padding_side
    if side not in PADDING_SIDES:
        where = folder / "tokenizer_config.json"
        raise ValueError(f"{where}: padding_side must be one of {PADDING_SIDES}, got {side!r}")
    return str(side)
