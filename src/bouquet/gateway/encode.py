"""bge-m3's three outputs in one request (`POST /encode`, gateway/api/flag_embedding.py): each text's dense
embedding, lexical weights and ColBERT vectors from one forward on a replica (bouquet/all_outputs.py).

A text is tokenized to the model's limit (or the request's `max_length`) and sent with a span of one token for every
token but the first, its [CLS], which has no ColBERT vector in FlagEmbedding's M3 and whose id it never weights.
The replica answers the pooled rows, the sparse rows (only their nonzero weights) and, when asked, the token vectors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bouquet.all_outputs import AllOutputs
from bouquet.batch import Batch, RowOptions
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.jobs import EncodeJob
from bouquet.gateway.late_interaction import check_vectors

if TYPE_CHECKING:
    from bouquet.gateway.replicas.catalog import ServedModel
    from bouquet.gateway.service import Service

SPECIAL_TOKENS = 4  # at most, around one text


def encode_model(service: Service, job: EncodeJob) -> ServedModel:
    """The model, which must have every head the job asks for: a 400 naming the missing one otherwise."""
    model = service.catalog.get(job.model)
    if model.task != "embed" or not model.sparse_dimension:
        raise model.wrong_task("bge-m3's outputs (a dense model with sparse_linear.pt beside it)")
    if job.colbert and model.multi_vector is None:
        raise InvalidRequest(
            f"the model {model.id!r} has no ColBERT vectors (bge-m3's colbert_linear.pt): return_colbert_vecs needs "
            "them",
            "wrong_task",
            "return_colbert_vecs",
        )
    if not (job.dense or job.sparse or job.colbert):
        message = "ask for one output or more: return_dense, return_sparse, return_colbert_vecs"
        raise InvalidRequest(message, "invalid_value", "return_dense")
    return model


async def encode(service: Service, job: EncodeJob) -> tuple[ServedModel, AllOutputs, int]:
    """The texts' outputs (token vectors only when asked), and the tokens computed."""
    model = encode_model(service, job)
    service.check_inputs(len(job.texts))
    limit = _limit(job.max_length, model)

    async def batch() -> Batch:
        ids = await model.require_tokenizer().encode(job.texts, "", True, "right", limit)
        spans = [[(i, i + 1) for i in range(1, len(sequence))] for sequence in ids]
        if job.colbert:
            check_vectors(sum(map(len, spans)), service.config.max_token_vectors, "sentences")
        options = RowOptions(normalize=True, token_vectors=job.colbert, all_outputs=True)
        return Batch.pack(ids, options, spans=spans)

    estimate = sum(min(len(text.encode()) + SPECIAL_TOKENS, limit) for text in job.texts)
    outputs, tokens = await service.compute(model, estimate, batch)
    return model, outputs, tokens


def _limit(max_length: int | None, model: ServedModel) -> int:
    if max_length is None:
        return model.max_seq_length
    if max_length < 2:  # the [CLS] and one token with a vector
        raise InvalidRequest(f"max_length must be 2 or more, got {max_length}", "invalid_value", "max_length")
    return min(max_length, model.max_seq_length)
