"""The `bouquet` command. Every option is declared once, in the tables below, and added from there to each command
that takes it; the configs are built from the parsed options here, in one place; and `serve` and
`gateway --workers` pass options on to their child processes from the same declarations, never re-spelled."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bouquet.config import (
    DEVICES,
    DTYPES,
    CudaGraphConfig,
    EmbedConfig,
    EngineConfig,
    GatewayConfig,
    RayConfig,
    ReplicaConfig,
    SchedulerConfig,
    ServeConfig,
    create_engine_config,
    default_model_path,
)


@dataclass(frozen=True)
class Option:
    """One command-line option. Unless `kwargs` gives a default it parses to None when not given, so the config
    dataclass's own default applies and a parent passes on only what was given."""

    flag: str
    kwargs: Mapping[str, Any]  # argparse's add_argument keywords

    @property
    def dest(self) -> str:
        """The parsed name: the config field it sets has it too, but for --model and --replica."""
        return self.flag.removeprefix("--").replace("-", "_")

    def argv(self, value: object) -> list[str]:
        """A parsed `value` of this option as a child process's arguments."""
        if value is None:
            return []
        if isinstance(value, bool):  # argparse.BooleanOptionalAction
            return [self.flag if value else f"--no-{self.flag.removeprefix('--')}"]
        if isinstance(value, list | tuple):  # action="append": the option once per item
            return [f"{self.flag}={item}" for item in value]
        return [f"{self.flag}={value}"]  # "=": a value that starts with "-" is still this option's


def _option(flag: str, help: str, **kwargs: Any) -> Option:
    return Option(flag, {"help": help, **kwargs})


