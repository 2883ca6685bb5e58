"""Scores from a cross-encoder or classifier, on the replicas: (query, document) pairs for reranking (TEI's
/rerank, Cohere's, Jina's and vLLM's /v1/rerank, vLLM's /score) and texts or pairs for TEI's /predict. Pairs are
chunked and balanced like an embedding batch; the model's activation (CrossEncoder's) is applied here unless the
client asks for raw scores. A decoder reranker (Qwen3-Reranker) reads each pair through its prompt template, with
the model's default instruction or the request's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from bouquet import all_outputs
from bouquet.batch import Batch, RowOptions
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.jobs import PredictJob, RerankJob
from bouquet.gateway.late_interaction import maxsim_scores
from bouquet.scoring import activate

if TYPE_CHECKING:
    from bouquet.gateway.replicas.catalog import ServedModel
    from bouquet.gateway.replicas.tokenization import ModelTokenizer
    from bouquet.gateway.service import Service


async def score(service: Service, job: RerankJob) -> tuple[ServedModel, np.ndarray, int]:
    """One score per pair ([N] float32), and the tokens computed: a cross-encoder's, or a ColBERT model's MaxSim."""
    model = score_model(service, job.model)
    if model.task == "multi_vector":
        if job.mode_weights is not None:
            raise unweighted(model)
        scores, tokens = await maxsim_scores(service, model, job)
        return model, scores[:, 0], tokens
    if model.task == "embed":  # bge-m3's three heads (score_model checked them)
        scores, tokens = await maxsim_scores(service, model, job, all_outputs=True)
        return model, all_outputs.weighted(scores, job.mode_weights)["colbert+sparse+dense"], tokens
    if job.mode_weights is not None:
        raise unweighted(model)
    service.check_inputs(len(job.pairs))
    instruction = pair_instruction(model, job.instruction)

    async def batch() -> Batch:
        ids, types = await model.require_tokenizer().encode_pairs(job.pairs, job.truncate, instruction)
        return Batch.pack(ids, RowOptions(normalize=False), types)

    logits, tokens = await service.compute(model, estimate_pairs(job.pairs, job.truncate, model, instruction), batch)
    scores = logits if job.raw_scores else activate(logits, model.score_activation)
    return model, scores[:, 0].astype(np.float32), tokens


async def mode_scores(
    service: Service, job: RerankJob, max_lengths: tuple[int | None, int | None]
) -> tuple[ServedModel, dict[str, np.ndarray], int]:
    """bge-m3's five scores of each pair, FlagEmbedding's `compute_score` (all_outputs.weighted), and the tokens
    computed; a model without bge-m3's three heads is refused."""
    model = service.catalog.get(job.model)
    if not three_heads(model):
        raise model.wrong_task("bge-m3's scores (a dense model with sparse_linear.pt and colbert_linear.pt beside it)")
    scores, tokens = await maxsim_scores(service, model, job, all_outputs=True, max_lengths=max_lengths)
    return model, all_outputs.weighted(scores, job.mode_weights), tokens


async def predict(service: Service, job: PredictJob) -> tuple[ServedModel, np.ndarray, int]:
    """Scores [N, labels] float32 (activated unless raw: a softmax over several labels, a sigmoid of one, as TEI
    does), and the tokens computed."""
    model = score_model(service, job.model, pairs_only=False)
    service.check_inputs(len(job.inputs))
    instruction = pair_instruction(model, job.instruction)
    if model.pair_template is not None and any(isinstance(sequence, str) for sequence in job.inputs):
        message = f"the model {model.id!r} is a reranker that reads (query, document) pairs; send pairs"
        raise InvalidRequest(message, "invalid_value", "inputs")

    async def batch() -> Batch:
        ids, types = await _encode_predict(model.require_tokenizer(), job, instruction)
        return Batch.pack(ids, RowOptions(normalize=False), types)

    logits, tokens = await service.compute(model, _estimate_predict(job, model, instruction), batch)
    if job.raw_scores:
        return model, logits.astype(np.float32), tokens
    return model, activate(logits, "Softmax" if logits.shape[1] > 1 else "Sigmoid").astype(np.float32), tokens


