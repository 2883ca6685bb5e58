"""sentence-transformers' formatting of a Transformer whose inputs are chat messages (its sentence_bert_config.json's
`modality_config` has "message"), read without torch so the gateway may use it too. sentence-transformers 6 infers
"message" for any Transformer whose processor or tokenizer has a chat template when it builds the module from a
transformers directory (transformer.py's `infer_modalities`), and saves it: Qwen3-VL-Embedding, and a text model
such as a Qwen3, Qwen2, Gemma 3 or Mistral embedder so built. A directory saved before modality_config existed, or
re-saved after loading one, keeps "text" alone (its `load_config` fills in the text-only default), and is not read
here: its texts are embedded as they are.

Such a Transformer turns every input into one conversation before its processor sees it (transformer.py's
`preprocess`, sentence-transformers 5.4+): a text or an image alone becomes a user message of that one part; the
prompt (`prompt_name`'s, else the default one) becomes a system message before it, word for word, and there is none
without a prompt; the chat template is rendered with `processing_kwargs`' `chat_template` arguments, of which the
generation prompt is the one that changes the row. Other processing kwargs (an image's pixel bounds, a text's
length) would make inputs bouquet does not make, so a directory that sets them is refused, naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bouquet.st_layout import read_optional_json

# The chat template arguments bouquet follows; any other would render the conversation otherwise.
_TEMPLATE_ARGUMENTS = {"add_generation_prompt"}
# The tokenizer's named special tokens, which transformers hands the chat template as variables (its
# special_tokens_map): Gemma's and Mistral's templates begin with {{ bos_token }}.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class StMessages:
    """How sentence-transformers formats this model's inputs as conversations (the module docstring)."""

    generation_prompt: bool  # processing_kwargs' chat_template add_generation_prompt; sentence-transformers: False
    flat: bool = False  # a message's content is the text itself ("flat"), not a list of typed parts ("structured")
    special_tokens: tuple[tuple[str, str], ...] = ()  # (name, token) the tokenizer's files name (SPECIAL_TOKEN_NAMES)


def read_st_messages(transformer_dir: Path) -> StMessages | None:
    """The Transformer's message formatting; None where its inputs are not messages (or it has no such config)."""
    config_file = transformer_dir / "sentence_bert_config.json"
    config = read_optional_json(config_file) or {}
    if "message" not in (config.get("modality_config") or {}):
        return None
    flat = _flat(config["modality_config"]["message"], config_file)
    kwargs: dict[str, Any] = dict(config.get("processing_kwargs") or {})
    template: dict[str, Any] = dict(kwargs.pop("chat_template", None) or {})
    unknown = sorted(kwargs) + [f"chat_template.{key}" for key in sorted(set(template) - _TEMPLATE_ARGUMENTS)]
    if unknown:
        raise ValueError(
            f"{config_file}: processing_kwargs {', '.join(unknown)} not supported: bouquet formats a conversation's "
            "texts and images as the model's processor does by default, and follows chat_template's "
            "add_generation_prompt alone"
        )
    generation = bool(template.get("add_generation_prompt", False))
    return StMessages(generation, flat, _special_tokens(transformer_dir))


def _special_tokens(folder: Path) -> tuple[tuple[str, str], ...]:
    """The named special tokens tokenizer_config.json (else special_tokens_map.json) gives, as transformers reads them
    (a token saved as an object by its "content")."""
    named = {**(read_optional_json(folder / "special_tokens_map.json") or {}),
             **(read_optional_json(folder / "tokenizer_config.json") or {})}  # fmt: skip
    tokens = {name: named[name] for name in SPECIAL_TOKEN_NAMES if named.get(name) is not None}
    return tuple(
        (name, str(token.get("content") if isinstance(token, dict) else token)) for name, token in tokens.items()
    )


def _flat(message: dict[str, Any], config_file: Path) -> bool:
    """The message format sentence-transformers saved (InputFormatter's, resolved from the chat template when the
    module was built); "auto" would be resolved again at load, from patterns bouquet does not repeat."""
    format_ = message.get("format")
    if format_ not in ("flat", "structured"):
        raise ValueError(
            f"{config_file}: modality_config message format {format_!r} not supported: bouquet follows a saved "
            "'flat' or 'structured'"
        )
    return bool(format_ == "flat")