# Each engine's: `replica` and `embed` take them, `serve` passes them to each replica.
ENGINE_OPTIONS = (
    _option("--model", "local model directory (default: the bundled all-MiniLM-L6-v2)"),
    _option("--device", "default: cuda where available", default="auto", choices=["auto", *DEVICES]),
    _option(
        "--dtype",
        "default auto: bfloat16 on a GPU and on a CPU with native bfloat16 (avx512_bf16 or AMX), else float32; "
        "int8 (CPU): every linear in int8 (per-channel weights, per-token activations), the rest float32",
        default="auto",
        choices=["auto", *DTYPES],
    ),
    _option(
        "--attention-backend",
        "auto (default: the fastest per sequence length, measured at start-up and cached), cpu_varlen, sdpa, "
        "flash_attn, flashinfer",
        default="auto",
    ),
    _option(
        "--attention-table",
        "auto backend: a per-length table (bench/gpu_check.py's, or a CPU one from the cache; default: measured)",
        type=Path,
    ),
    _option("--cuda-graphs", "GPU: whole-model CUDA graphs (default: on)", action=argparse.BooleanOptionalAction),
    _option("--num-threads", "intra-op threads in all (default: the cores, or $OMP_NUM_THREADS)", type=int),
    _option("--cpu-workers", "CPU: steps at once, each on a share of the threads (default: 2 if 2+ threads)", type=int),
    _option(
        "--cpu-lone-step-tokens",
        "CPU, one thread a worker: a step of at most this many tokens that runs alone "
        f"takes every thread (default {EngineConfig.cpu_lone_step_tokens}; 0: never)",
        type=int,
    ),
    _option(
        "--cpu-token-buckets",
        "CPU: step token counts padded to this many sizes per doubling, bounding oneDNN's per-shape memory "
        f"(default {EngineConfig.cpu_token_buckets}; 0: exact counts)",
        type=int,
    ),
    _option(
        "--cpu-warmup-tokens",
        "CPU: build those per-shape primitives at start for steps of up to this many tokens "
        f"(default {EngineConfig.cpu_warmup_tokens}; 0: as steps meet them)",
        type=int,
    ),
)
SCHEDULER_OPTIONS = (
    _option("--max-batch-tokens", "token budget a step (default: the device's measured knee)", type=int),
    _option("--max-batch-seqs", f"sequences a step (default {SchedulerConfig.max_batch_seqs})", type=int),
    _option("--max-queue-tokens", f"tokens queued (default {SchedulerConfig.max_queue_tokens})", type=int),
)
# On every command, so that `serve` and `gateway --workers` pass it on; `bouquet --log-level L CMD` works too.
_LOG_LEVEL = _option("--log-level", "default WARNING", default=argparse.SUPPRESS)
_DRAIN = _option(
    "--drain-seconds",
    "after SIGTERM, time to finish the work in hand (default: 60 a replica, 30 serve and gateway)",
    type=float,
)
# Each replica process's own; `serve` picks them per replica.
_REPLICA_PROCESS = (
    _option("--listen", f"HOST:PORT for gRPC (port 0: any free port), or unix:PATH (default {ReplicaConfig.listen})"),
    _option("--metrics-port", "serve Prometheus /metrics over HTTP on this port", type=int),
    _option("--tls-cert", "PEM certificate: serve gRPC over TLS (with --tls-key)", type=Path),
    _option("--tls-key", "PEM private key of --tls-cert", type=Path),
    _option("--tls-client-ca", "PEM CA: gateways must present a certificate it signed (mutual TLS)", type=Path),
)
_SERVED_NAME = _option(
    "--served-model-name",
    "another name requests may give the model (a client's default such as text-embedding-3-small); the first is the "
    "one answers report; /v1/models lists each (repeat)",
    action="append",
)
# serve's: each name for one of its models.
_SERVE_SERVED_NAME = _option(
    "--served-model-name",
    "NAME, or MODEL=NAME with several --model (MODEL: the model directory's name): another name requests may give "
    "that model; the first of a model's is the one answers report; /v1/models lists each (repeat)",
    action="append",
)
REPLICA_OPTIONS = (*ENGINE_OPTIONS, *SCHEDULER_OPTIONS, _DRAIN, _LOG_LEVEL)  # what `serve` passes each replica
# `serve` takes several models, each on replicas of its own; every other replica option applies to them all.
_SERVE_MODELS = _option(
    "--model",
    "local model directory (repeat to serve several, each on its own replicas, routed by name; default: the "
    "bundled all-MiniLM-L6-v2)",
    action="append",
)
_SERVE_REPLICA_OPTIONS = tuple(_SERVE_MODELS if option.flag == "--model" else option for option in REPLICA_OPTIONS)

