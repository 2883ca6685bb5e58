"""Text to token ids for one model, with Hugging Face `tokenizers` batch encoding on a thread pool so the
event loop keeps serving while a large request is encoded."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any, TypedDict

from bouquet.chat_templates import TemplateError
from bouquet.gateway.errors import InvalidRequest, TooLarge
from bouquet.pair_templates import PairTemplate
from bouquet.text_messages import Text, TextMessages
from bouquet.tokenizer import (
    TRUNCATION_DIRECTIONS,
    TemplatePairTokenizer,
    TextTokenizer,
    TokenizerSource,
    load_tokenizer,
    prompt_token_count,
)

# Characters of an input read at most: a text is cut to this many characters per token of the model's limit
# before it is tokenized, since truncation would throw the rest away. Tokenizing a multi-megabyte string only to
# keep its first 256 tokens cost the gateway gigabytes and stalled every other request. Real tokens average 3-6
# characters; only a text whose first `limit` tokens span more (a run of thousands of spaces, which BERT-style
# tokenizers drop) is read differently than a whole-text tokenization would.
CHARS_PER_TOKEN = 64
_SHORTER_KEPT = 16  # tokenizers kept for requests' own shorter limits (truncate_prompt_tokens)
# Requests of at most this many characters are tokenized on the event loop: a query's few tokens take the Rust
# tokenizer tens of microseconds, less than the hop to a thread and back costs (docs/benchmarks.md).
INLINE_CHARS = 2048


class TokenSpan(TypedDict):
    """One token as TEI's /tokenize answers it: its id, its text (a special token's own string), and its span of
    characters in the text (null for a special token)."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class ModelTokenizer:
    """Truncates to the model's limit from either side, or rejects an over-long input when told not to."""

    def __init__(
        self, tokenizer: TokenizerSource, max_length: int, executor: Executor,
        pair_template: PairTemplate | None = None, messages: TextMessages | None = None,
    ):  # fmt: skip
        self.max_length = max_length
        self.messages = messages  # a text model whose texts are conversations (text_messages.py); None: texts as sent
        self.max_chars = CHARS_PER_TOKEN * max_length
        self._executor = executor
        self._plain = load_tokenizer(tokenizer)  # for /tokenize: offsets, no truncation
        self._by_direction = {d: TextTokenizer(self._plain, max_length, d) for d in TRUNCATION_DIRECTIONS}
        self._plain.no_padding()
        self._plain.no_truncation()
        # A decoder reranker's pairs go through its prompt template; an encoder's through the tokenizer's own.
        self._templated: TemplatePairTokenizer | None = None
        if pair_template is not None:
            self._templated = TemplatePairTokenizer(self._plain, pair_template, max_length)
        self._prompt_tokens: dict[str, int] = {}
        self._shorter_tokenizers: dict[tuple[int, str], TextTokenizer] = {}
        self._frames: dict[str, tuple[list[int], list[int]]] = {}

    def prompt_tokens(self, prompt: str) -> int:
        """The leading tokens of `prompt + text` that are the prompt's (sentence-transformers' count); none where the
        prompt is a system message, which sentence-transformers never leaves out of the pooling."""
        if self.messages is not None:
            return 0
        if prompt not in self._prompt_tokens:
            self._prompt_tokens[prompt] = prompt_token_count(self._plain, prompt)
        return self._prompt_tokens[prompt]

    async def encode(
        self, texts: list[str], prompt: str, truncate: bool, direction: str, max_length: int | None = None
    ) -> list[list[int]]:
        """Token ids per text; `max_length` (under the model's limit) truncates shorter, as vLLM's
        truncate_prompt_tokens does (special tokens kept)."""
        texts = self._capped(texts, truncate, direction == "left")
        if self.messages is not None:
            return await self._encode_messages(self.messages, texts, prompt, truncate, direction, max_length)
        if prompt:
            texts = [prompt + text for text in texts]
        tokenizer = self._by_direction[direction]
        if max_length is not None and max_length < self.max_length:
            tokenizer = self._shorter(max_length, direction)
        if sum(map(len, texts)) <= INLINE_CHARS:
            return self._encode(tokenizer, texts, truncate)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._encode, tokenizer, texts, truncate)

    async def _encode_messages(
        self, messages: TextMessages, texts: Sequence[Text], prompt: str, truncate: bool, direction: str = "right",
        max_length: int | None = None,
    ) -> list[list[int]]:  # fmt: skip
        """Each text (or pair) rendered as a conversation, then tokenized and cut as sentence-transformers does."""
        limit = min(max_length or self.max_length, self.max_length) if truncate else None
        loop = asyncio.get_running_loop()
        try:
            sequences = await loop.run_in_executor(
                self._executor, messages.encode, texts, prompt, self._ids, limit, direction == "left"
            )
        except TemplateError as error:
            raise InvalidRequest(str(error), "invalid_value", "input") from None
        if not truncate:
            self._check_lengths(sequences)
        return sequences

    def _ids(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._plain.encode_batch(texts, add_special_tokens=False)]

    def _shorter(self, max_length: int, direction: str) -> TextTokenizer:
        key = (max_length, direction)
        if key not in self._shorter_tokenizers:
            if len(self._shorter_tokenizers) >= _SHORTER_KEPT:
                self._shorter_tokenizers.pop(next(iter(self._shorter_tokenizers)))
            self._shorter_tokenizers[key] = TextTokenizer(self._plain, max_length, direction)
        return self._shorter_tokenizers[key]

    def _encode(self, tokenizer: TextTokenizer, texts: list[str], truncate: bool) -> list[list[int]]:
        sequences = tokenizer.encode(texts, truncate=truncate)
        if not truncate:
            self._check_lengths(sequences)
        return sequences

    async def encode_pairs(
        self, pairs: list[tuple[str, str]], truncate: bool, instruction: str | None = None
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        """(ids, token types or None where the model has none) per (query, passage) pair, for a cross-encoder;
        `instruction` only for a model with a pair template (None: the template's default)."""
        queries = self._capped([query for query, _ in pairs], truncate, from_left=False)
        passages = self._capped([passage for _, passage in pairs], truncate, from_left=False)
        pairs = list(zip(queries, passages, strict=True))
        if self.messages is not None:
            return await self._encode_message_pairs(self.messages, pairs, truncate, instruction or ""), None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._encode_pairs, pairs, truncate, instruction)

    async def _encode_message_pairs(
        self, messages: TextMessages, pairs: list[tuple[str, str]], truncate: bool, prompt: str
    ) -> list[list[int]]:
        """A cross-encoder whose inputs are conversations: each pair a query and a document message (the
        instruction a system message), as sentence-transformers 6 renders them; refused, as it refuses them, where
        the chat template drops either."""
        if (failure := messages.pair_failure()) is not None:
            raise InvalidRequest(
                f"this model's chat template cannot carry a (query, document) pair ({failure}): sentence-transformers "
                "renders a pair as a 'query' and a 'document' message and refuses it too",
                "invalid_value",
                "model",
            )
        return await self._encode_messages(messages, pairs, prompt, truncate)

    def _encode_pairs(
        self, pairs: list[tuple[str, str]], truncate: bool, instruction: str | None
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        if self._templated is not None:
            ids, types = self._templated.encode_pairs(pairs, truncate, instruction), None
        else:
            ids, types = self._by_direction["right"].encode_pairs(pairs, truncate=truncate)
        if not truncate:
            self._check_lengths(ids)
        return ids, types

    def _capped(self, texts: list[str], truncate: bool, from_left: bool) -> list[str]:
        """Each text cut to `max_chars` when it will be truncated anyway; refused over it when not."""
        limit = self.max_chars
        if truncate:
            return [text if len(text) <= limit else text[-limit:] if from_left else text[:limit] for text in texts]
        for index, text in enumerate(texts):
            if len(text) > limit:
                raise TooLarge(
                    f"input {index} has {len(text)} characters, over the {limit} this model reads without "
                    f"truncation ({CHARS_PER_TOKEN} a token of its limit of {self.max_length}); shorten it or send "
                    "truncate=true",
                    "input_too_long",
                    "inputs",
                )
        return texts

    def _check_lengths(self, sequences: list[list[int]]) -> None:
        for index, sequence in enumerate(sequences):
            if len(sequence) > self.max_length:
                raise TooLarge(
                    f"input {index} has {len(sequence)} tokens, over this model's limit of {self.max_length}; "
                    "shorten it or send truncate=true",
                    "input_too_long",
                    "inputs",
                )

    async def tokens(self, texts: list[str], prompt: str, add_special_tokens: bool) -> list[list[TokenSpan]]:
        """TEI's /tokenize: every token with its id, text, whether it is special, and its character span. A model
        whose texts are conversations answers each conversation's tokens as it embeds them (untruncated), its spans
        in the rendered conversation: the tokenizer's own special tokens are never added to one."""
        texts = self._capped(texts, truncate=False, from_left=False)
        if self.messages is not None:
            _check_special_tokens(add_special_tokens)
        elif prompt:
            texts = [prompt + text for text in texts]
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._tokens, texts, prompt, add_special_tokens)
        except TemplateError as error:
            raise InvalidRequest(str(error), "invalid_value", "input") from None

    def _tokens(self, texts: list[str], prompt: str, add_special_tokens: bool) -> list[list[TokenSpan]]:
        """On the executor: a template's render and a dict per token are Python work, as long as the texts are."""
        if self.messages is not None:
            texts, add_special_tokens = [self.messages.render(text, prompt) for text in texts], False
        encodings = self._plain.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [_describe(text, encoding) for text, encoding in zip(texts, encodings, strict=True)]

    async def encode_text_only(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text without special tokens and untruncated (the text between a window's frame)."""
        loop = asyncio.get_running_loop()
        encodings = await loop.run_in_executor(
            self._executor, lambda: self._plain.encode_batch(texts, add_special_tokens=False)
        )
        return [encoding.ids for encoding in encodings]

    def frame(self, prompt: str) -> tuple[list[int], list[int]]:
        """The ids a window puts before and after its text: the model's special tokens as its post-processor
        places them around one text ([CLS] ... [SEP], or an EOS after), the prompt's tokens after the leading ones;
        for a model whose texts are conversations, the conversation's around its user text (text_messages.py)."""
        if self.messages is not None:
            return self.messages.frame(prompt, self._ids)
        if prompt not in self._frames:
            encoding = self._plain.encode("x")
            text = [i for i, special in enumerate(encoding.special_tokens_mask) if not special]
            ids = encoding.ids
            prompt_ids = self._plain.encode(prompt, add_special_tokens=False).ids if prompt else []
            self._frames[prompt] = ([*ids[: text[0]], *prompt_ids], ids[text[-1] + 1 :])
        return self._frames[prompt]

    def token_strings(self, ids: list[int]) -> list[str | None]:
        """The vocabulary's string of each id (Hugging Face's convert_ids_to_tokens)."""
        return [self._plain.id_to_token(i) for i in ids]

    async def decode(self, sequences: list[list[int]], skip_special_tokens: bool) -> list[str]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, lambda: self._plain.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
        )


def _check_special_tokens(add_special_tokens: bool) -> None:
    """A conversation's tokens are its template's and its texts' together: none of them are the tokenizer's to
    leave out, so a count without them would describe a sequence the model never embeds."""
    if not add_special_tokens:
        raise InvalidRequest(
            "this model embeds each text as a chat conversation (its sentence-transformers Transformer takes "
            "messages): its tokens are the rendered conversation's, template included, and the tokenizer's own "
            "special tokens are never added, so add_special_tokens=false describes nothing it embeds; send "
            "add_special_tokens=true (the default)",
            "unsupported_parameter",
            "add_special_tokens",
        )


def _describe(text: str, encoding: Any) -> list[TokenSpan]:
    return [
        {"id": token_id, "text": text[start:stop] if not special else token, "special": bool(special),
         "start": start if not special else None, "stop": stop if not special else None}
        for token_id, token, special, (start, stop) in zip(
            encoding.ids, encoding.tokens, encoding.special_tokens_mask, encoding.offsets, strict=True
        )
    ]  # fmt: skip
