"""SigLIP's sentencepiece tokenizer (transformers' SiglipTokenizer over a directory's `spiece.model`, which released
SigLIP checkpoints ship without a tokenizer.json) rebuilt as a Hugging Face `tokenizers` Tokenizer, so the gateway
tokenizes it as it tokenizes every other model: in Rust, in batches, without sentencepiece's runtime on the request
path. sentencepiece's own protobuf module reads the file; nothing here imports torch.

Why a rebuild rather than transformers' slow-to-fast converter: transformers ships no fast SigLIP tokenizer (nothing
converts SiglipTokenizer), transformers is no runtime dependency, and the steps SiglipTokenizer takes around
sentencepiece have to be spelled out anyway. What SiglipTokenizer does to a text (transformers 5.25,
models/siglip/tokenization_siglip.py), each step mirrored by one normaliser below:
- puts "▁" in front of the text, after turning any "▁" in it into a space;
- canonicalises it as big_vision did: lowercased as Python lowercases (`do_lower_case`, true unless
  tokenizer_config.json says not; a word's last capital sigma becomes "ς"),
  ASCII punctuation (`string.punctuation`) removed, every run of whitespace (Python's `\\s`) made one space,
  stripped (only its end can be: the "▁" comes first);
- has sentencepiece encode "<unk>" + that text and drops the pieces of "<unk>": so the text's pieces are those of
  sentencepiece's normalisation (the model's precompiled character map, then runs of spaces made one and the end
  stripped; a model that keeps them, `remove_extra_whitespaces` false, is refused) and its unigram model (with byte
  fallback where the model has it), words split at "▁" as its pieces never span one;
- appends EOS.
Checked token for token against SiglipTokenizer in tests/test_siglip_tokenizer.py. Known differences, none in
ordinary text: a text holding a special token's string itself ("</s>", "<unk>"): both split the token out, but
SiglipTokenizer gives the text after it no leading "▁", and no EOS after a final "</s>"; `tokenizers`' Precompiled,
as in every `tokenizers` conversion of a sentencepiece model, maps a short grapheme by the shortest entry that starts
it and drops the rest, and a long one character by character, where sentencepiece takes the longest entry at each
position: a combining mark after a character the map rewrites ("ﬁ" + U+0301, an Arabic presentation form with its
vowel mark), a letter with two marks in decomposed form (Vietnamese in NFD), halfwidth kana with its voicing mark
("ｶﾞ") come out otherwise; and a control piece's name spelled in forms the map turns into it ("＜s＞"), which
sentencepiece never matches and the unigram model here does.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from sentencepiece import sentencepiece_model_pb2
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from bouquet.st_layout import read_optional_json

_UNIGRAM = 1  # TrainerSpec.model_type
_USER_DEFINED = 4  # SentencePiece.type
# SiglipTokenizer's defaults (its __init__) where tokenizer_config.json names no token.
_DEFAULT_TOKENS = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}


def siglip_tokenizer(spiece: Path) -> Tokenizer:
    """SiglipTokenizer over `spiece` (with the tokenizer_config.json beside it) as a `tokenizers` Tokenizer."""
    proto = sentencepiece_model_pb2.ModelProto.FromString(spiece.read_bytes())
    _check_supported(spiece, proto)
    config = read_optional_json(spiece.parent / "tokenizer_config.json") or {}
    tokenizer = Tokenizer(_unigram(proto))
    tokenizer.normalizer = _normalizer(proto.normalizer_spec, bool(config.get("do_lower_case", True)))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    _add_special_tokens(tokenizer, config, spiece)
    eos = _token(config, "eos_token")
    eos_id = tokenizer.token_to_id(eos)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, eos_id)]
    )
    return tokenizer


def _check_supported(spiece: Path, proto: Any) -> None:
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type != _UNIGRAM:
        raise ValueError(f"{spiece}: only sentencepiece's unigram models are read, not type {trainer.model_type}")
    if trainer.treat_whitespace_as_suffix or not normalizer.escape_whitespaces:
        raise ValueError(f"{spiece}: a model that puts '▁' after words, or keeps spaces as they are, is not read")
    if not normalizer.remove_extra_whitespaces:  # SiglipTokenizer then gives a blank text a "▁"; tokenizers cannot
        raise ValueError(f"{spiece}: a model that keeps extra whitespace (remove_extra_whitespaces false) is not read")
    user_defined = [piece.piece for piece in proto.pieces if piece.type == _USER_DEFINED]
    if user_defined:
        raise ValueError(f"{spiece}: user-defined pieces ({user_defined[:3]}...) are not read")


def _unigram(proto: Any) -> models.Unigram:
    """The pieces and their scores at sentencepiece's ids."""
    vocab = [(piece.piece, piece.score) for piece in proto.pieces]
    return models.Unigram(vocab, unk_id=proto.trainer_spec.unk_id, byte_fallback=proto.trainer_spec.byte_fallback)


def _normalizer(spec: Any, lowercase: bool) -> normalizers.Normalizer:
    punctuation = "".join(f"\\x{ord(c):02x}" for c in string.punctuation)
    whitespace = "".join(f"\\x{{{c:x}}}" for c in range(0x110000) if chr(c).isspace())  # what Python's \\s matches
    steps: list[normalizers.Normalizer] = _lowercase() if lowercase else []
    steps += [
        normalizers.Replace("▁", " "),
        normalizers.Replace(Regex(f"[{punctuation}]"), ""),
        normalizers.Replace(Regex(f"[{whitespace}]+"), " "),
        normalizers.Replace(Regex(" $"), ""),
        normalizers.Prepend("▁"),
    ]
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    # sentencepiece's whitespace removal, in a text that "<unk>" comes before: runs made one, the end stripped
    steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(" $"), "")]
    return normalizers.Sequence(steps)


def _lowercase() -> list[normalizers.Normalizer]:
    """Python's str.lower, which `Lowercase` (character by character) is but for its one rule with context: a capital
    sigma ending a word (a cased letter before it, none after it) becomes the final "ς"."""
    final_sigma = Regex(r"(?<=\p{Cased}\p{Case_Ignorable}*)Σ(?!\p{Case_Ignorable}*\p{Cased})")
    return [normalizers.Replace(final_sigma, "ς"), normalizers.Lowercase()]


def _token(config: dict[str, Any], key: str) -> str:
    token = config.get(key) or _DEFAULT_TOKENS[key]
    return str(token.get("content") if isinstance(token, dict) else token)


def _add_special_tokens(tokenizer: Tokenizer, config: dict[str, Any], spiece: Path) -> None:
    """The tokens SiglipTokenizer splits out of a text before anything else, matched on the raw text: those
    tokenizer_config.json lists at their ids (transformers 5 saves its special tokens there), then its special
    tokens by name (a name not in the vocabulary is added after it, as transformers adds it)."""
    listed = {int(token_id): token["content"] for token_id, token in (config.get("added_tokens_decoder") or {}).items()}
    for token_id, content in sorted(listed.items()):
        _add_special_token(tokenizer, content)
        if tokenizer.token_to_id(content) != token_id:
            raise ValueError(f"{spiece}: the added token {content!r} is not at id {token_id} in the vocabulary")
    for key in _DEFAULT_TOKENS:
        _add_special_token(tokenizer, _token(config, key))


def _add_special_token(tokenizer: Tokenizer, content: str) -> None:
    # lstrip and rstrip as SiglipTokenizer makes its own; they change nothing, as the text's ends are stripped anyway
    tokenizer.add_special_tokens([AddedToken(content, lstrip=True, rstrip=True, normalized=False, special=True)])
