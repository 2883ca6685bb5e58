"""How transformers pads a model's texts when the model was trained on padded texts (SigLIP and SigLIP 2: texts
padded to a fixed length, 64, and the text tower pools the last position, a pad token for any shorter text;
transformers' docs ask for `padding="max_length"`, and Siglip2Processor pads so by default). Read from the
tokenizer's files: the pad token, whether the tokenizer gives an `attention_mask` (its `model_input_names`;
transformers' tokenizers give one unless the saved config says otherwise, and SigLIP's own say input_ids alone),
with which the pad tokens are masked as keys, its `model_max_length`, what `padding="max_length"` pads to, and the
side it pads on (tokenizer_class.py: SigLIP 2's tokenizer class pads on the left). No torch.

A model whose processor class pads and cuts every text at a length of its own (`processor_text_length`: SigLIP 2's
64, models/siglip2.py) runs texts of that length whatever the tokenizer's `model_max_length` says; but a
`max_length` or `padding` saved in tokenizer_config.json is what transformers' processor call takes over its class
defaults when the call names none (a plain call, sentence-transformers'), while the model's documented call names
both: such a directory has two readings in transformers, and is refused.

A model whose processor class has no length of its own (SigLIP's SiglipProcessor) has its texts padded, in the
documented calls (`padding="max_length"`), to the tokenizer's `model_max_length`, which bouquet follows; but a
`max_length` saved in tokenizer_config.json (a tokenizer built with one keeps it) is where the processor's call pads
and cuts, and where sentence-transformers' call cuts (its `max_seq_length` then cuts nothing), while the tokenizer's
own call ignores it. SigLIP's docs show both calls, so a saved `max_length` other than `model_max_length` is two
readings too, and is refused. A saved `padding` is taken by a call that names none, which for such a model pads
nothing unless one is saved: every documented call names `padding="max_length"`, so a saved one changes nothing that
bouquet serves."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def processor_text_length(model: Any) -> int | None:
    """The length the model's processor pads and cuts every text at, whatever the tokenizer says; None if none."""
    length = getattr(model, "processor_text_length", None)
    return length if isinstance(length, int) else None


def text_limit(st_limit: int, model: Any) -> int:
    """The longest text `model` runs: sentence-transformers' limit (`st_limit`: its max_seq_length, else the
    tokenizer's model_max_length) within the model's positions, or its processor's own length (module docstring)."""
    fixed = processor_text_length(model)
    return fixed if fixed is not None else min(st_limit, int(model.max_seq_length))


def read_text_padding(folder: Path, processor_length: int | None = None) -> TextPadding | None:
    """The padding of the tokenizer saved in `folder`; None when it names no pad token in its vocabulary.
    `processor_length`: the model's processor's own text length, which the saved settings must not contradict."""
    tokenizer_config = read_optional_json(folder / "tokenizer_config.json") or {}
    named = {**(read_optional_json(folder / "special_tokens_map.json") or {}), **tokenizer_config}
    max_length = _model_max_length(named)
    if processor_length is not None:
        _check_call_settings(folder / "tokenizer_config.json", tokenizer_config, processor_length)
    else:
        _check_saved_max_length(folder / "tokenizer_config.json", tokenizer_config, max_length)
    token = named.get("pad_token")
    token = token.get("content") if isinstance(token, dict) else token
    tokenizer = load_tokenizer(tokenizer_json(tokenizer_file(folder)))
    pad_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
    if pad_id is None:
        return None
    input_names = named.get("model_input_names")
    return TextPadding(
        pad_id,
        masked=input_names is None or "attention_mask" in input_names,
        max_length=max_length,
        left=padding_side(folder, tokenizer.padding) == "left",
    )


def _model_max_length(named: dict[str, Any]) -> int | None:
    """The tokenizer's `model_max_length`; None where it sets none (or transformers' stand-in for none)."""
    length = named.get("model_max_length")
    return length if isinstance(length, int) and 0 < length < UNSET_MODEL_MAX_LENGTH else None


def _check_call_settings(path: Path, tokenizer_config: dict[str, Any], length: int) -> None:
    """Refuses a saved `max_length` or `padding` that a processor call naming none would take over `length` and
    "max_length" (module docstring)."""
    expected = {"max_length": length, "padding": "max_length"}
    saved = tokenizer_config
    differ = {key: saved[key] for key, value in expected.items() if saved.get(key, value) != value}
    if differ:
        raise ValueError(
            f"{path}: {differ} makes transformers' processor pad and cut texts otherwise when called without "
            f"settings (and in sentence-transformers) than in this model's documented call (padding='max_length', "
            f"max_length={length}), so bouquet cannot give both rows; remove those keys (or save max_length {length}, "
            "padding 'max_length')"
        )


def _check_saved_max_length(path: Path, tokenizer_config: dict[str, Any], model_max_length: int | None) -> None:
    """Refuses a saved `max_length` that the processor's call takes where the tokenizer's pads to `model_max_length`
    (module docstring)."""
    saved = tokenizer_config.get("max_length")
    if saved is None or saved == model_max_length:
        return
    raise ValueError(
        f"{path}: max_length {saved!r} makes transformers' processor pad and cut texts at {saved!r} (and "
        "sentence-transformers cut them there), while its tokenizer called as this model's docs show "
        f"(padding='max_length') pads them to model_max_length {model_max_length}, so bouquet cannot give both rows; "
        "remove max_length (or save it equal to model_max_length)"
    )
