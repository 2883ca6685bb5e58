"""A conversation model's chat template (bouquet/chat_templates.py): found where transformers saves it, rendered as
transformers' apply_chat_template renders it, and kept in jinja2's sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from qwen3_vl_models import CHAT_TEMPLATE, qwen_tokenizer

from bouquet.chat_templates import ChatTemplate, TemplateError, read_chat_template

MESSAGES = [
    {"role": "system", "content": [{"type": "text", "text": "Represent the user's input."}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a cat"}]},
]


def test_rendered_as_transformers_renders_it() -> None:
    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ChatTemplate(CHAT_TEMPLATE).render(MESSAGES) == expected


@pytest.mark.parametrize(
    ("files", "found"),
    [
        ({"chat_template.jinja": "A", "chat_template.json": {"chat_template": "B"}}, "A"),
        ({"chat_template.json": {"chat_template": "B"}, "tokenizer_config.json": {"chat_template": "C"}}, "B"),
        (
            {
                "tokenizer_config.json": {
                    "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
                }
            },
            "D",
        ),
        ({"tokenizer_config.json": {"model_max_length": 8}}, ""),
    ],
)
def test_found_where_transformers_saves_it(tmp_path: Path, files: dict, found: str) -> None:
    for name, content in files.items():
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    assert read_chat_template(tmp_path) == found


def test_a_template_cannot_reach_python_and_its_refusals_are_errors() -> None:
    with pytest.raises(TemplateError, match="chat template failed"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(MESSAGES)
    with pytest.raises(TemplateError, match="no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render(MESSAGES)
