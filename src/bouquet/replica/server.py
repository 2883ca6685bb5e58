"""The replica's gRPC server: the Embedding service over one scheduler, the standard health service, and the
process around them (`bouquet replica`): load the model, serve, and drain on SIGTERM.

Every exception a call can meet becomes a gRPC status in one place, `_STATUS` and `_mapped`.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hmac
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bouquet import all_outputs
from bouquet.batch import Batch
from bouquet.chat_templates import read_chat_template
from bouquet.config import ORPHANED_SIGNAL, EngineConfig, ReplicaConfig, SchedulerConfig
from bouquet.encodings import encode_rows
from bouquet.image_processor_file import read_image_processor_json
from bouquet.model_dir import ModelSpec, MultiVectorSpec
from bouquet.processes import serve_lock
from bouquet.proto import WIRE_VERSION, bouquet_version, embedding_pb2, embedding_pb2_grpc
from bouquet.replica.client import wire_encoding
from bouquet.replica.lane_frames import lane_path
from bouquet.replica.lane_server import LaneServer
from bouquet.replica.metrics import ReplicaMetrics, TlsFiles
from bouquet.replica.request import DeadlineExpired, InvalidInput, Limits, QueueFull, Unavailable, decode_request
from bouquet.replica.scheduler import Scheduler, StepEngine
from bouquet.scoring import maxsim
from bouquet.sparse_rows import sparsify
from bouquet.text_messages import required_chat_template
from bouquet.tls import server_credentials
from bouquet.tokenizer import tokenizer_json

logger = logging.getLogger(__name__)

SERVICE_NAME = embedding_pb2.DESCRIPTOR.services_by_name["Embedding"].full_name
_MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a large request's rows can pass gRPC's 4 MiB default
_STATUS: dict[type[Exception], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExpired: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}

Request = TypeVar("Request")
Reply = TypeVar("Reply")
Handler = Callable[["EmbeddingServicer", Request, grpc.aio.ServicerContext], Awaitable[Reply]]


def status_for(error: Exception) -> grpc.StatusCode:
    return next((_STATUS[kind] for kind in type(error).__mro__ if kind in _STATUS), grpc.StatusCode.INTERNAL)


def _mapped(method: Handler[Request, Reply]) -> Handler[Request, Reply]:
    """Turns the handler's exceptions into gRPC statuses and counts every call by its status."""

    @functools.wraps(method)
    async def handler(self: EmbeddingServicer, request: Request, context: grpc.aio.ServicerContext) -> Reply:
        started = time.perf_counter()
        self.calls_in_flight += 1
        try:
            with self.metrics.requests_in_progress.track_inprogress():
                reply = await method(self, request, context)
        except asyncio.CancelledError:  # the client cancelled, or gRPC enforced its deadline
            expired = (context.time_remaining() or 1.0) <= 0
            self.metrics.requests.labels("DEADLINE_EXCEEDED" if expired else "CANCELLED").inc()
            raise
        except Exception as error:
            code = status_for(error)
            if code is grpc.StatusCode.INTERNAL:
                logger.exception("%s failed", method.__name__)
            self.metrics.requests.labels(code.name).inc()
            await context.abort(code, str(error) or type(error).__name__)
        finally:
            self.calls_in_flight -= 1
        self.metrics.requests.labels("OK").inc()
        self.metrics.request_seconds.observe(time.perf_counter() - started)
        return reply

    return handler


def _image_processor_json(model_dir: Path, takes_images: bool) -> str:
    """The image processor's settings beside the model's config (preprocessor_config.json, or transformers 5's
    processor_config.json), for a model that takes images: the gateway preprocesses images as they say
    (gateway/image_processing.py); small, so every Info carries them."""
    return read_image_processor_json(model_dir) if takes_images else ""


