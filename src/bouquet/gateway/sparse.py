"""TEI's `/embed_sparse`: each input's sparse row (a SPLADE model's, or bge-m3's sparse head's) as its nonzero
(vocabulary id, weight) pairs by ascending id. The replica sends only those pairs (replica/server.py), so a
30,000-wide row crosses the wire as the few hundred entries it holds."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.schemas import EmbedJob, parse_tei, refuse_unknown
from bouquet.sparse_rows import SparseRows

if TYPE_CHECKING:
    from bouquet.gateway.app import Gateway

EMBED_SPARSE_FIELDS = frozenset({"inputs", "truncate", "truncation_direction", "prompt_name", "model"})  # TEI's


def parse_embed_sparse(body: dict[str, Any], strict: bool = True) -> EmbedJob:
    if strict:
        refuse_unknown(body, EMBED_SPARSE_FIELDS)
    job = parse_tei({name: value for name, value in body.items() if name in EMBED_SPARSE_FIELDS}, strict=False)
    if job.text_positions is not None:
        message = "a batch mixing texts and token ids is not taken on /embed_sparse: send one kind a request"
        raise InvalidRequest(message, "unsupported_parameter", "inputs")
    return replace(job, sparse=True)


async def embed_sparse(gateway: Gateway, job: EmbedJob) -> list[list[dict[str, float | int]]]:
    """TEI's answer: per input, its entries `{"index", "value"}`."""
    _, rows, _ = await gateway.embed(job)
    assert isinstance(rows, SparseRows)
    return [_entries(*rows.row(index)) for index in range(rows.num_rows)]


def _entries(indices: Any, values: Any) -> list[dict[str, float | int]]:
    return [{"index": index, "value": value} for index, value in zip(indices.tolist(), values.tolist(), strict=True)]
