"""The `bouquet` command. Every option a config field takes is declared once, on the field (config.py), and derived
from there for each command that takes that config (flags.py); the configs are built from the parsed options here,
in one place; and `serve` and `gateway --workers` hand each child process its config whole (`--config FILE`), never
re-spelled as arguments."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from bouquet.config import (
    CudaGraphConfig,
    EmbedConfig,
    EngineConfig,
    GatewayConfig,
    RayConfig,
    ReplicaConfig,
    SchedulerConfig,
    ServeConfig,
    default_model_path,
    resolve_device,
    resolve_dtype,
)
from bouquet.flags import add_options, build, given, merged, options_of, read_config_file

# Each command's options, derived from the configs' fields (flags.py); the skipped ones are set otherwise.
ENGINE_OPTIONS = options_of(EngineConfig)
SCHEDULER_OPTIONS = options_of(SchedulerConfig)
REPLICA_OPTIONS = options_of(ReplicaConfig)
GATEWAY_OPTIONS = options_of(GatewayConfig)
EMBED_OPTIONS = options_of(EmbedConfig, skip=["ray"])
RAY_OPTIONS = options_of(RayConfig)
SERVE_OPTIONS = options_of(ServeConfig)
# What serve does not take from its user: it gives these to each child itself (its replicas are its own children on
# private Unix sockets: no TLS, no DNS), or they are its own (ServeConfig's host, port, workers, drain).
_SERVE_SETS = [
    "model_path", "listen", "metrics_port", "tls_cert", "tls_key", "tls_client_ca", "served_model_names", "insecure",
]  # fmt: skip
# Its gateways take their own TLS from serve's user (--tls-cert, --tls-key, --tls-client-ca: the gateway's options,
# as `bouquet gateway` takes them); the TLS between gateway and replicas is serve's own choice, none, on its sockets.
_SERVE_GATEWAY_SETS = [
    "replicas", "replicas_dns", "dns_interval", "replica_tls_ca", "replica_tls_cert", "replica_tls_key", "model_dirs",
    "host", "port", "drain_seconds", "workers", "replica_tls_server_name",
]  # fmt: skip
_SERVE_ENGINE = options_of(EngineConfig, skip=_SERVE_SETS)
_SERVE_REPLICA = options_of(ReplicaConfig, skip=[*_SERVE_SETS, "drain_seconds"])
_SERVE_GATEWAY = options_of(GatewayConfig, skip=_SERVE_GATEWAY_SETS)


def _add_command_options(parser: argparse.ArgumentParser) -> None:
    """What every command takes beside its config's options (the log level works before the command too)."""
    parser.add_argument("--log-level", default=argparse.SUPPRESS, help="default WARNING")


def _add_config_file(parser: argparse.ArgumentParser, sections: str) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        help=f"JSON file of this command's config, {sections}, field names as the options' with '_' "
        "(`bouquet serve` hands its children theirs so); options given beside it override its values",
    )