def _conversations(spec: ModelSpec, limits: Limits) -> bool:
    """Whether the model's inputs are conversations: its images enter its decoder (Qwen3-VL-Embedding), or it is a
    text model whose sentence-transformers Transformer takes messages (st_messages.py)."""
    patches = limits.patch_images
    return bool(patches.patch_dim and not patches.image_sequences) or (
        spec.st_messages is not None and not _takes_images(limits)
    )


def _chat_template(spec: ModelSpec, limits: Limits) -> str:
    """A conversation model's chat template, for the gateway to format its inputs (gateway/patch_embed.py,
    text_messages.py)."""
    if spec.st_messages is not None and not _takes_images(limits):
        return required_chat_template(spec)
    return read_chat_template(spec.tokenizer_file.parent) if _conversations(spec, limits) else ""


def _set_st_messages(info: embedding_pb2.InfoResponse, spec: ModelSpec, limits: Limits) -> None:
    """Info's st_messages, for a conversation model saved by sentence-transformers (st_messages.py)."""
    if _conversations(spec, limits) and spec.st_messages is not None:
        info.st_messages.generation_prompt = spec.st_messages.generation_prompt
        info.st_messages.flat = spec.st_messages.flat
        info.st_messages.special_tokens.update(dict(spec.st_messages.special_tokens))


def _set_zero_shot_logit(info: embedding_pb2.InfoResponse, engine: StepEngine) -> None:
    """Info's logit_scale and logit_bias, those the model has (a stand-in engine of the tests may say nothing)."""
    scale, bias = getattr(engine, "zero_shot_logit", (None, None))
    if scale is not None:
        info.logit_scale = scale
    if bias is not None:
        info.logit_bias = bias


def _takes_images(limits: Limits) -> bool:
    return bool(limits.image_tokens or limits.patch_images.patch_dim)


