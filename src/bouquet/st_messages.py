"""sentence-transformers' formatting of a Transformer that takes images among chat messages (its
sentence_bert_config.json's `modality_config` has "image" and "message": Qwen3-VL-Embedding saved by
sentence-transformers), read without torch so the gateway may use it too. (A text model whose tokenizer has a chat
template gets "message" too; bouquet embeds its texts as they are, and this reads nothing for it.)

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


@dataclass(frozen=True)
class StMessages:
    """How sentence-transformers formats this model's inputs as conversations (the module docstring)."""

    generation_prompt: bool  # processing_kwargs' chat_template add_generation_prompt; sentence-transformers: False


def read_st_messages(transformer_dir: Path) -> StMessages | None:
    """The Transformer's message formatting; None where it takes no images as messages (or has no such config)."""
    config_file = transformer_dir / "sentence_bert_config.json"
    config = read_optional_json(config_file) or {}
    if not {"image", "message"} <= set(config.get("modality_config") or {}):
        return None
    kwargs: dict[str, Any] = dict(config.get("processing_kwargs") or {})
    template: dict[str, Any] = dict(kwargs.pop("chat_template", None) or {})
    unknown = sorted(kwargs) + [f"chat_template.{key}" for key in sorted(set(template) - _TEMPLATE_ARGUMENTS)]
    if unknown:
        raise ValueError(
            f"{config_file}: processing_kwargs {', '.join(unknown)} not supported: bouquet formats a conversation's "
            "texts and images as the model's processor does by default, and follows chat_template's "
            "add_generation_prompt alone"
        )
    return StMessages(generation_prompt=bool(template.get("add_generation_prompt", False)))
