"""The `bouquet` command: builds each component's config in one place and runs it."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from bouquet.config import DTYPES, EmbedConfig, SchedulerConfig, create_engine_config


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local model directory (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    parser.add_argument("--attention-backend", default="sdpa")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bouquet", description="Fast text-embedding serving.")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)
    embed = commands.add_parser("embed", help="embed a .jsonl or .txt file into a float32 .npy")
    embed.add_argument("input", type=Path, help='.jsonl with a "text" field per line, or .txt with a text per line')
    embed.add_argument("-o", "--output", type=Path, required=True, help="output .npy, [N, dim] float32")
    embed.add_argument("--no-normalize", action="store_true", help="keep raw pooled vectors")
    embed.add_argument("--batch-tokens", type=int, default=EmbedConfig.batch_tokens)
    embed.add_argument("--prompt-name", help="one of the model's sentence-transformers prompts")
    _add_engine_args(embed)
    _add_replica_parser(commands)
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


def _run_embed(args: argparse.Namespace) -> int:
    # Imported here so `bouquet --help` and the gateway never pay for torch.
    from bouquet.engine.engine import Engine
    from bouquet.offline.embed import embed_file
    from bouquet.tokenizer import TextTokenizer

    embed_config = EmbedConfig(
        input_path=args.input,
        output_path=args.output,
        normalize=not args.no_normalize,
        batch_tokens=args.batch_tokens,
    )
    engine = Engine(create_engine_config(args.model, args.device, args.dtype, args.attention_backend))
    try:
        prompt = engine.spec.prompt(args.prompt_name)
        tokenizer = TextTokenizer(engine.spec.tokenizer_file, engine.max_seq_length)
        count = embed_file(engine, tokenizer, embed_config, prompt)
    finally:
        engine.close()
    print(f"wrote {count} embeddings of dimension {engine.dimension} to {args.output}", file=sys.stderr)
    return 0


def _run_replica(args: argparse.Namespace) -> int:
    import asyncio

    from bouquet.replica.server import ReplicaConfig, run_replica

    engine_config = create_engine_config(args.model, args.device, args.dtype, args.attention_backend)
    scheduler_config = SchedulerConfig.for_device(
        engine_config.device,
        args.max_batch_tokens,
        max_batch_seqs=args.max_batch_seqs,
        max_queue_tokens=args.max_queue_tokens,
    )
    replica_config = ReplicaConfig(args.listen, args.metrics_port, args.drain_seconds)
    return asyncio.run(run_replica(engine_config, scheduler_config, replica_config))


_COMMANDS = {"embed": _run_embed, "replica": _run_replica}


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
