"""How transformers pads a model's texts when the model was trained on padded texts (SigLIP and SigLIP 2: texts
padded to a fixed length, 64, and the text tower pools the last position, a pad token for any shorter text;
transformers' docs ask for `padding="max_length"`, and Siglip2Processor pads so by default). Read from the
tokenizer's files: the pad token, whether the tokenizer gives an `attention_mask` (its `model_input_names`;
transformers' tokenizers give one unless the saved config says otherwise, and SigLIP's own say input_ids alone),
with which the pad tokens are masked as keys, its `model_max_length`, what `padding="max_length"` pads to, and the
side it pads on (tokenizer_class.py: SigLIP 2's tokenizer class pads on the left). No torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bouquet.model_dir import UNSET_MODEL_MAX_LENGTH
from bouquet.st_layout import read_optional_json
from bouquet.tokenizer import load_tokenizer, tokenizer_json
from bouquet.tokenizer_class import padding_side, tokenizer_file


@dataclass(frozen=True)
class TextPadding:
    pad_id: int  # the pad token's id
    masked: bool  # pad tokens are never attended to (the model is given an attention_mask); else they are keys
    max_length: int | None = None  # the tokenizer's model_max_length; None where it sets none
    left: bool = False  # pads go before the text (the last position is then the text's last token)


def read_text_padding(folder: Path) -> TextPadding | None:
    """The padding of the tokenizer saved in `folder`; None when it names no pad token in its vocabulary."""
    named = {**(read_optional_json(folder / "special_tokens_map.json") or {}),
             **(read_optional_json(folder / "tokenizer_config.json") or {})}  # fmt: skip
    token = named.get("pad_token")
    token = token.get("content") if isinstance(token, dict) else token
    tokenizer = load_tokenizer(tokenizer_json(tokenizer_file(folder)))
    pad_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
    if pad_id is None:
        return None
    input_names = named.get("model_input_names")
    max_length = named.get("model_max_length")
    known = isinstance(max_length, int) and 0 < max_length < UNSET_MODEL_MAX_LENGTH
    return TextPadding(
        pad_id,
        masked=input_names is None or "attention_mask" in input_names,
        max_length=max_length if known else None,
        left=padding_side(folder, tokenizer.padding) == "left",
    )
