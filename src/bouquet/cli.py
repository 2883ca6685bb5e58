"""The `bouquet` command: builds each component's config in one place and runs it."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from bouquet.config import (
    DTYPES,
    EmbedConfig,
    GatewayConfig,
    SchedulerConfig,
    ServeConfig,
    create_engine_config,
    default_model_path,
)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local model directory (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    parser.add_argument(
        "--attention-backend", default="auto",
        help="auto (default: cpu_varlen on the CPU, per-length fastest on a GPU), cpu_varlen, sdpa, flash_attn, "
        "flashinfer",
    )  # fmt: skip
    parser.add_argument(
        "--cpu-workers", type=int,
        help="CPU: steps computed at once, each on a share of the threads (default: 2 with 2 or more threads; "
        "1 gives a lone request every thread)",
    )  # fmt: skip


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bouquet", description="Fast text-embedding serving.")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)
    embed = commands.add_parser("embed", help="embed a .jsonl or .txt file into a float32 .npy")
    embed.add_argument("input", type=Path, help='.jsonl with a "text" field per line, or .txt with a text per line')
    embed.add_argument("-o", "--output", type=Path, required=True, help="output .npy, [N, dim] float32")
    embed.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        help="L2-normalise each row (default: as the model's sentence-transformers Normalize module says)",
    )
    embed.add_argument("--batch-tokens", type=int, default=EmbedConfig.batch_tokens)
    embed.add_argument("--prompt-name", help="one of the model's sentence-transformers prompts")
    _add_engine_args(embed)
    _add_replica_parser(commands)
    _add_serve_parser(commands)
    _add_gateway_parser(commands)
    return parser


def _add_replica_parser(commands: argparse._SubParsersAction) -> None:
    replica = commands.add_parser("replica", help="serve one model over gRPC: token-budget scheduler plus engine")
    replica.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT for gRPC (port 0: any free port)")
    replica.add_argument(
        "--max-batch-tokens", type=int, help="token budget per step (default: the device's measured knee)"
    )
    replica.add_argument("--max-batch-seqs", type=int, default=SchedulerConfig.max_batch_seqs)
    replica.add_argument("--max-queue-tokens", type=int, default=SchedulerConfig.max_queue_tokens)
    replica.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics over HTTP on this port")
    replica.add_argument("--drain-seconds", type=float, default=60.0, help="after SIGTERM, time to finish the queue")
    _add_engine_args(replica)


# Gateway limits, given to `bouquet gateway` directly or passed through by `bouquet serve`.
_GATEWAY_LIMITS = ("max_inputs", "max_request_tokens", "max_payload_bytes", "max_inflight_tokens", "chunk_tokens")


def _add_gateway_limit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $BOUQUET_API_KEY, if set)")
    parser.add_argument("--max-inputs", type=int, help=f"inputs a request (default {GatewayConfig.max_inputs})")
    parser.add_argument("--max-request-tokens", type=int, help=f"default {GatewayConfig.max_request_tokens}")
    parser.add_argument("--max-payload-bytes", type=int, help=f"default {GatewayConfig.max_payload_bytes}")
    parser.add_argument(
        "--max-inflight-tokens",
        type=int,
        help=f"per gateway process; over it, 429 (default {GatewayConfig.max_inflight_tokens})",
    )
    parser.add_argument("--chunk-tokens", type=int, help="tokens a chunk (default: 4x the replica's batch budget)")
    parser.add_argument("--drain-seconds", type=float, default=30.0, help="after SIGTERM, time to finish requests")


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="gateway plus N local replicas: the HTTP server")
    serve.add_argument("--model", help="local model directory (default: the bundled all-MiniLM-L6-v2)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--replicas", type=int, default=1, help="local `bouquet replica` processes")
    serve.add_argument("--workers", type=int, default=1, help="gateway processes sharing the port")
    serve.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    serve.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    serve.add_argument("--max-batch-tokens", type=int, help="each replica's token budget a step")
    serve.add_argument("--cpu-workers", type=int, help="each CPU replica's engine workers (see `bouquet replica`)")
    serve.add_argument("--attention-backend", default="auto", help="each replica's (see `bouquet replica`)")
    _add_gateway_limit_args(serve)


def _add_gateway_parser(commands: argparse._SubParsersAction) -> None:
    gateway = commands.add_parser("gateway", help="the HTTP gateway alone, in front of running replicas")
    gateway.add_argument("--replica", action="append", required=True, help="HOST:PORT of a replica (repeat)")
    gateway.add_argument(
        "--model",
        action="append",
        help="local model directory to tokenize with instead of the tokenizer the replica sends (repeat; "
        "default: the bundled model, if installed)",
    )
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8080)
    gateway.add_argument("--workers", type=int, default=1, help="gateway processes sharing the port")
    _add_gateway_limit_args(gateway)


def _limit_overrides(args: argparse.Namespace) -> dict[str, int]:
    return {name: getattr(args, name) for name in _GATEWAY_LIMITS if getattr(args, name) is not None}


def _limit_args(args: argparse.Namespace) -> list[str]:
    """The limits given, as arguments to pass on to each gateway process."""
    return [f"--{name.replace('_', '-')}={value}" for name, value in _limit_overrides(args).items()]


def _run_serve(args: argparse.Namespace) -> int:
    from bouquet.gateway.serve import run_serve

    config = ServeConfig(
        model_path=Path(args.model) if args.model else default_model_path(), host=args.host, port=args.port,
        replicas=args.replicas, workers=args.workers, device=args.device, dtype=args.dtype,
        max_batch_tokens=args.max_batch_tokens, cpu_workers=args.cpu_workers,
        attention_backend=args.attention_backend, api_key=args.api_key or os.environ.get("BOUQUET_API_KEY"),
        gateway_args=tuple(_limit_args(args)),
        drain_seconds=args.drain_seconds,
    )  # fmt: skip
    return run_serve(config)


def _bundled_model_dirs() -> tuple[Path, ...]:
    """The bundled model, for its published names (all-MiniLM-L6-v2); a gateway without it, or in front of another
    model, tokenizes with what the replica's Info sends."""
    try:
        return (default_model_path(),)
    except FileNotFoundError:
        return ()