GATEWAY_LIMIT_OPTIONS = (
    _option("--max-inputs", f"inputs a request (default {GatewayConfig.max_inputs})", type=int),
    _option(
        "--long-input",
        "an input over the model's limit, unless a request says: truncate it (default), or chunk it (embedded whole "
        "in windows, averaged)",
        choices=["truncate", "chunk"],
    ),
    _option(
        "--token-id-input",
        "accept token ids as input (default: on; --no-token-id-input: text only, for clients that may send another "
        "model's ids, such as langchain-openai's default)",
        action=argparse.BooleanOptionalAction,
    ),
    _option(
        "--allow-unknown-fields",
        "ignore request fields a route does not read (default: refused with 400, naming the field)",
        action=argparse.BooleanOptionalAction,
    ),
    _option(
        "--cors-allow-origin", "a browser origin allowed to call, or * (repeat; default: no CORS)", action="append"
    ),
    _option("--max-request-tokens", f"default {GatewayConfig.max_request_tokens}", type=int),
    _option("--max-payload-bytes", f"default {GatewayConfig.max_payload_bytes}", type=int),
    _option(
        "--max-inflight-tokens",
        f"ceiling on tokens admitted at once a process; over it, 429 (default {GatewayConfig.max_inflight_tokens})",
        type=int,
    ),
    _option(
        "--admission-seconds",
        f"admit what the replicas compute in this long, as measured (default {GatewayConfig.admission_seconds})",
        type=float,
    ),
    _option(
        "--admission-wait",
        f"seconds a request over the cap waits for room before its 429 (default {GatewayConfig.admission_wait})",
        type=float,
    ),
    _option(
        "--max-concurrent-requests",
        f"requests answered at once a process; over it, 429 (default {GatewayConfig.max_concurrent_requests})",
        type=int,
    ),
    _option("--chunk-tokens", "tokens a chunk (default: 2x the replica's batch budget)", type=int),
    _option("--max-attempts", f"replicas a chunk may be tried on (default {GatewayConfig.max_attempts})", type=int),
    _option("--request-timeout", f"seconds a chunk may take (default {GatewayConfig.request_timeout})", type=float),
    _option(
        "--probe-interval",
        f"seconds between probes of a replica that is down (default {GatewayConfig.probe_interval})",
        type=float,
    ),
    _option("--tokenizer-threads", f"a process (default {GatewayConfig.tokenizer_threads})", type=int),
    _option(
        "--max-connections",
        f"open HTTP connections a process; at it the oldest idle one is closed, or a new one refused 503 "
        f"(default {GatewayConfig.max_connections})",
        type=int,
    ),
    _option(
        "--max-header-bytes",
        f"request line and headers; more is 431 (default {GatewayConfig.max_header_bytes})",
        type=int,
    ),
    _option(
        "--header-timeout",
        f"seconds for a request's headers from their first byte; then 408 (default {GatewayConfig.header_timeout})",
        type=float,
    ),
    _option(
        "--body-timeout",
        f"seconds a request body may go without a byte; then 408 (default {GatewayConfig.body_timeout})",
        type=float,
    ),
    _option(
        "--idle-timeout",
        f"seconds a connection may stay with no request in progress (default {GatewayConfig.idle_timeout})",
        type=float,
    ),
)
_HOST = _option("--host", f"default {GatewayConfig.host}", default=GatewayConfig.host)
_PORT = _option("--port", f"default {GatewayConfig.port}", type=int, default=GatewayConfig.port)
# What one gateway process is given: by `gateway --workers N` (its own arguments) and by `serve`.
_REPLICA_TLS = (
    _option("--replica-tls-ca", "PEM CA: reach replicas over TLS, trusting certificates it signed", type=Path),
    _option("--replica-tls-cert", "PEM certificate shown to replicas that ask for one (mutual TLS)", type=Path),
    _option("--replica-tls-key", "PEM private key of --replica-tls-cert", type=Path),
)
_DNS_INTERVAL = _option("--dns-interval", f"seconds between lookups (default {GatewayConfig.dns_interval})", type=float)
GATEWAY_OPTIONS = (
    _option("--replica", "HOST:PORT of a replica (repeat)", action="append"),
    _option(
        "--replicas-dns",
        "NAME:PORT: every address NAME resolves to is a replica, re-resolved as it changes (a Kubernetes headless "
        "Service; repeat)",
        action="append",
    ),
    _DNS_INTERVAL,
    *_REPLICA_TLS,
    _option(
        "--model",
        "local model directory to tokenize with instead of the tokenizer the replica sends (repeat; "
        "default: the bundled model, if installed)",
        action="append",
    ),
    _HOST,
    _PORT,
    _DRAIN,
    *GATEWAY_LIMIT_OPTIONS,
    _LOG_LEVEL,
)
# Options a supervising process keeps: the API key goes to its children by environment, where `ps` does not show it.
_WORKERS = _option("--workers", "gateway processes sharing the port", type=int, default=1)
_API_KEY = _option("--api-key", "require 'Authorization: Bearer KEY' (default: $BOUQUET_API_KEY, if set)")
# The key from a file (a Kubernetes Secret's mount): unlike --api-key, it never shows in `ps`.
_API_KEY_FILE = _option("--api-key-file", "read the API key from this file", type=Path)
_SERVE_FIELDS = (
    _option("--replicas", "local `bouquet replica` processes (default 1)", type=int),
    _WORKERS,
    _HOST,
    _PORT,
    _option("--ready-timeout", f"seconds to load and answer (default {ServeConfig.ready_timeout})", type=float),
)


