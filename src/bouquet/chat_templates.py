"""A model's chat template: found in its directory as transformers saves it, and rendered as transformers renders it
(jinja2's immutable sandbox with trim_blocks and lstrip_blocks, `raise_exception`, a `tojson` that does not escape
HTML, `namespace`, `strftime_now`, the `{% generation %}` block, and `tools` and `documents` given as None), for
models whose inputs are conversations (Qwen3-VL-Embedding, gateway/patch_embed.py; text models, text_messages.py). A
template is code from the model's directory: the sandbox keeps it from reaching Python. No torch."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or failed on it, or does not compile."""


def read_chat_template(model_dir: Path) -> str:
    """The template transformers would load for the model's processor or tokenizer: chat_template.jinja, else
    chat_template.json's, else tokenizer_config.json's (the default of a named list); "" when there is none."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = model_dir / name
        if path.is_file():
            template = json.loads(path.read_text()).get("chat_template")
            if isinstance(template, list):  # [{"name": ..., "template": ...}]: transformers takes "default"
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
            if isinstance(template, str) and template:
                return template
    return ""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_: str) -> str:
    """transformers' clock for templates that date their system prompt (Llama 3's, Mistral Small 3's)."""
    return datetime.now().strftime(format_)


class _Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, which marks an assistant's reply for its training masks:
    rendered as its body, as transformers renders it when no mask is asked for."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        line = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class ChatTemplate:
    def __init__(self, source: str):
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _Generation]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["namespace"] = jinja2.utils.Namespace
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateError as error:
            raise TemplateError(f"the model's chat template does not compile: {error}") from None

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        variables: Mapping[str, str] | None = None,
    ) -> str:  # fmt: skip
        """`variables`: more the template may read, as transformers hands it the tokenizer's special tokens."""
        try:
            # transformers passes tools and documents, None without any: a template's `is defined` sees them
            given: dict[str, Any] = {**(variables or {}), "tools": None, "documents": None,
                                     "add_generation_prompt": add_generation_prompt}  # fmt: skip
            return self._template.render(messages=messages, **given)
        except TemplateError:
            raise
        except jinja2.TemplateError as error:
            raise TemplateError(f"the model's chat template failed: {error}") from None
