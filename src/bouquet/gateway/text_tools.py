"""Requests about text rather than vectors, shaped as the servers people switch from take them: TEI's
`/tokenize` (`inputs`) and vLLM's (`prompt`), TEI's `/decode`, and TEI's `/similarity` (one source sentence
against others, cosine of their embeddings)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from bouquet.gateway.errors import InvalidRequest, Unprocessable
from bouquet.gateway.schemas import EmbedJob, optional_field, refuse_unknown, truncation_direction

if TYPE_CHECKING:
    from bouquet.gateway.app import Gateway

TEI_TOKENIZE_FIELDS = frozenset({"inputs", "add_special_tokens", "prompt_name", "model"})
_VLLM_TOKENIZE_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_VLLM_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
_DECODE_FIELDS = frozenset({"ids", "skip_special_tokens", "model"})
_SIMILARITY_FIELDS = frozenset({"inputs", "parameters", "model"})
_SIMILARITY_PARAMETERS = frozenset({"truncate", "truncation_direction", "prompt_name"})


async def vllm_tokenize(gateway: Gateway, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's /tokenize: `{"prompt"}` -> `{"count", "max_model_len", "tokens", "token_strs"}`."""
    if not gateway.config.allow_unknown_fields:
        refuse_unknown(body, _VLLM_TOKENIZE_FIELDS)
    prompt = optional_field(body, "prompt", str)
    if not prompt:
        raise InvalidRequest("'prompt' is required and must not be empty", "empty_input", "prompt")
    model = gateway.catalog.get(optional_field(body, "model", str))
    add_special = optional_field(body, "add_special_tokens", bool)
    tokenizer = model.require_tokenizer()
    tokens = [token["id"] for token in (await tokenizer.tokens([prompt], "", add_special is not False))[0]]
    # the vocabulary's token strings (HF's convert_ids_to_tokens), not TEI's spans of the text
    strings = tokenizer.token_strings(tokens) if optional_field(body, "return_token_strs", bool) else None
    return {"count": len(tokens), "max_model_len": model.max_seq_length, "tokens": tokens, "token_strs": strings}


async def vllm_detokenize(gateway: Gateway, body: dict[str, Any]) -> dict[str, str]:
    """vLLM's /detokenize: `{"model", "tokens"}` -> `{"prompt"}`, special tokens kept as HF's decode keeps them."""
    if not gateway.config.allow_unknown_fields:
        refuse_unknown(body, _VLLM_DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if tokens is None:
        raise InvalidRequest("'tokens' is required", "missing_required_parameter", "tokens")
    if not isinstance(tokens, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in tokens):
        raise Unprocessable("'tokens' must be a list of token ids", "invalid_type", "tokens")
    model = gateway.catalog.get(optional_field(body, "model", str))
    if any(not 0 <= i < model.vocab_size for i in tokens):
        raise InvalidRequest("'tokens' holds an id outside the vocabulary", "invalid_token_id", "tokens")
    gateway.check_tokens(len(tokens))
    return {"prompt": (await model.require_tokenizer().decode([tokens], False))[0]}


async def decode(gateway: Gateway, body: dict[str, Any]) -> list[str]:
    """TEI's /decode: `{"ids": [...] | [[...], ...], "skip_special_tokens"}` -> one string per sequence."""
    if not gateway.config.allow_unknown_fields:
        refuse_unknown(body, _DECODE_FIELDS)
    ids = body.get("ids")
    if ids is None:
        raise InvalidRequest("'ids' is required", "missing_required_parameter", "ids")
    batch = ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else [ids]
    model = gateway.catalog.get(optional_field(body, "model", str))
    for index, sequence in enumerate(batch):
        if not isinstance(sequence, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in sequence):
            raise Unprocessable(f"'ids[{index}]' must be a list of token ids", "invalid_type", "ids")
        if any(not 0 <= i < model.vocab_size for i in sequence):
            raise InvalidRequest(f"'ids[{index}]' holds an id outside the vocabulary", "invalid_token_id", "ids")
    gateway.check_inputs(len(batch))
    skip = optional_field(body, "skip_special_tokens", bool)
    return await model.require_tokenizer().decode(batch, skip is not False)


def parse_similarity(body: dict[str, Any], strict: bool = True) -> EmbedJob:
    """TEI's /similarity: `{"inputs": {"source_sentence", "sentences"}, "parameters": {...}}` as one embedding job,
    the source first, rows not normalised (the cosine does that)."""
    if strict:
        refuse_unknown(body, _SIMILARITY_FIELDS)
    inputs = body.get("inputs")
    if not isinstance(inputs, dict):
        raise Unprocessable("'inputs' must be an object with source_sentence and sentences", "invalid_type", "inputs")
    source, sentences = inputs.get("source_sentence"), inputs.get("sentences")
    if not isinstance(source, str) or not isinstance(sentences, list):
        raise Unprocessable("'inputs' needs a string source_sentence and a list of sentences", "invalid_type", "inputs")
    if not sentences or not source or not all(isinstance(s, str) and s for s in sentences):
        raise InvalidRequest("'inputs.sentences' cannot be empty, nor hold an empty string", "empty_input", "inputs")
    parameters = {} if body.get("parameters") is None else body["parameters"]  # false, 0 or "" are no object
    if not isinstance(parameters, dict):
        raise Unprocessable("'parameters' must be an object", "invalid_type", "parameters")
    if strict:
        refuse_unknown(parameters, _SIMILARITY_PARAMETERS)
    truncate = optional_field(parameters, "truncate", bool)
    return EmbedJob(
        model=optional_field(body, "model", str),
        texts=[source, *sentences],
        token_ids=None,
        normalize=False,
        truncate=True if truncate is None else truncate,
        truncation_direction=truncation_direction(parameters),
        prompt_name=optional_field(parameters, "prompt_name", str),
    )


def similarities(rows: np.ndarray) -> list[float]:
    """Cosine of the first row with each other row."""
    unit = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    return [float(value) for value in unit[1:] @ unit[0]]