def _add(parser: argparse._ActionsContainer, options: Iterable[Option]) -> None:
    for option in options:
        parser.add_argument(option.flag, **option.kwargs)


def _given(args: argparse.Namespace, options: Iterable[Option]) -> dict[str, Any]:
    """The options given (or with a default of their own), by config field name."""
    values = vars(args)
    return {option.dest: values[option.dest] for option in options if values.get(option.dest) is not None}


def _argv(options: Iterable[Option], values: Mapping[str, object]) -> tuple[str, ...]:
    """Parsed `values` as arguments to a child that takes `options`; values it does not take stay behind."""
    return tuple(arg for option in options for arg in option.argv(values.get(option.dest)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bouquet", description="Fast text-embedding serving.")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_embed_parser(commands)
    replica = commands.add_parser("replica", help="serve one model over gRPC: token-budget scheduler plus engine")
    _add(replica, [*REPLICA_OPTIONS, *_REPLICA_PROCESS, _SERVED_NAME])
    serve = commands.add_parser("serve", help="gateway plus N local replicas: the HTTP server")
    _add(serve.add_argument_group("each replica (see `bouquet replica`)"), _SERVE_REPLICA_OPTIONS)
    _add(serve.add_argument_group("each gateway (see `bouquet gateway`)"), GATEWAY_LIMIT_OPTIONS)
    _add(serve, [*_SERVE_FIELDS, _SERVE_SERVED_NAME, _API_KEY, _API_KEY_FILE])
    gateway = commands.add_parser("gateway", help="the HTTP gateway alone, in front of running replicas")
    _add(gateway, [*GATEWAY_OPTIONS, _WORKERS, _API_KEY, _API_KEY_FILE])
    return parser


# `bouquet embed --ray`'s: the job on a Ray cluster (docs/ray.md); --ray's value is RayConfig.address.
_RAY = _option(
    "--ray",
    "run on a Ray cluster through Ray Data, one engine per actor: ADDRESS as ray.init takes it ('local': a new local "
    "cluster; 'auto': the running one); none: ray.init's default ($RAY_ADDRESS, else the cluster `ray start` started "
    "here, else a new local one). Put it after INPUT, or write --ray=ADDRESS",
    nargs="?",
    const="",
    metavar="ADDRESS",
)
_RAY_FIELDS = (
    _option(
        "--actors", "engines at once, one per actor (default: as many as the cluster's CPUs or GPUs hold)", type=int
    ),
    _option("--cpus-per-actor", f"each engine's threads (default {RayConfig.cpus_per_actor:g})", type=float),
    _option("--gpus-per-actor", f"default {RayConfig.gpus_per_actor:g}", type=float),
    _option(
        "--batch-rows",
        f"texts a batch, the work a dead actor's retry redoes (default {RayConfig.batch_rows})",
        type=int,
    ),
)


def _add_embed_parser(commands: argparse._SubParsersAction) -> None:
    embed = commands.add_parser("embed", help="embed a .jsonl or .txt file into a float32 .npy")
    embed.add_argument(
        "input",
        type=Path,
        help='.jsonl with a "text" field per line, or .txt with a text per line; with --ray also .parquet (or a '
        'directory of them) with "id" and "text" columns',
    )
    embed.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        help="output .npy, [N, dim] float32; with --ray also a new directory for parquet shards of id and embedding",
    )
    embed.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        help="L2-normalise each row (default: as the model's sentence-transformers Normalize module says)",
    )
    embed.add_argument("--batch-tokens", type=int, default=EmbedConfig.batch_tokens)
    embed.add_argument("--prompt-name", help="one of the model's sentence-transformers prompts")
    _add(embed, [*ENGINE_OPTIONS, _LOG_LEVEL])
    _add(embed.add_argument_group("on a Ray cluster"), [_RAY, *_RAY_FIELDS])


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given, as `create_engine_config`'s (and `bouquet.ray.Embedder`'s) keyword arguments."""
    given = _given(args, ENGINE_OPTIONS)
    if "cuda_graphs" in given:  # the flag turns graphs on or off; their buckets are not set per run
        given["cuda_graphs"] = CudaGraphConfig(enabled=given["cuda_graphs"])
    return given


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return create_engine_config(**engine_options(args))


def embed_config(args: argparse.Namespace) -> EmbedConfig:
    return EmbedConfig(
        input_path=args.input,
        output_path=args.output,
        normalize=args.normalize,
        batch_tokens=args.batch_tokens,
        ray=ray_config(args),
    )


def ray_config(args: argparse.Namespace) -> RayConfig | None:
    given = _given(args, _RAY_FIELDS)
    if args.ray is None:
        if given:
            raise ValueError(f"--{next(iter(given)).replace('_', '-')} is for --ray only")
        return None
    return RayConfig(address=args.ray or None, **given)


def scheduler_config(args: argparse.Namespace, device: str) -> SchedulerConfig:
    return SchedulerConfig.for_device(device, **_given(args, SCHEDULER_OPTIONS))


def replica_config(args: argparse.Namespace) -> ReplicaConfig:
    names = tuple(args.served_model_name or ())
    return ReplicaConfig(token=_replica_token(), served_model_names=names, **_given(args, [*_REPLICA_PROCESS, _DRAIN]))


def served_names_by_model(models: list[str], given: list[str]) -> list[tuple[str, ...]]:
    """serve's --served-model-name values split per model: MODEL=NAME names the model whose directory is called
    MODEL (or is MODEL as given); a bare NAME is the only model's."""
    keys = [{model, Path(model).name} for model in models]
    names: list[list[str]] = [[] for _ in models]
    for value in given:
        key, separator, name = value.rpartition("=")
        if not separator and len(models) > 1:
            raise ValueError(f"--served-model-name {value!r}: with several --model, write MODEL=NAME")
        index = next((i for i, k in enumerate(keys) if key in k), None) if separator else 0
        if index is None:
            known = ", ".join(Path(model).name for model in models)
            raise ValueError(f"--served-model-name {value!r}: no --model called {key!r} (models: {known})")
        names[index].append(name)
    flat = [name for model_names in names for name in model_names]
    duplicates = sorted({name for name in flat if flat.count(name) > 1})
    if duplicates:
        raise ValueError(f"--served-model-name: {', '.join(duplicates)} given for more than one model")
    return [tuple(model_names) for model_names in names]