def score_model(service: Service, name: str | None, pairs_only: bool = True) -> ServedModel:
    """The model a scoring request names: a cross-encoder, or for pairs a ColBERT model (late interaction) or
    bge-m3 (its three heads); another embedding model is refused (TEI's 424 on its routes)."""
    model = service.catalog.get(name)
    if model.task != "score" and not (pairs_only and (model.task == "multi_vector" or three_heads(model))):
        raise model.wrong_task("scores; rerank with a cross-encoder")
    return model


def three_heads(model: ServedModel) -> bool:
    """Whether it gives bge-m3's three outputs: an embedding model with a token-weight sparse head (a sparse head
    beside dense rows is one: SPLADE's task is "sparse") and a multi-vector projection."""
    return model.task == "embed" and bool(model.sparse_dimension) and model.multi_vector is not None


def unweighted(model: ServedModel) -> InvalidRequest:
    message = f"the model {model.id!r} has no modes to weigh: weights_for_different_modes is bge-m3's"
    return InvalidRequest(message, "unsupported_parameter", "weights_for_different_modes")


def pair_instruction(model: ServedModel, instruction: str | None) -> str | None:
    """A decoder reranker's instruction: the request's, else the model's default prompt (sentence-transformers'
    CrossEncoder prompts are its instructions), else None (the template's own default). A conversation model's is
    its pairs' system message, as sentence-transformers writes a CrossEncoder's prompt."""
    if model.pair_template is None and not model.conversations:
        if instruction is not None:
            message = f"the model {model.id!r} has no instruction template: it pairs texts with its tokenizer"
            raise InvalidRequest(message, "unsupported_parameter", "instruction")
        return None
    return instruction if instruction is not None else model.prompt(None) or None


def estimate_pairs(pairs: list[tuple[str, str]], truncate: bool, model: ServedModel, instruction: str | None) -> int:
    """At least the tokens the pairs will take (a token is at least a byte), known before tokenizing."""
    template = model.pair_template
    if template is None:
        sizes = (len(query.encode()) + len(document.encode()) + 4 for query, document in pairs)
    else:
        fixed = len(template.prefix.encode()) + len(template.suffix.encode()) + 4
        sizes = (len(template.format(query, document, instruction).encode()) + fixed for query, document in pairs)
    return sum(min(size, model.max_seq_length) for size in sizes) if truncate else sum(sizes)


async def _encode_predict(
    tokenizer: ModelTokenizer, job: PredictJob, instruction: str | None
) -> tuple[list[list[int]], list[list[int]] | None]:
    """Token ids (and types, where the model has them) in the request's order; the pairs and the texts each
    tokenized in one call."""
    order = sorted(range(len(job.inputs)), key=lambda index: isinstance(job.inputs[index], str))  # pairs first
    pairs = [sequence for sequence in job.inputs if isinstance(sequence, tuple)]
    texts = [sequence for sequence in job.inputs if isinstance(sequence, str)]
    pair_ids, pair_types = await tokenizer.encode_pairs(pairs, job.truncate, instruction) if pairs else ([], None)
    text_ids = await tokenizer.encode(texts, instruction or "", job.truncate, job.truncation_direction) if texts else []
    ids, types = pair_ids + text_ids, None if pair_types is None else pair_types + [[0] * len(s) for s in text_ids]
    by_input = sorted(range(len(order)), key=order.__getitem__)  # the inverse of `order`
    return [ids[slot] for slot in by_input], None if types is None else [types[slot] for slot in by_input]


def _estimate_predict(job: PredictJob, model: ServedModel, instruction: str | None) -> int:
    pairs = [sequence for sequence in job.inputs if isinstance(sequence, tuple)]
    sizes = (len(text.encode()) + 4 for text in job.inputs if isinstance(text, str))
    texts = sum(min(size, model.max_seq_length) for size in sizes) if job.truncate else sum(sizes)
    return texts + estimate_pairs(pairs, job.truncate, model, instruction)
