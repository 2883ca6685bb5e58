"""The typed jobs between the API routers (gateway/api/) and the service (service.py): what a request asks for,
whichever API it came through, already checked against the request's own rules. What depends on the model (its
limits, task, prompts) is checked by the service."""

from __future__ import annotations

from dataclasses import dataclass

from bouquet.batch import RowOptions
from bouquet.encodings import FORMATS, ResponseFormat

AS_THE_MODEL = RowOptions(normalize=None)  # float32 rows at the model's full width, normalised as it says
TOKEN_VECTORS = RowOptions(token_vectors=True)  # float32 token vectors at the projection's width, normalised


@dataclass(frozen=True)
class EmbedJob:
    """One embedding request; exactly one of texts and token_ids is set, unless texts and token ids come mixed
    (then `text_positions` says where each text is in the input)."""

    model: str | None
    texts: list[str] | None
    token_ids: list[list[int]] | None
    # the rows' options as the wire will carry them (the router builds them; the service checks `dimensions` against
    # the model's width, resolves `normalize` None to the model's Normalize module and adds the prompt's tokens);
    # `sparse`: each input's sparse row (TEI's /embed_sparse), not its embedding; `encoding` is response_format's
    options: RowOptions = AS_THE_MODEL
    truncate: bool = True
    truncation_direction: str = "right"
    prompt_name: str | None = None
    prompt: str | None = None  # a literal prompt (vLLM's chat form's system message), over prompt_name and the default
    response_format: ResponseFormat = FORMATS["float"]  # encoding_format, embed_dtype and endianness
    # the request's own cap on an input's tokens, as the client sent it (vLLM's truncate_prompt_tokens, -1 for the
    # model's limit; Cohere's max_tokens), checked by the service against the model's limit; `truncate_field` names
    # it in a refusal
    truncate_tokens: int | None = None
    truncate_field: str = "truncate_prompt_tokens"
    long_input: str | None = None  # "truncate" or "chunk" (long_inputs.py); None: the server's --long-input

    text_positions: tuple[int, ...] | None = None  # texts and token ids mixed: where each text is in the input

    @property
    def num_inputs(self) -> int:
        return len(self.texts or ()) + len(self.token_ids or ())


@dataclass(frozen=True)
class RerankJob:
    """(query, document) pairs a cross-encoder scores: TEI's /rerank, Cohere's, Jina's and vLLM's /v1/rerank,
    vLLM's /score."""

    model: str | None
    pairs: list[tuple[str, str]]  # (query, document), in the client's document order
    truncate: bool = True
    raw_scores: bool = False
    instruction: str | None = None  # a decoder reranker's, in its pair template; None: the model's default
    # bge-m3's weights of its dense, sparse and ColBERT scores (FlagEmbedding's weights_for_different_modes); None:
    # FlagEmbedding's default (all_outputs.DEFAULT_WEIGHTS)
    mode_weights: tuple[float, float, float] | None = None


PredictInput = str | tuple[str, str]  # one text, or a (first, second) pair


@dataclass(frozen=True)
class PredictJob:
    """TEI's /predict: a classifier's scores for texts or pairs."""

    model: str | None
    inputs: list[PredictInput]
    single: bool  # the body held one text or pair, not a batch: answered as one list, not a list of lists
    truncate: bool = True
    truncation_direction: str = "right"
    raw_scores: bool = False
    instruction: str | None = None


@dataclass(frozen=True)
class ContextualJob:
    """Perplexity's contextual embeddings: each document's chunks, embedded in the context of the whole document."""

    model: str | None
    documents: list[list[str]]  # each document's chunks, in order
    options: RowOptions = AS_THE_MODEL  # as EmbedJob's; `encoding` is response_format's
    response_format: ResponseFormat = FORMATS["float"]

    @property
    def num_chunks(self) -> int:
        return sum(map(len, self.documents))


@dataclass(frozen=True)
class MultiVectorJob:
    """Per-token (ColBERT) vectors of texts, laid out as queries or as documents (late_interaction.py)."""

    model: str | None
    texts: list[str]
    input_type: str = "document"  # "query" or "document"
    # token_vectors set, normalised; `dimensions` cuts each token vector (then normalised; None: the projection's
    # width); `encoding` is response_format's
    options: RowOptions = TOKEN_VECTORS
    truncate: bool = True
    response_format: ResponseFormat = FORMATS["float"]


@dataclass(frozen=True)
class EncodeJob:
    """bge-m3's outputs of texts, as FlagEmbedding's `BGEM3FlagModel.encode` gives them (gateway/all_outputs.py)."""

    model: str | None
    texts: list[str]
    dense: bool = True  # return_dense
    sparse: bool = False  # return_sparse
    colbert: bool = False  # return_colbert_vecs
    max_length: int | None = None  # tokens a text keeps; None: the model's limit
    response_format: ResponseFormat = FORMATS["float"]
