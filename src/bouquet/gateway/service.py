"""The gateway's core, without HTTP: the replica pool, the models it has found, admission and the limits every
API shares, and the embedding job (`Service.embed`) the routes of every dialect run. A route (gateway/api/)
parses its body into a typed job (jobs.py) and hands it here; scoring.py, contextual.py and text_tools.py hold
the other jobs, on this service."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from bouquet.batch import Batch, RowOptions
from bouquet.config import GatewayConfig
from bouquet.encodings import Encoding, encode_rows
from bouquet.gateway import long_inputs
from bouquet.gateway.admission import Admission
from bouquet.gateway.chunking import embed_chunked, maxsim_chunked
from bouquet.gateway.errors import InvalidRequest, TooLarge, Unavailable
from bouquet.gateway.jobs import EmbedJob
from bouquet.gateway.memory_trim import trim_when_idle
from bouquet.gateway.metrics import GatewayMetrics
from bouquet.gateway.replicas.catalog import ModelCatalog, ServedModel
from bouquet.gateway.replicas.pool import ReplicaPool
from bouquet.replica.client import Reply
from bouquet.sparse_rows import max_sparse_rows
from bouquet.tls import channel_credentials

SPECIAL_TOKENS = 4  # the most any tokenizer here adds around one text or pair (e.g. <s> </s></s> </s>)
# A text job's rows and tokens where each text is a conversation (patch_embed.embed_texts, which builds on this module,
# so app.py hands it in).
TextConversations = Callable[["Service", EmbedJob, ServedModel], Awaitable[tuple[Any, int]]]


class Service:
    """The state every route shares: the replica pool, the models it has found, limits and metrics."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None):
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.executor = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        self.catalog = ModelCatalog(config.model_dirs, self.executor)
        credentials = None
        if config.replica_tls_ca is not None:
            credentials = channel_credentials(config.replica_tls_ca, config.replica_tls_cert, config.replica_tls_key)
        self.pool = ReplicaPool(
            config.replicas, self.catalog, self.metrics, config.max_attempts, config.request_timeout,
            config.probe_interval, config.replica_token, credentials=credentials,
            server_name=config.replica_tls_server_name, dns_names=config.replicas_dns,
            dns_interval=config.dns_interval,
        )  # fmt: skip
        self.admission = Admission(
            self.metrics, config.max_inflight_tokens, config.admission_seconds, config.admission_wait,
            config.max_concurrent_requests,
            self.pool.tokens_per_second, self._admission_floor,
        )  # fmt: skip
        self._trimmer: asyncio.Future[None] | None = None
        self.draining = False
        self.drain_ended = False
        self.work: set[asyncio.Future[Any]] = set()  # the requests' work in hand (http/endpoint.py)
        self.text_conversations: TextConversations | None = None  # set by app.py

    def start(self) -> None:
        """On the serving event loop: the replicas' probes and discovery, and the idle memory trim."""
        self.pool.start()
        self._trimmer = asyncio.ensure_future(
            trim_when_idle(lambda: self.admission.requests, lambda: self.admission.answered)
        )

    def begin_drain(self, seconds: float) -> None:
        """SIGTERM: the work in hand, queued or computing, goes on for `seconds`; then what is left is cancelled and
        answered 503 with Retry-After, before the server cancels its own tasks (answered 500) and before the
        replicas' channels close (`close`, once every request is answered)."""
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(seconds, self._end_drain)

    def _end_drain(self) -> None:
        self.drain_ended = True
        for work in list(self.work):
            work.cancel()

    async def close(self) -> None:
        if self._trimmer is not None:
            self._trimmer.cancel()
        await self.pool.close()
        self.executor.shutdown(wait=False)

    async def embed(self, job: EmbedJob) -> tuple[ServedModel, Any, int]:
        """Rows [N, elements] for the job, in its response format's encoding, and the tokens they took."""
        if job.text_positions is not None:
            return await self._embed_mixed(job)
        model = self.catalog.get(job.model)
        sparse = job.options.sparse
        if sparse and not model.sparse_dimension:
            raise model.wrong_task("sparse rows")
        if not sparse and model.task != "embed":
            raise model.wrong_task("embeddings")
        if job.texts is not None and model.images is not None and model.images.st_messages is not None:
            assert self.text_conversations is not None, "app.py sets it"
            return model, *await self.text_conversations(self, job, model)  # sentence-transformers' formatting
        if (cap := token_cap(job, model)) != job.truncate_tokens:  # -1 or the limit itself: the model's limit
            job = replace(job, truncate_tokens=cap)
        options = self._row_options(job, model)
        self.check_inputs(job.num_inputs)
        if not sparse and (job.long_input or self.config.long_input) == "chunk" and not _conversations(job, model):
            return model, *await self._embed_windows(job, model, options)  # sparse rows are not averaged

        async def batch() -> Batch:
            return Batch.pack(await self.sequences(job, model), options)

        estimate = self.estimate(job, model, options.prompt_tokens)
        rows, tokens = await self.compute(model, estimate, batch, exact=job.token_ids is not None)
        return model, rows, tokens

    async def _embed_mixed(self, job: EmbedJob) -> tuple[ServedModel, Any, int]:
        """Texts and token ids in one batch (TEI takes it): each kind embedded as a job of its own, concurrently,
        the rows put back in the input's order."""
        self.check_inputs(job.num_inputs)
        texts = replace(job, token_ids=None, text_positions=None)
        ids = replace(job, texts=None, text_positions=None)
        (model, text_rows, text_tokens), (_, id_rows, id_tokens) = await asyncio.gather(
            self.embed(texts), self.embed(ids)
        )
        rows = np.empty((job.num_inputs, text_rows.shape[1]), text_rows.dtype)
        is_text = np.zeros(job.num_inputs, bool)
        is_text[list(job.text_positions or ())] = True
        rows[is_text], rows[~is_text] = text_rows, id_rows
        return model, rows, text_tokens + id_tokens

    async def _embed_windows(self, job: EmbedJob, model: ServedModel, options: RowOptions) -> tuple[Any, int]:
        """Each input whole, in windows of the model's limit averaged (long_inputs.py)."""
        prompt = job_prompt(job, model)
        cut: list[long_inputs.Windows] = []

        async def batch() -> Batch:
            if job.texts is not None:
                tokenizer = model.require_tokenizer()
                contents, (prefix, suffix) = await tokenizer.encode_text_only(job.texts), tokenizer.frame(prompt)
            else:
                assert job.token_ids is not None
                self._check_vocabulary(job.token_ids, model)
                contents, prefix, suffix = job.token_ids, [], []  # ids as sent, their own special tokens
            cut.append(long_inputs.cut(contents, prefix, suffix, model.max_seq_length))
            # the windows' rows come back as float32, averaged, then finished and encoded here
            window_options = replace(options, dimensions=None, normalize=False, encoding=Encoding.FLOAT32)
            return Batch.pack(cut[0].sequences, window_options)

        sizes = [len(text.encode()) for text in job.texts] if job.texts is not None else map(len, job.token_ids or ())
        estimate = sum(size + SPECIAL_TOKENS * (1 + size // model.max_seq_length) for size in sizes)
        rows, tokens = await self.compute(model, estimate, batch, exact=job.token_ids is not None)
        combined = long_inputs.combine(rows, cut[0], job.num_inputs, options.dimensions, options.normalize is True)
        return encode_rows(combined, options.encoding), tokens

    async def compute(
        self,
        model: ServedModel,
        estimate: int,
        prepare: Callable[[], Awaitable[Batch]],
        exact: bool = False,
        maxsim: bool = False,
    ) -> tuple[Any, int]:
        """The rows of the batch `prepare` tokenizes (with `maxsim`, its first sequence's MaxSim scores against the
        others), admitted on `estimate` (an upper bound of its tokens, from its bytes; `exact` when counted from
        token ids; patch images' patches included, as `Batch.cu_budget` counts work) before any work; and the
        tokens they took."""
        if not await self.pool.serving(model.name):  # one down a moment ago (a missed ping) is waited for
            raise Unavailable(f"no healthy replica serves the model {model.id!r}", "no_healthy_replica", "model")
        async with self.admission.admit(
            estimate, short_tokens=model.max_batch_tokens, exact=exact, model=model.id
        ) as ticket:
            batch = await prepare()
            tokens = batch.num_tokens
            self.check_tokens(tokens)
            ticket.tokenized(batch.budget_tokens)
            chunk_tokens = self.config.chunk_tokens or 2 * max(1, model.max_batch_tokens)
            priority = 0 if ticket.short else 1  # queries first; among the rest, first come first served
            max_seqs = max_sparse_rows(model.sparse_dimension) if batch.any_sparse else None
            rows: Reply
            if maxsim:
                rows = await maxsim_chunked(self.pool, model.name, batch, chunk_tokens, priority)
            else:
                rows = await embed_chunked(self.pool, model.name, batch, chunk_tokens, priority, max_seqs)
        self.metrics.tokens.labels(model.id).inc(tokens)
        return rows, tokens

    def estimate(self, job: EmbedJob, model: ServedModel, prompt_tokens: int) -> int:
        """At least the tokens the job will take, known before tokenizing: a token is at least one byte."""
        limit = model.max_seq_length
        if job.token_ids is not None:
            return sum(min(len(ids), limit) if job.truncate else len(ids) for ids in job.token_ids)
        assert job.texts is not None
        bound = SPECIAL_TOKENS + prompt_tokens
        sizes = (_utf8_size(text) + bound for text in job.texts)
        return sum(min(size, limit) for size in sizes) if job.truncate else sum(sizes)

    def _admission_floor(self) -> int:
        """Tokens admitted at once before the replicas' speed is known, and the least after: sixteen batches
        for each healthy replica (about a second of work on a CPU), so a cap measured while they idled never
        starves them."""
        return sum(16 * r.model.max_batch_tokens for r in self.pool.replicas if r.healthy and r.model is not None)

    def check_inputs(self, count: int) -> None:
        """Every route's cap on the inputs of one request (embeddings, documents, texts to tokenize)."""
        if count > self.config.max_inputs:
            raise TooLarge(f"{count} inputs, over the limit of {self.config.max_inputs} a request", "too_many_inputs")

    def check_tokens(self, tokens: int) -> None:
        if tokens > self.config.max_request_tokens:
            raise TooLarge(
                f"{tokens} tokens, over the limit of {self.config.max_request_tokens} a request", "too_many_tokens"
            )

    def _row_options(self, job: EmbedJob, model: ServedModel) -> RowOptions:
        prompt = job_prompt(job, model)
        prompt_tokens = model.require_tokenizer().prompt_tokens(prompt) if prompt else 0
        return complete_options(job.options, model, prompt_tokens)

    async def sequences(self, job: EmbedJob, model: ServedModel) -> list[list[int]]:
        """The job's token ids: its texts tokenized with the model's prompt, or its ids checked and cut."""
        if job.token_ids is not None:
            return self._check_token_ids(job.token_ids, job, model)
        assert job.texts is not None
        tokenizer = model.require_tokenizer()
        started = time.perf_counter()
        sequences = await tokenizer.encode(
            job.texts, job_prompt(job, model), job.truncate, job.truncation_direction, job.truncate_tokens
        )
        self.metrics.tokenize_seconds.observe(time.perf_counter() - started)
        return sequences

    def _check_vocabulary(self, token_ids: list[list[int]], model: ServedModel) -> None:
        if not self.config.token_id_input:
            raise InvalidRequest(
                "this server takes text only, not token ids (--no-token-id-input): a client that tokenizes for "
                "another model (langchain-openai's default tiktoken ids) would get wrong vectors",
                "token_ids_refused",
                "input",
            )
        for index, ids in enumerate(token_ids):
            low, high = min(ids), max(ids)
            if low < 0 or high >= model.vocab_size:
                raise InvalidRequest(
                    f"input {index} holds the token id {low if low < 0 else high}, outside this model's vocabulary "
                    f"[0, {model.vocab_size})",
                    "invalid_token_id",
                    "input",
                )

    def _check_token_ids(self, token_ids: list[list[int]], job: EmbedJob, model: ServedModel) -> list[list[int]]:
        self._check_vocabulary(token_ids, model)
        limit = job.truncate_tokens or model.max_seq_length
        for index, ids in enumerate(token_ids):
            if len(ids) > limit and not job.truncate:
                raise TooLarge(
                    f"input {index} has {len(ids)} tokens, over this model's limit of {limit}", "input_too_long"
                )
        if job.truncation_direction == "left":
            return [ids[-limit:] for ids in token_ids]
        return [ids[:limit] for ids in token_ids]


def complete_options(options: RowOptions, model: ServedModel, prompt_tokens: int = 0) -> RowOptions:
    """A router's options completed where the model is known, every job's one check of them on the gateway:
    `dimensions` within the width of the rows asked for (a token vector's for token vectors), `normalize` as the
    model's Normalize module says unless the request said, and the prompt's tokens. A sparse row comes whole and as
    it is: no dimensions, normalisation or encoding."""
    if options.sparse:
        return replace(options, prompt_tokens=prompt_tokens)
    if options.token_vectors:
        assert model.multi_vector is not None, "token vectors are asked of a multi-vector model only"
        width, rows = model.multi_vector.dimension, "this model's token vectors"
    else:
        width, rows = model.dimension, repr(model.id)
    if options.dimensions is not None and not 1 <= options.dimensions <= width:
        raise InvalidRequest(
            f"dimensions must be between 1 and {width} for {rows}, got {options.dimensions}", "invalid_value",
            "dimensions",
        )  # fmt: skip
    normalize = model.normalize if options.normalize is None else options.normalize
    return replace(options, normalize=normalize, prompt_tokens=prompt_tokens)


def embedding_model(service: Service, name: str | None) -> ServedModel:
    """The model a dense-rows request names; a reranker or classifier is refused (TEI's 424 on its routes)."""
    model = service.catalog.get(name)
    if model.task != "embed":
        raise model.wrong_task("embeddings")
    return model


def job_prompt(job: EmbedJob, model: ServedModel) -> str:
    """The prompt of a job's texts: its literal one, else `prompt_name`'s, else the model's default; none for ids."""
    if job.texts is None:
        return ""
    return job.prompt if job.prompt is not None else model.prompt(job.prompt_name)


def token_cap(job: EmbedJob, model: ServedModel) -> int | None:
    """The request's own cap on an input's tokens (None: the model's limit), the one check of it: vLLM's
    truncate_prompt_tokens keeps the first k tokens, -1 meaning the model's limit, and refuses 0 and k over the
    limit, as vLLM does; Cohere's max_tokens (at least 1 by its type) alike."""
    cap, limit = job.truncate_tokens, model.max_seq_length
    if cap is None or cap == -1 or cap == limit:
        return None
    if not 1 <= cap <= limit:
        raise InvalidRequest(
            f"'{job.truncate_field}' must be -1 (the model's limit) or between 1 and the model's limit "
            f"(max_model_len {limit}), got {cap}",
            "invalid_value",
            job.truncate_field,
        )
    return cap


def _conversations(job: EmbedJob, model: ServedModel) -> bool:
    """Texts a text model takes as conversations (text_messages.py): never windowed, since a window of a
    conversation is no conversation; cut as sentence-transformers cuts them."""
    return job.texts is not None and model.conversations


def _utf8_size(text: str) -> int:
    """`len(text.encode())` without the copy for ASCII text (CPython knows a string is ASCII without a scan):
    estimating every request before it is refused must cost little when a flood of them is."""
    return len(text) if text.isascii() else len(text.encode())
