"""A text model's texts as sentence-transformers 6 writes them when its Transformer takes chat messages
(st_messages.py): each text the one user message of a conversation, the prompt (`prompt_name`'s, else the default)
a system message before it word for word and none without one, rendered by the model's chat template (the generation
prompt as saved, the tokenizer's special tokens its variables) and tokenized without the tokenizer's own special
tokens (transformers' apply_chat_template).

A conversation over the limit is cut as sentence-transformers cuts it (transformer.py's
`_restore_chat_template_suffix`): to the limit, then the template's tail written back over its last tokens, since a
last-token pooling reads the final position. The tail is the longest token suffix two renders of the conversation
with different texts share (its `_chat_template_suffix_ids`); the head, the longest prefix, frames a document's chunks
(gateway/contextual.py). A cross-encoder's pair is a query and a document message instead of the user's.

The gateway tokenizes with it (gateway/replicas/tokenization.py), and so do `bouquet embed` and `bouquet.ray` through
`ConversationTokenizer`. No torch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from bouquet.chat_templates import ChatTemplate, TemplateError, read_chat_template
from bouquet.st_messages import StMessages
from bouquet.tokenizer import TokenizerSource, load_tokenizer

if TYPE_CHECKING:
    from bouquet.model_dir import ModelSpec

Tokenize = Callable[[list[str]], list[list[int]]]  # texts to ids, without special tokens
Text = str | tuple[str, str]  # a text, or a cross-encoder's (query, document) pair
# The two texts whose renders' common tail is the template's (sentence-transformers' fillers): they tokenize apart.
_FILLERS = ("0", "1 2 3 4")
# The roles sentence-transformers gives a pair's halves (its pair_to_messages), and its probes of a template: a
# baseline pair, then one varying each role's text.
PAIR_ROLES = ("query", "document")
_PAIR_PROBES = (("alpha", "bravo"), ("charlie", "bravo"), ("alpha", "foxtrot"))


def required_chat_template(spec: ModelSpec) -> str:
    """The chat template a text model whose Transformer takes messages writes its texts with (the replica sends it,
    `bouquet embed` renders with it); a directory without one, or with one jinja cannot compile, is refused here, at
    start, as no conversation can be written."""
    template = read_chat_template(spec.tokenizer_file.parent)
    if not template:
        raise ValueError(
            f"{spec.path}: its sentence-transformers Transformer takes its texts as chat messages (modality_config's "
            "message), but the directory has no chat template to write them with"
        )
    try:
        ChatTemplate(template)
    except TemplateError as error:
        raise ValueError(f"{spec.path}: {error}") from None
    return template


class TextMessages:
    """Renders and cuts a text model's conversations (the module docstring)."""

    def __init__(self, template: ChatTemplate, st: StMessages):
        self._template = template
        self._st = st
        self._variables = dict(st.special_tokens)
        self._frames: dict[tuple[str, bool], tuple[list[int], list[int]]] = {}  # by prompt, and pair or text
        self._pair_failure: str | None = None  # "" once the template is known to carry pairs

    def render(self, text: Text, prompt: str) -> str:
        """A text as the user message, or a pair as a query and a document message (sentence-transformers'
        pair_to_messages), after the prompt's system message."""
        messages = [self._message("system", prompt)] if prompt else []
        if isinstance(text, str):
            messages.append(self._message("user", text))
        else:
            messages.extend(self._message(role, part) for role, part in zip(PAIR_ROLES, text, strict=True))
        return self._template.render(messages, self._st.generation_prompt, self._variables)

    def encode(
        self, texts: Sequence[Text], prompt: str, tokenize: Tokenize, limit: int | None, from_left: bool = False
    ) -> list[list[int]]:
        """Each text's (or pair's) conversation tokenized, then cut within `limit` (None: whole)."""
        sequences = tokenize([self.render(text, prompt) for text in texts])
        if limit is None:
            return sequences
        return [
            self.cut(ids, limit, prompt, from_left, tokenize, pair=not isinstance(text, str))
            for text, ids in zip(texts, sequences, strict=True)
        ]

    def cut(self, ids: list[int], limit: int, prompt: str, from_left: bool, tokenize: Tokenize, pair: bool = False
            ) -> list[int]:  # fmt: skip
        """`ids` within `limit`: its first (last, `from_left`) tokens, ending in the template's tail."""
        if len(ids) <= limit:
            return ids
        kept = ids[-limit:] if from_left else ids[:limit]
        tail = self.frame(prompt, tokenize, pair)[1][-limit:]
        return kept[: limit - len(tail)] + tail

    def frame(self, prompt: str, tokenize: Tokenize, pair: bool = False) -> tuple[list[int], list[int]]:
        """The ids a conversation puts before its text (the system message, the user turn's opening) and after it
        (the tail): the longest token prefix and suffix two renders with different texts share (a pair's: both
        halves the filler, as sentence-transformers' skeleton has them)."""
        if (prompt, pair) not in self._frames:
            renders = [self.render((filler, filler) if pair else filler, prompt) for filler in _FILLERS]
            first, second = tokenize(renders)
            shortest = min(len(first), len(second))
            tail = _shared(reversed(first), reversed(second))
            # Renders that never differ hold no text at all: sentence-transformers then restores nothing.
            tail = tail if 0 < tail < shortest else 0
            head = min(_shared(first, second), shortest - tail)
            self._frames[prompt, pair] = (first[:head], first[len(first) - tail :])
        return self._frames[prompt, pair]

    def pair_failure(self) -> str | None:
        """Why the template cannot carry a (query, document) pair, as sentence-transformers decides before it scores
        one (its pair_roles_failure): a probe whose query or document changed must render otherwise; None if it can."""
        if self._pair_failure is None:
            try:
                base, *varied = [self.render(probe, "") for probe in _PAIR_PROBES]
            except Exception as error:  # a template's own Python error too (an int and None added), as its probe
                self._pair_failure = f"it raised {type(error).__name__}: {error}"
            else:
                dropped = [repr(role) for role, render in zip(PAIR_ROLES, varied, strict=True) if render == base]
                roles = " and ".join(dropped)
                self._pair_failure = f"the {roles} content does not reach the rendered prompt" if dropped else ""
        return self._pair_failure or None

    def _message(self, role: str, text: str) -> dict[str, Any]:
        """A message as sentence-transformers' InputFormatter writes it in the saved format."""
        return {"role": role, "content": text if self._st.flat else [{"type": "text", "text": text}]}


def _shared(left: Iterable[int], right: Iterable[int]) -> int:
    """How many leading ids two sequences share."""
    count = 0
    for one, other in zip(left, right, strict=False):
        if one != other:
            break
        count += 1
    return count


class ConversationTokenizer:
    """A conversation model's texts to ids for `bouquet embed` and `bouquet.ray` (offline/embed.py), as the gateway
    tokenizes them: rendered, tokenized without the tokenizer's special tokens, cut to the limit."""

    def __init__(self, tokenizer: TokenizerSource, max_length: int, messages: TextMessages):
        self.max_length = max_length
        self.messages = messages
        self._tokenizer = load_tokenizer(tokenizer)
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()

    def encode_prompted(self, texts: list[str], prompt: str) -> list[list[int]]:
        return self.messages.encode(texts, prompt, self._ids, self.max_length)

    def prompt_tokens(self, prompt: str) -> int:
        """No prompt token is left out of the pooling: sentence-transformers pools a system message with the rest."""
        return 0

    def _ids(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False)]