def _replica_token() -> str | None:
    """The token between gateways and replicas: from the environment only, never argv (`ps` shows argv);
    `serve` makes one for its own children."""
    return os.environ.get("BOUQUET_REPLICA_TOKEN") or None


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is not None:
        key = args.api_key_file.read_text(encoding="utf-8").strip()
        if not key:
            raise ValueError(f"{args.api_key_file} holds no API key")
        return key
    return args.api_key or os.environ.get("BOUQUET_API_KEY")


def _bundled_model_dirs() -> tuple[Path, ...]:
    """The bundled model, for its published names (all-MiniLM-L6-v2); a gateway without it, or in front of another
    model, tokenizes with what the replica's Info sends."""
    try:
        return (default_model_path(),)
    except FileNotFoundError:
        return ()


# The options that map one to one onto GatewayConfig fields (the rest are built above by hand).
_GATEWAY_FIELDS = (
    _HOST, _PORT, _DRAIN, _WORKERS, _DNS_INTERVAL, *_REPLICA_TLS,
    *(option for option in GATEWAY_LIMIT_OPTIONS if option.flag != "--cors-allow-origin"),
)  # fmt: skip


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """Under `--workers N` this process supervises N gateways, each given this one's arguments but --workers and
    the API key."""
    return GatewayConfig(
        replicas=tuple(args.replica or ()),
        replicas_dns=tuple(args.replicas_dns or ()),
        model_dirs=tuple(Path(path) for path in args.model) if args.model else _bundled_model_dirs(),
        api_key=_api_key(args),
        replica_token=_replica_token(),
        cors_allow_origin=tuple(args.cors_allow_origin or ()),
        worker_args=_argv(GATEWAY_OPTIONS, vars(args)) if args.workers > 1 else (),
        **_given(args, _GATEWAY_FIELDS),
    )