def _add_api_key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $BOUQUET_API_KEY, if set)")
    # From a file (a Kubernetes Secret's mount): unlike --api-key, it never shows in `ps`.
    parser.add_argument("--api-key-file", type=Path, help="read the API key from this file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bouquet", description="Fast text-embedding serving.")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_embed_parser(commands)
    replica = commands.add_parser("replica", help="serve one model over gRPC: token-budget scheduler plus engine")
    add_options(replica, [*ENGINE_OPTIONS, *SCHEDULER_OPTIONS, *REPLICA_OPTIONS])
    _add_config_file(replica, 'sections "engine", "scheduler" and "replica"')
    _add_command_options(replica)
    serve = commands.add_parser("serve", help="gateway plus N local replicas: the HTTP server")
    serve.add_argument(
        "--model",
        action="append",
        help="local model directory (repeat to serve several, each on its own replicas, routed by name; default: "
        "the bundled all-MiniLM-L6-v2)",
    )
    add_options(serve.add_argument_group("each replica (see `bouquet replica`)"), [*_SERVE_ENGINE, *SCHEDULER_OPTIONS])
    add_options(serve.add_argument_group("each replica (see `bouquet replica`)"), _SERVE_REPLICA)
    serve.add_argument(
        "--served-model-name",
        action="append",
        help="NAME, or MODEL=NAME with several --model (MODEL: the model directory's name): another name requests "
        "may give that model; the first of a model's is the one answers report; /v1/models lists each (repeat)",
    )
    add_options(serve.add_argument_group("each gateway (see `bouquet gateway`)"), _SERVE_GATEWAY)
    add_options(serve, SERVE_OPTIONS)
    _add_api_key(serve)
    _add_command_options(serve)
    gateway = commands.add_parser("gateway", help="the HTTP gateway alone, in front of running replicas")
    add_options(gateway, GATEWAY_OPTIONS)
    _add_api_key(gateway)
    _add_config_file(gateway, 'section "gateway"')
    _add_command_options(gateway)
    return parser


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
    add_options(embed, EMBED_OPTIONS)
    embed.add_argument("--prompt-name", help="one of the model's sentence-transformers prompts")
    add_options(embed, ENGINE_OPTIONS)
    _add_command_options(embed)
    ray = embed.add_argument_group("on a Ray cluster")
    # --ray's value is RayConfig.address; given at all, the job runs on Ray (docs/ray.md).
    ray.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run on a Ray cluster through Ray Data, one engine per actor: ADDRESS as ray.init takes it ('local': a "
        "new local cluster; 'auto': the running one); none: ray.init's default ($RAY_ADDRESS, else the cluster `ray "
        "start` started here, else a new local one). Put it after INPUT, or write --ray=ADDRESS",
    )
    add_options(ray, RAY_OPTIONS)


def engine_options(values: Mapping[str, Any]) -> dict[str, Any]:
    """Engine field values as `create_engine_config`'s (and `bouquet.ray.Embedder`'s) keyword arguments."""
    options = dict(values)
    if "model_path" in options:
        options["model"] = str(options.pop("model_path"))
    if "cuda_graphs" in options:  # the flag turns graphs on or off; their buckets are not set per run
        options["cuda_graphs"] = build(CudaGraphConfig, options["cuda_graphs"])
    if options.get("attention_table") is not None:
        options["attention_table"] = Path(options["attention_table"])
    return options


def engine_config(values: Mapping[str, Any]) -> EngineConfig:
    """The engine's config from its field values, `auto` device and dtype resolved on this machine."""
    options = dict(values)
    device = resolve_device(options.pop("device", "auto"))
    model = options.pop("model_path", None) or default_model_path()
    dtype = resolve_dtype(options.pop("dtype", "auto"), device, Path(model))
    return build(EngineConfig, {**options, "model_path": model, "device": device, "dtype": dtype})


def embed_config(args: argparse.Namespace) -> EmbedConfig:
    return EmbedConfig(
        input_path=args.input, output_path=args.output, ray=ray_config(args), **given(args, EMBED_OPTIONS)
    )


def ray_config(args: argparse.Namespace) -> RayConfig | None:
    values = given(args, RAY_OPTIONS)
    if args.ray is None:
        if values:
            raise ValueError(f"--{next(iter(values)).replace('_', '-')} is for --ray only")
        return None
    return RayConfig(address=args.ray or None, **values)


def scheduler_config(values: Mapping[str, Any], device: str) -> SchedulerConfig:
    return SchedulerConfig.for_device(device, **values)


def replica_config(values: Mapping[str, Any]) -> ReplicaConfig:
    return build(ReplicaConfig, {**values, "token": _replica_token()})


