"""Jobs about text rather than vectors, which several APIs expose in their own shapes: tokenizing (TEI's and vLLM's
/tokenize), decoding token ids (TEI's /decode, vLLM's /detokenize), and the cosine similarities of TEI's
/similarity."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from bouquet.gateway.errors import InvalidRequest

if TYPE_CHECKING:
    from bouquet.gateway.replicas.catalog import ServedModel
    from bouquet.gateway.replicas.tokenization import TokenSpan
    from bouquet.gateway.service import Service


async def tokenize(
    service: Service, model: ServedModel, texts: list[str], prompt: str, add_special: bool
) -> list[list[TokenSpan]]:
    """Each text's tokens (`{"id", "text", "special", "start", "stop"}`) after `prompt`, under the limits /embed
    has: a reply is larger than its request."""
    service.check_inputs(len(texts))
    tokens = await model.require_tokenizer().tokens(texts, prompt, add_special)
    service.check_tokens(sum(map(len, tokens)))
    return tokens


async def decode(
    service: Service,
    model_name: str | None,
    sequences: list[list[int]],
    skip_special: bool,
    param: str,
    indexed: bool = True,
) -> list[str]:
    """One string per sequence of token ids; an id outside the vocabulary is refused, naming `param` (with the
    sequence's index where the request gave a list of them)."""
    model = service.catalog.get(model_name)
    for index, sequence in enumerate(sequences):
        if any(not 0 <= i < model.vocab_size for i in sequence):
            where = f"'{param}[{index}]'" if indexed else f"'{param}'"
            raise InvalidRequest(f"{where} holds an id outside the vocabulary", "invalid_token_id", param)
    service.check_inputs(len(sequences))
    service.check_tokens(sum(map(len, sequences)))
    return await model.require_tokenizer().decode(sequences, skip_special)


def similarities(rows: np.ndarray) -> list[float]:
    """Cosine of the first row with each other row."""
    unit = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    return [float(value) for value in unit[1:] @ unit[0]]