def _run_gateway(args: argparse.Namespace) -> int:
    from bouquet.gateway.server import run_gateway

    model_dirs = tuple(Path(path) for path in args.model) if args.model else _bundled_model_dirs()
    config = GatewayConfig(
        replicas=tuple(args.replica), model_dirs=model_dirs, host=args.host, port=args.port,
        api_key=args.api_key or os.environ.get("BOUQUET_API_KEY"), drain_seconds=args.drain_seconds,
        workers=args.workers, worker_args=_gateway_worker_args(args) if args.workers > 1 else (),
        **_limit_overrides(args),
    )  # fmt: skip
    return run_gateway(config)


def _gateway_worker_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Each worker's arguments under `bouquet gateway --workers N`: the parent's, less --workers and the API key
    (which goes by environment, where `ps` does not show it)."""
    passed = [f"--replica={address}" for address in args.replica]
    passed += [f"--model={path}" for path in args.model or ()]
    passed += [f"--host={args.host}", f"--port={args.port}", f"--drain-seconds={args.drain_seconds}"]
    return (*passed, *_limit_args(args))


def _run_embed(args: argparse.Namespace) -> int:
    # Imported here so `bouquet --help` and the gateway never pay for torch.
    from bouquet.engine.engine import Engine
    from bouquet.offline.embed import embed_file
    from bouquet.tokenizer import TextTokenizer, tokenizer_json

    embed_config = EmbedConfig(
        input_path=args.input,
        output_path=args.output,
        normalize=args.normalize,
        batch_tokens=args.batch_tokens,
    )
    engine = Engine(create_engine_config(args.model, args.device, args.dtype, args.attention_backend, args.cpu_workers))
    try:
        prompt = engine.spec.prompt(args.prompt_name)
        spec = engine.spec
        tokenizer = TextTokenizer(tokenizer_json(spec.tokenizer_file, spec.do_lower_case), engine.max_seq_length)
        count = embed_file(engine, tokenizer, embed_config, prompt)
    finally:
        engine.close()
    print(f"wrote {count} embeddings of dimension {engine.dimension} to {args.output}", file=sys.stderr)
    return 0


def _run_replica(args: argparse.Namespace) -> int:
    from bouquet import event_loop
    from bouquet.replica.server import ReplicaConfig, run_replica

    engine_config = create_engine_config(args.model, args.device, args.dtype, args.attention_backend, args.cpu_workers)
    scheduler_config = SchedulerConfig.for_device(
        engine_config.device,
        args.max_batch_tokens,
        max_batch_seqs=args.max_batch_seqs,
        max_queue_tokens=args.max_queue_tokens,
    )
    replica_config = ReplicaConfig(args.listen, args.metrics_port, args.drain_seconds)
    return event_loop.run(run_replica(engine_config, scheduler_config, replica_config))


_COMMANDS = {"embed": _run_embed, "replica": _run_replica, "serve": _run_serve, "gateway": _run_gateway}


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"bouquet {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
