"""vLLM's chat form of `/v1/embeddings` (`messages`) for a text model whose texts are conversations
(text_messages.py). sentence-transformers' encode() of a conversation prepends the resolved prompt (the model's default
here, as nothing else names one) as a system message before the conversation's own messages; so a user message alone
is encode() of its text, and a system message then a user message, on a model without a default prompt, is encode()
of the user's text with the system message's text as the prompt, word for word. Those two shapes are embedded as such
texts (service.py, a literal prompt); any other is refused naming why, as this server writes a text as one user
message after at most one system message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bouquet.gateway.errors import InvalidRequest

_SHAPE = "this model embeds one user message, after an optional system message (its prompt)"


@dataclass(frozen=True)
class Turn:
    """One message as sent: its role, its texts, and each of its images' field path."""

    role: str
    texts: tuple[str, ...]
    images: tuple[str, ...]
    name: str  # `messages[m]`


def user_text(turns: Sequence[Turn], default_prompt: str) -> tuple[str, str | None]:
    """The user's text and the system message's (None: none sent, the model's default prompt then applies)."""
    roles = [turn.role for turn in turns]
    if roles not in (["user"], ["system", "user"]):
        raise InvalidRequest(f"{_misfit(turns)}; {_SHAPE}", "invalid_value", "messages")
    system = _text(turns[0]) if len(turns) == 2 else None
    if system is not None and default_prompt:
        raise InvalidRequest(
            f"this model has a default prompt ({default_prompt!r}), which sentence-transformers puts as a system "
            "message of its own before yours; send the text alone (the default prompt applies) or as 'input' with "
            "'prompt_name'",
            "invalid_value",
            "messages[0]",
        )
    return _text(turns[-1]), system


def _misfit(turns: Sequence[Turn]) -> str:
    """The first message out of the shape a text model takes, or the count of user messages."""
    for turn in turns:
        if turn.role not in ("system", "user"):
            return f"'{turn.name}' has the role {turn.role!r}"
    for turn in turns[1:]:
        if turn.role == "system":
            return f"'{turn.name}' is a system message after the first message"
    users = sum(turn.role == "user" for turn in turns)
    return f"'messages' holds {users} user messages"


def _text(turn: Turn) -> str:
    """A message's one text; an image or several texts refused."""
    if turn.images:
        raise InvalidRequest(f"'{turn.images[0]}' is an image: this model embeds texts only", "invalid_value",
                             turn.images[0])  # fmt: skip
    if len(turn.texts) != 1:
        raise InvalidRequest(
            f"'{turn.name}.content' holds {len(turn.texts)} text parts; {_SHAPE}, each one text",
            "invalid_value",
            f"{turn.name}.content",
        )
    return turn.texts[0]