def replica_sections(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """`bouquet replica`'s config sections: its --config file's, overridden by the options given."""
    from_file = read_config_file(args.config)
    unknown = sorted(set(from_file) - {"engine", "scheduler", "replica"})
    if unknown:
        raise ValueError(f"--config {args.config}: no section {', '.join(unknown)} (engine, scheduler, replica)")
    options = {"engine": ENGINE_OPTIONS, "scheduler": SCHEDULER_OPTIONS, "replica": REPLICA_OPTIONS}
    return {name: merged(from_file.get(name, {}), given(args, found)) for name, found in options.items()}


def served_names_by_model(models: list[str], given_names: list[str]) -> list[tuple[str, ...]]:
    """serve's --served-model-name values split per model: MODEL=NAME names the model whose directory is called
    MODEL (or is MODEL as given); a bare NAME is the only model's."""
    keys = [{model, Path(model).name} for model in models]
    names: list[list[str]] = [[] for _ in models]
    for value in given_names:
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


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """Its --config file's fields, overridden by the options given; the key and the replica token from outside
    argv."""
    from_file = read_config_file(args.config)
    unknown = sorted(set(from_file) - {"gateway"})
    if unknown:
        raise ValueError(f"--config {args.config}: no section {', '.join(unknown)} (gateway)")
    values = merged(from_file.get("gateway", {}), given(args, GATEWAY_OPTIONS))
    values.setdefault("replicas", ())
    values.setdefault("model_dirs", _bundled_model_dirs())
    return build(GatewayConfig, {**values, "api_key": _api_key(args), "replica_token": _replica_token()})


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """serve's own config, and each child's whole: per model its replicas' sections, and the gateways'."""
    own = given(args, SERVE_OPTIONS)
    engine = given(args, _SERVE_ENGINE)
    config = ServeConfig(device=engine.get("device", "auto"), api_key=_api_key(args), **own)
    # Each model's replicas serve the directory resolved here; every child drains in the time serve waits for it.
    models = [str(model) for model in args.model or [default_model_path()]]
    names = served_names_by_model(models, args.served_model_name or [])
    replica = {**given(args, _SERVE_REPLICA), "drain_seconds": config.drain_seconds}
    replica_configs = tuple(
        {
            "engine": {**engine, "model_path": model},
            "scheduler": given(args, SCHEDULER_OPTIONS),
            "replica": {**replica, "served_model_names": model_names},
        }
        for model, model_names in zip(models, names, strict=True)
    )
    gateway = {
        **given(args, _SERVE_GATEWAY),
        "model_dirs": models,
        "host": config.host,
        "port": config.port,
        "drain_seconds": config.drain_seconds,
    }
    return replace(config, replica_configs=replica_configs, gateway_config={"gateway": gateway})


def _run_serve(args: argparse.Namespace) -> int:
    from bouquet.processes.serve import run_serve

    return run_serve(serve_config(args))


def _run_gateway(args: argparse.Namespace) -> int:
    from bouquet.processes.gateway_workers import run_gateway

    return run_gateway(gateway_config(args))


def _run_embed(args: argparse.Namespace) -> int:
    config = embed_config(args)
    if config.ray is not None:
        return _run_embed_on_ray(args, config)
    # Imported here so `bouquet --help` and the gateway never pay for torch.
    from bouquet.engine.engine import Engine
    from bouquet.offline.embed import embed_file, offline_tokenizer

    engine = Engine(engine_config(given(args, ENGINE_OPTIONS)))
    try:
        prompt = engine.spec.prompt(args.prompt_name)
        count = embed_file(engine, offline_tokenizer(engine.spec, engine.max_seq_length), config, prompt)
    finally:
        engine.close()
    print(f"wrote {count} embeddings of dimension {engine.dimension} to {args.output}", file=sys.stderr)
    return 0


def _run_embed_on_ray(args: argparse.Namespace, config: EmbedConfig) -> int:
    if importlib.util.find_spec("ray") is None:
        raise ValueError("--ray needs Ray Data: pip install 'ray[data]'")
    from bouquet.model_dir import read_model_dir
    from bouquet.offline.ray_job import embed_on_ray

    options = engine_options(given(args, ENGINE_OPTIONS))
    if "model" in options:  # the actors' working directory is not this one
        options["model"] = str(Path(options["model"]).resolve())
    read_model_dir(Path(options.get("model") or default_model_path())).prompt(args.prompt_name)  # fails here, once
    embedder = {"normalize": config.normalize, "batch_tokens": config.batch_tokens, "prompt_name": args.prompt_name}
    count = embed_on_ray(config, {**options, **embedder})
    print(f"wrote {count} embeddings to {args.output}", file=sys.stderr)
    return 0


def _run_replica(args: argparse.Namespace) -> int:
    from bouquet import event_loop
    from bouquet.replica.server import run_replica

    sections = replica_sections(args)
    engine = engine_config(sections["engine"])
    scheduler = scheduler_config(sections["scheduler"], engine.device)
    return event_loop.run(run_replica(engine, scheduler, replica_config(sections["replica"])))


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