class EmbeddingServicer(embedding_pb2_grpc.EmbeddingServicer):
    """Answers UNAVAILABLE until `attach` hands it a loaded engine and its running scheduler."""

    def __init__(self, metrics: ReplicaMetrics):
        self.metrics = metrics
        self.scheduler: Scheduler | None = None
        self.calls_in_flight = 0  # Embed and Info calls being answered; a drain waits for these only
        self.draining = False  # set on SIGTERM: new calls are turned away (UNAVAILABLE: try another replica)
        self._info = embedding_pb2.InfoResponse()
        self._info_with_tokenizer = embedding_pb2.InfoResponse()

    def attach(
        self, engine: StepEngine, scheduler: Scheduler, dtype: str, device: str, served_names: tuple[str, ...] = (),
        lane: LaneServer | None = None,
    ) -> None:  # fmt: skip
        spec = engine.spec
        self._info = embedding_pb2.InfoResponse(
            model_name=spec.name, architecture=spec.architecture, dimension=engine.dimension,
            max_seq_length=engine.max_seq_length, pooling=engine.pooling.name, dtype=dtype, device=device,
            vocab_size=spec.vocab_size, prompts=spec.prompts, default_prompt_name=spec.default_prompt_name or "",
            max_batch_tokens=scheduler.config.max_batch_tokens, normalize=spec.normalize, family=engine.family,
            task=engine.task, score_activation=spec.score_activation, sparse_dimension=engine.sparse_dimension,
            served_names=served_names, multi_vector=multi_vector_info(spec.multi_vector, engine.max_seq_length),
            image_shape=scheduler.limits.image_shape, image_tokens=scheduler.limits.image_tokens,
            image_patch_dim=scheduler.limits.patch_images.patch_dim,
            image_sequences=scheduler.limits.patch_images.image_sequences,
            image_max_patches=scheduler.limits.patch_images.max_patches,
            chat_template=_chat_template(spec, scheduler.limits),
            image_processor_json=_image_processor_json(spec.tokenizer_file.parent, _takes_images(scheduler.limits)),
            wire_version=WIRE_VERSION, bouquet_version=bouquet_version(),
            lane_path=lane.path if lane else "", lane_nonce=lane.nonce if lane else "",
        )  # fmt: skip
        _set_zero_shot_logit(self._info, engine)
        _set_st_messages(self._info, spec, scheduler.limits)
        # Read once: a gateway without a copy of the model asks for it to tokenize text for this replica.
        self._info_with_tokenizer = embedding_pb2.InfoResponse()
        self._info_with_tokenizer.CopyFrom(self._info)
        self._info_with_tokenizer.tokenizer_json = tokenizer_json(spec.tokenizer_file, spec.do_lower_case)
        self.scheduler = scheduler

    def _ready(self) -> Scheduler:
        if self.draining:
            raise Unavailable("replica is shutting down")
        if self.scheduler is None:
            raise Unavailable("replica is loading its model")
        return self.scheduler

    @_mapped
    async def Embed(
        self, request: embedding_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedding_pb2.EmbedResponse:
        scheduler = self._ready()
        batch = decode_request(request, scheduler.limits)
        remaining = context.time_remaining()
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        rows = await scheduler.embed(batch, deadline)  # [B, D] float32
        options = batch.options()  # as decode_request read and checked them
        if options.all_outputs:  # sparse rows (and scores): off the event loop
            return await asyncio.to_thread(all_outputs_response, rows, batch, scheduler.limits, request.maxsim)
        if request.maxsim:  # a large rerank's products: off the event loop, as sparse rows are
            return await asyncio.to_thread(maxsim_response, rows, batch.cu_rows)
        if options.sparse:  # np.nonzero over vocabulary-wide rows: off the event loop, which serves health too
            return await asyncio.to_thread(sparse_response, rows)
        return embedding_pb2.EmbedResponse(
            embeddings=encode_rows(rows, options.encoding).tobytes(), num_seqs=rows.shape[0],
            dimension=rows.shape[1], encoding=wire_encoding(options.encoding),
        )  # fmt: skip

    @_mapped
    async def Info(
        self, request: embedding_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> embedding_pb2.InfoResponse:
        self._ready()
        return self._info_with_tokenizer if request.include_tokenizer else self._info


_SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    # The gateways ping every connection each second (their way to notice a replica that hangs); gRPC's defaults
    # would call that abuse and close the connection ("too_many_pings").
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    # And the replica pings its gateways: a gateway cut off by a partition otherwise keeps its calls open here for
    # gRPC's default two hours, so their queued work is computed for nobody and, once the link is back, new chunks
    # wait behind it (tests/test_fault_partition.py). A missed ping cancels the calls, and cancelled work is dropped.
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
]


def multi_vector_info(spec: MultiVectorSpec | None, max_seq_length: int) -> embedding_pb2.MultiVector | None:
    """What the gateway needs to lay out a ColBERT model's queries and documents (proto/embedding.proto)."""
    if spec is None:
        return None
    return embedding_pb2.MultiVector(
        dimension=spec.dimension, query_prefix=spec.query_prefix, document_prefix=spec.document_prefix,
        query_length=min(spec.query_length or max_seq_length, max_seq_length),
        document_length=min(spec.document_length or max_seq_length, max_seq_length),
        expand_queries=spec.expand_queries, expansion_id=spec.expansion_id,
        attend_to_expansion=spec.attend_to_expansion, skiplist=spec.skiplist, skip_leading=spec.skip_leading,
    )  # fmt: skip


def maxsim_response(rows: np.ndarray, cu_rows: np.ndarray) -> embedding_pb2.EmbedResponse:
    scores = maxsim(rows, cu_rows)  # [documents] float32
    return embedding_pb2.EmbedResponse(
        embeddings=scores.astype("<f4").tobytes(), num_seqs=len(scores), dimension=1, encoding=embedding_pb2.FLOAT32
    )


def all_outputs_response(
    rows: np.ndarray, batch: Batch, limits: Limits, maxsim: bool
) -> embedding_pb2.EmbedResponse:  # rows: [R, width] float32, as Batch.all_outputs lays them out
    """bge-m3's three outputs, or with `maxsim` its three scores of the query against each document."""
    assert limits.unweighted_ids is not None, "decode_request refuses all_outputs to a model without token weights"
    token_dimension = limits.token_dimension if batch.token_vectors is not None and batch.token_vectors[0] else 0
    outputs = all_outputs.split_rows(rows, batch, limits.dimension, token_dimension, limits.unweighted_ids)
    if not maxsim:
        return all_outputs.to_response(outputs)
    scores = all_outputs.scores(outputs)  # [documents, 3]
    return embedding_pb2.EmbedResponse(
        embeddings=scores.astype("<f4").tobytes(), num_seqs=len(scores), dimension=scores.shape[1],
        encoding=embedding_pb2.FLOAT32,
    )  # fmt: skip


def sparse_response(rows: np.ndarray) -> embedding_pb2.EmbedResponse:  # rows: [B, vocabulary] float32
    """Only each row's nonzero weights travel: a SPLADE row has tens to hundreds of a vocabulary of 30,000+."""
    sparse = sparsify(rows)
    return embedding_pb2.EmbedResponse(
        num_seqs=sparse.num_rows, dimension=rows.shape[1], sparse_offsets=sparse.cu_offsets.astype("<i4").tobytes(),
        sparse_indices=sparse.indices.astype("<i4").tobytes(), sparse_values=sparse.values.astype("<f4").tobytes(),
    )  # fmt: skip


class TokenCheck(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no type stubs
    """Embed and Info only with `authorization: Bearer TOKEN` (the gateways send it); health stays open, for
    orchestrators' probes."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:  # fmt: skip
        if details.method.startswith("/grpc.health.v1."):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return await continuation(details)
        return grpc.unary_unary_rpc_method_handler(_refuse_unauthenticated)


async def _refuse_unauthenticated(request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED, "this replica needs the gateway's token ($BOUQUET_REPLICA_TOKEN)"
    )


class ReplicaServer:
    """A gRPC server that listens at once (health NOT_SERVING) and serves once an engine is attached; on a Unix
    socket, with the local lane beside it (replica/lane_server.py) unless `local_lane` is off."""

    def __init__(
        self,
        listen: str,
        metrics: ReplicaMetrics | None = None,
        token: str | None = None,
        credentials: grpc.ServerCredentials | None = None,
        local_lane: bool = True,
    ):
        self.metrics = metrics or ReplicaMetrics()
        interceptors = [TokenCheck(token)] if token else []
        self.server = grpc.aio.server(options=_SERVER_OPTIONS, interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        self.servicer = EmbeddingServicer(self.metrics)
        embedding_pb2_grpc.add_EmbeddingServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if credentials is None:
            self.port = self.server.add_insecure_port(listen)
        else:
            self.port = self.server.add_secure_port(listen, credentials)
        if self.port == 0:
            raise ValueError(f"cannot listen on {listen}")
        self.scheduler: Scheduler | None = None
        path = lane_path(listen) if local_lane and credentials is None else None
        self.lane = None if path is None else LaneServer(path, self.servicer, token)

    async def start(self) -> None:
        await self.server.start()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.lane is not None:
            await self._start_lane(self.lane)

    async def _start_lane(self, lane: LaneServer) -> None:
        try:
            await lane.start()
        except OSError as error:  # a path over the 107 bytes a Unix socket's name may take, say: gRPC still serves
            logger.warning("the local lane could not listen at %s (%s); gateways will use gRPC alone", lane.path, error)
            self.lane = None

    async def attach(
        self, engine: StepEngine, config: SchedulerConfig, dtype: str, device: str, served_names: tuple[str, ...] = ()
    ) -> Scheduler:
        self.scheduler = Scheduler(engine, config, self.metrics)
        self.servicer.attach(engine, self.scheduler, dtype, device, served_names, self.lane)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return self.scheduler

    async def stop(self, grace: float | None) -> None:
        """Reports NOT_SERVING, lets the calls already in (queued work included) finish within `grace` seconds,
        then stops. It returns as soon as they are done: the gateways' health Watch streams never end on their
        own, and gRPC's own grace would wait for them until it ran out."""
        await self.health.enter_graceful_shutdown()
        self.servicer.draining = True
        deadline = asyncio.get_running_loop().time() + (grace or 0.0)
        while self.servicer.calls_in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        if self.lane is not None:
            await self.lane.stop()
        await self.server.stop(0)
        if self.scheduler is not None:
            self.scheduler.close()

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)


def listen_host(listen: str) -> str:
    """The host part of HOST:PORT ("[::1]:50051" too); an empty host or "[::]" means every address, and a Unix
    socket's replica publishes its metrics on loopback only."""
    if listen.startswith("unix:"):
        return "127.0.0.1"
    host = listen.rsplit(":", 1)[0].strip("[]")
    return host if host not in ("", "::") else "0.0.0.0"


_QUIET_SECONDS = 2.0  # without serve's lock file: no call in flight for this long, the gateways are done
_GATEWAYS_GRACE_S = 10.0  # past the drain: how long serve itself would have waited for a gateway


async def _after_the_gateways(replica: ReplicaServer, stop: asyncio.Event, drain_seconds: float) -> None:
    """Keeps serving the orphaned gateways' last requests until they have exited (serve_lock.py; at most their
    drain and a grace), then drains as on SIGTERM."""
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_seconds + _GATEWAYS_GRACE_S
        while (gone := serve_lock.gateways_gone()) is False and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if gone is None:
            await _until_quiet(replica)
    finally:
        stop.set()


async def _until_quiet(replica: ReplicaServer) -> None:
    loop = asyncio.get_running_loop()
    quiet_since = loop.time()
    while loop.time() - quiet_since < _QUIET_SECONDS:
        if replica.servicer.calls_in_flight:
            quiet_since = loop.time()
        await asyncio.sleep(0.05)


async def run_replica(engine_config: EngineConfig, scheduler_config: SchedulerConfig, config: ReplicaConfig) -> int:
    """`bouquet replica`: listen, load the model, serve until SIGTERM or SIGINT, drain, return 0."""
    from bouquet.engine.engine import Engine  # torch is imported only by the process that computes

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    credentials = None
    if config.tls_cert is not None and config.tls_key is not None:
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    replica = ReplicaServer(config.listen, token=config.token, credentials=credentials, local_lane=config.local_lane)
    drain = config.drain_seconds
    loop.add_signal_handler(ORPHANED_SIGNAL, lambda: loop.create_task(_after_the_gateways(replica, stop, drain)))
    if config.metrics_port is not None:
        tls = (
            None
            if config.tls_cert is None or config.tls_key is None
            else TlsFiles(config.tls_cert, config.tls_key, config.tls_client_ca)
        )
        replica.metrics.serve_http(config.metrics_port, listen_host(config.listen), tls)
    await replica.start()
    try:
        engine = await asyncio.to_thread(Engine, engine_config)
    except BaseException:
        await replica.stop(0)  # a model that cannot load: the server goes before the event loop does
        raise
    try:
        # Torch, the model and gRPC make 180,000 objects that live as long as the process; a full collection that
        # scans them holds the interpreter, so every step's dispatch and the event loop, for 65-85 ms.
        gc.collect()
        gc.freeze()
        await replica.attach(
            engine, scheduler_config, engine_config.dtype, engine_config.device, config.served_model_names
        )
        where = config.listen if config.listen.startswith("unix:") else f"port {replica.port}"
        print(f"bouquet replica: serving {engine.spec.name} on {where}", file=sys.stderr, flush=True)
        await stop.wait()
        print("bouquet replica: draining", file=sys.stderr, flush=True)
        await replica.stop(config.drain_seconds)
    finally:
        engine.close()
    return 0
