"""Text to token ids with Hugging Face `tokenizers` (`Batch.pack` lays them end to end); no torch, so the gateway
can use it."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, normalizers

from bouquet.pair_templates import PairTemplate
from bouquet.sentencepiece_tokenizer import siglip_tokenizer
from bouquet.tokenizer_class import SPIECE_FILE

TRUNCATION_DIRECTIONS = ("right", "left")


# A tokenizer.json file's path, its JSON text (as a replica's Info sends it), or a loaded tokenizer.
TokenizerSource = str | Path | Tokenizer


def load_tokenizer(source: TokenizerSource) -> Tokenizer:
    """A tokenizer of its own (the caller may change its padding and truncation) from any TokenizerSource."""
    if isinstance(source, Tokenizer):
        return Tokenizer.from_str(source.to_str())
    if isinstance(source, str) and source.lstrip().startswith("{"):  # JSON text: no file path starts with "{"
        return Tokenizer.from_str(source)
    return Tokenizer.from_file(str(source))


def tokenizer_json(path: Path, lowercase: bool = False) -> str:
    """A model's tokenizer.json text (a SigLIP's spiece.model rebuilt as one: sentencepiece_tokenizer.py); with
    `lowercase` (sentence_bert_config.json's do_lower_case, or a tokenizer class that lowercases: tokenizer_class.py),
    a Lowercase normaliser put first unless it has one, as sentence-transformers and that class do."""
    text = siglip_tokenizer(path).to_str() if path.name == SPIECE_FILE else path.read_text(encoding="utf-8")
    if not lowercase:
        return text
    tokenizer = Tokenizer.from_str(text)
    current = tokenizer.normalizer
    parts = list(current) if isinstance(current, normalizers.Sequence) else [] if current is None else [current]
    if not any(isinstance(part, normalizers.Lowercase) for part in parts):
        tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase(), *parts])
    return tokenizer.to_str()


def prompt_token_count(tokenizer: Tokenizer, prompt: str) -> int:
    """How many leading tokens of `prompt + text` sentence-transformers counts as the prompt's: the prompt
    encoded alone with special tokens, less a trailing special token (a [SEP] or EOS the text will follow)."""
    if not prompt:
        return 0
    ids = tokenizer.encode(prompt).ids
    specials = {token_id for token_id, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    return len(ids) - (1 if ids and ids[-1] in specials else 0)


class TextTokenizer:
    """A model's tokenizer with its export-time padding removed and truncation set to the model's limit."""

    def __init__(self, tokenizer: TokenizerSource, max_length: int, truncation_direction: str = "right"):
        if truncation_direction not in TRUNCATION_DIRECTIONS:
            raise ValueError(
                f"truncation_direction must be one of {TRUNCATION_DIRECTIONS}, got {truncation_direction!r}"
            )
        self.max_length = max_length
        self._tokenizer = load_tokenizer(tokenizer)
        # Exported tokenizer.json files often carry fixed padding (all-MiniLM-L6-v2 pads to 128); packed
        # batches must never see a pad token.
        self._tokenizer.no_padding()
        self._truncating = Tokenizer.from_str(self._tokenizer.to_str())
        self._truncating.enable_truncation(max_length, direction=truncation_direction)
        self._tokenizer.no_truncation()

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: list[str], truncate: bool = True) -> list[list[int]]:
        """Token ids per text, special tokens included; `truncate=False` keeps over-long sequences whole."""
        tokenizer = self._truncating if truncate else self._tokenizer
        if len(texts) == 1:  # a lone query: encode_batch would hand it to its thread pool and wait for it there
            return [tokenizer.encode(texts[0]).ids]
        return [encoding.ids for encoding in tokenizer.encode_batch(texts)]

    def encode_prompted(self, texts: list[str], prompt: str) -> list[list[int]]:
        """Token ids per text with `prompt` before it, truncated (sentence-transformers' prompt)."""
        return self.encode([prompt + text for text in texts] if prompt else texts)

    def encode_pairs(
        self, pairs: list[tuple[str, str]], truncate: bool = True
    ) -> tuple[list[list[int]], list[list[int]]]:
        """(token ids, token types) per (query, passage) pair as the model's tokenizer pairs them ([CLS] q [SEP] p
        [SEP], types 0 then 1 for BERT); over the limit, the longer part is cut first, as a CrossEncoder's
        tokenizer call does."""
        tokenizer = self._truncating if truncate else self._tokenizer
        encodings = tokenizer.encode_batch(pairs)
        return [e.ids for e in encodings], [e.type_ids for e in encodings]

    def prompt_tokens(self, prompt: str) -> int:
        return prompt_token_count(self._tokenizer, prompt)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


class TemplatePairTokenizer:
    """(query, document) pairs read through a decoder reranker's prompt template (pair_templates.py), as its model
    card tokenizes them: the prefix's ids, the body's (the tokenizer's own special tokens, if any, included), cut
    from its end to fit the model's limit, then the suffix's."""

    def __init__(self, tokenizer: TokenizerSource, template: PairTemplate, max_length: int):
        base = load_tokenizer(tokenizer)
        base.no_padding()
        base.no_truncation()
        self.template = template
        self.prefix = base.encode(template.prefix, add_special_tokens=False).ids
        self.suffix = base.encode(template.suffix, add_special_tokens=False).ids
        room = max_length - len(self.prefix) - len(self.suffix)
        if room < 1:
            raise ValueError(f"a limit of {max_length} tokens leaves no room inside the model's pair template")
        self._body = TextTokenizer(base, room)

    def encode_pairs(
        self, pairs: list[tuple[str, str]], truncate: bool = True, instruction: str | None = None
    ) -> list[list[int]]:
        """Token ids per pair; `instruction` None: the template's default."""
        bodies = self._body.encode([self.template.format(q, d, instruction) for q, d in pairs], truncate=truncate)
        return [self.prefix + body + self.suffix for body in bodies]
