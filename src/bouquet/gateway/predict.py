"""TEI's `/predict`: a classifier's (or cross-encoder's) scores for a text, a pair of texts, or a batch of either,
each answered as every label with its score, best first. As TEI does, the scores are a softmax over several labels
and a sigmoid of one, unless the client asks for raw scores; label names come from the model's `id2label`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from bouquet.batch import Batch, RowOptions
from bouquet.gateway.errors import InvalidRequest, Unprocessable
from bouquet.gateway.rerank import estimate_pairs, pair_instruction, score_model
from bouquet.gateway.schemas import optional_field, refuse_unknown
from bouquet.scoring import activate
from bouquet.tokenizer import TRUNCATION_DIRECTIONS

if TYPE_CHECKING:
    from bouquet.gateway.app import Gateway
    from bouquet.gateway.replicas.catalog import ServedModel
    from bouquet.gateway.replicas.tokenization import ModelTokenizer

_FIELDS = frozenset({"inputs", "truncate", "truncation_direction", "raw_scores", "model", "instruction"})
PredictInput = str | tuple[str, str]  # one text, or a (first, second) pair


@dataclass(frozen=True)
class PredictJob:
    model: str | None
    inputs: list[PredictInput]
    single: bool  # the body held one text or pair, not a batch: answered as one list, not a list of lists
    truncate: bool = True
    truncation_direction: str = "right"
    raw_scores: bool = False
    instruction: str | None = None


def parse_predict(body: dict[str, Any], strict: bool = True) -> PredictJob:
    """TEI's `inputs`: "text", ["text"], ["first", "second"] (a pair), or a batch [["text"], ["first", "second"]]."""
    if strict:
        refuse_unknown(body, _FIELDS)
    inputs, single = _inputs(body.get("inputs"))
    direction = str(optional_field(body, "truncation_direction", str) or "right").lower()
    if direction not in TRUNCATION_DIRECTIONS:
        message = f"truncation_direction must be one of {TRUNCATION_DIRECTIONS}, got {direction!r}"
        raise InvalidRequest(message, "invalid_value", "truncation_direction")
    if direction == "left" and any(isinstance(sequence, tuple) for sequence in inputs):
        message = "truncation_direction 'left' is not supported for pairs: the longer part is cut from its end"
        raise InvalidRequest(message, "unsupported_parameter", "truncation_direction")
    truncate = optional_field(body, "truncate", bool)
    return PredictJob(
        model=optional_field(body, "model", str),
        inputs=inputs,
        single=single,
        truncate=truncate is not False,
        truncation_direction=direction,
        raw_scores=bool(optional_field(body, "raw_scores", bool)),
        instruction=optional_field(body, "instruction", str),
    )


def _inputs(value: Any) -> tuple[list[PredictInput], bool]:
    if value is None:
        raise InvalidRequest("'inputs' is required", "missing_required_parameter", "inputs")
    if isinstance(value, str):
        return [_sequence([value], "inputs")], True
    if not isinstance(value, list):
        raise Unprocessable("'inputs' must be a string, a pair of strings or a list of them", "invalid_type", "inputs")
    if not value:
        raise InvalidRequest("'inputs' is an empty list", "empty_input", "inputs")
    if isinstance(value[0], str):
        return [_sequence(value, "inputs")], True
    return [_sequence(item, f"inputs[{index}]") for index, item in enumerate(value)], False


def _sequence(value: Any, name: str) -> PredictInput:
    """A list of one string (a text) or two (a pair)."""
    if not isinstance(value, list) or not 1 <= len(value) <= 2 or not all(isinstance(text, str) for text in value):
        raise Unprocessable(f"'{name}' must be a text or a pair: a list of one or two strings", "invalid_type", name)
    if not all(value):
        raise InvalidRequest(f"'{name}' holds an empty string", "empty_input", name)
    return value[0] if len(value) == 1 else (value[0], value[1])


async def predict(gateway: Gateway, job: PredictJob) -> tuple[ServedModel, np.ndarray, int]:
    """Scores [N, labels] float32 (activated unless raw), and the tokens computed."""
    model = score_model(gateway, job.model)
    gateway.check_inputs(len(job.inputs))
    instruction = pair_instruction(model, job.instruction)
    if model.pair_template is not None and any(isinstance(sequence, str) for sequence in job.inputs):
        message = f"the model {model.id!r} is a reranker that reads (query, document) pairs; send pairs"
        raise InvalidRequest(message, "invalid_value", "inputs")

    async def batch() -> Batch:
        ids, types = await _encode(model.require_tokenizer(), job, instruction)
        return Batch.pack(ids, RowOptions(normalize=False), types)

    logits, tokens = await gateway.compute(model, _estimate(job, model, instruction), batch)
    if job.raw_scores:
        return model, logits.astype(np.float32), tokens
    return model, activate(logits, "Softmax" if logits.shape[1] > 1 else "Sigmoid").astype(np.float32), tokens


async def _encode(
    tokenizer: ModelTokenizer, job: PredictJob, instruction: str | None
) -> tuple[list[list[int]], list[list[int]] | None]:
    """Token ids (and types, where the model has them) in the request's order; the pairs and the texts each
    tokenized in one call."""
    order = sorted(range(len(job.inputs)), key=lambda index: isinstance(job.inputs[index], str))  # pairs first
    pairs = [sequence for sequence in job.inputs if isinstance(sequence, tuple)]
    texts = [sequence for sequence in job.inputs if isinstance(sequence, str)]
    pair_ids, pair_types = await tokenizer.encode_pairs(pairs, job.truncate, instruction) if pairs else ([], None)
    text_ids = await tokenizer.encode(texts, "", job.truncate, job.truncation_direction) if texts else []
    ids, types = pair_ids + text_ids, None if pair_types is None else pair_types + [[0] * len(s) for s in text_ids]
    by_input = sorted(range(len(order)), key=order.__getitem__)  # the inverse of `order`
    return [ids[slot] for slot in by_input], None if types is None else [types[slot] for slot in by_input]


def _estimate(job: PredictJob, model: ServedModel, instruction: str | None) -> int:
    pairs = [sequence for sequence in job.inputs if isinstance(sequence, tuple)]
    sizes = (len(text.encode()) + 4 for text in job.inputs if isinstance(text, str))
    texts = sum(min(size, model.max_seq_length) for size in sizes) if job.truncate else sum(sizes)
    return texts + estimate_pairs(pairs, job.truncate, model, instruction)


def predict_response(scores: np.ndarray, job: PredictJob, model: ServedModel) -> list[Any]:
    """TEI's answer: per input, every label with its score, best first; one list for a single input."""
    answers = [
        [{"score": float(row[label]), "label": model.labels[label]} for label in np.argsort(-row, kind="stable")]
        for row in scores
    ]
    return answers[0] if job.single else answers