def serve_config(args: argparse.Namespace) -> ServeConfig:
    config = ServeConfig(device=args.device, api_key=_api_key(args), **_given(args, [*_SERVE_FIELDS, _DRAIN]))
    # Each model's replicas serve the directory resolved here; every child drains in the time serve waits for it.
    models = [str(model) for model in args.model or [default_model_path()]]
    values = {**vars(args), "model": models, "drain_seconds": config.drain_seconds}
    names = served_names_by_model(models, args.served_model_name or [])
    replica_args = tuple(
        (*_argv(REPLICA_OPTIONS, {**values, "model": model}), *_SERVED_NAME.argv(model_names))
        for model, model_names in zip(models, names, strict=True)
    )
    return replace(config, replica_args=replica_args, gateway_args=_argv(GATEWAY_OPTIONS, values))


def _run_serve(args: argparse.Namespace) -> int:
    from bouquet.gateway.serve import run_serve

    return run_serve(serve_config(args))


def _run_gateway(args: argparse.Namespace) -> int:
    from bouquet.gateway.server import run_gateway

    return run_gateway(gateway_config(args))


def _run_embed(args: argparse.Namespace) -> int:
    config = embed_config(args)
    if config.ray is not None:
        return _run_embed_on_ray(args, config)
    # Imported here so `bouquet --help` and the gateway never pay for torch.
    from bouquet.engine.engine import Engine
    from bouquet.offline.embed import embed_file
    from bouquet.tokenizer import TextTokenizer, tokenizer_json

    engine = Engine(engine_config(args))
    try:
        prompt = engine.spec.prompt(args.prompt_name)
        spec = engine.spec
        tokenizer = TextTokenizer(tokenizer_json(spec.tokenizer_file, spec.do_lower_case), engine.max_seq_length)
        count = embed_file(engine, tokenizer, config, prompt)
    finally:
        engine.close()
    print(f"wrote {count} embeddings of dimension {engine.dimension} to {args.output}", file=sys.stderr)
    return 0


def _run_embed_on_ray(args: argparse.Namespace, config: EmbedConfig) -> int:
    if importlib.util.find_spec("ray") is None:
        raise ValueError("--ray needs Ray Data: pip install 'ray[data]'")
    from bouquet.model_dir import read_model_dir
    from bouquet.offline.ray_job import embed_on_ray

    options = engine_options(args)
    if "model" in options:  # the actors' working directory is not this one
        options["model"] = str(Path(options["model"]).resolve())
    read_model_dir(Path(options.get("model") or default_model_path())).prompt(args.prompt_name)  # fails here, once
    embedder = {"normalize": args.normalize, "batch_tokens": args.batch_tokens, "prompt_name": args.prompt_name}
    count = embed_on_ray(config, {**options, **embedder})
    print(f"wrote {count} embeddings to {args.output}", file=sys.stderr)
    return 0


def _run_replica(args: argparse.Namespace) -> int:
    from bouquet import event_loop
    from bouquet.replica.server import run_replica

    engine = engine_config(args)
    return event_loop.run(run_replica(engine, scheduler_config(args, engine.device), replica_config(args)))


_COMMANDS = {"embed": _run_embed, "replica": _run_replica, "serve": _run_serve, "gateway": _run_gateway}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"bouquet {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
