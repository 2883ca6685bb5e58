"""The command's options: every config field a user may set has a flag that lands in it, and `bouquet serve` passes
every replica and gateway option through to its child processes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from bouquet.cli import (
    build_parser,
    embed_config,
    engine_config,
    gateway_config,
    main,
    replica_config,
    scheduler_config,
    serve_config,
)
from bouquet.config import (
    CudaGraphConfig,
    EmbedConfig,
    EngineConfig,
    GatewayConfig,
    RayConfig,
    ReplicaConfig,
    SchedulerConfig,
    ServeConfig,
    resolve_dtype,
)
from bouquet.gateway.testing import children, free_port, start_serve

# Fields with no flag of their own, each commented as internal in config.py (or set through another flag); the
# replica token comes from $BOUQUET_REPLICA_TOKEN only, as argv shows in `ps`.
INTERNAL = {"token_buckets", "seq_buckets", "max_graphs", "max_steps_in_flight", "sort_window", "worker_args",
            "replica_args", "gateway_args", "token", "replica_token"}  # fmt: skip
# Flags whose parsed name is not the field's name.
FIELD_OF = {"model": "model_path", "input": "input_path", "output": "output_path",
            "served_model_name": "served_model_names"}  # fmt: skip
GATEWAY_FIELD_OF = {"replica": "replicas", "model": "model_dirs"}
SERVE_PICKS = {"--listen", "--metrics-port", "--replica"}  # serve gives these itself, per child
# What serve has no use for: its replicas are its own children on Unix sockets (no TLS, no DNS).
NOT_FOR_SERVE = {"--tls-cert", "--tls-key", "--tls-client-ca", "--replica-tls-ca", "--replica-tls-cert",
                 "--replica-tls-key", "--replicas-dns", "--dns-interval"}  # fmt: skip


def command(name: str) -> argparse.ArgumentParser:
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subcommands.choices[name]


def flags(name: str) -> set[str]:
    return {action.option_strings[0] for action in command(name)._actions if action.dest != "help"}


def config_fields(name: str, field_of: dict[str, str] = FIELD_OF) -> set[str]:
    return {field_of.get(action.dest, action.dest) for action in command(name)._actions}


def unflagged(config: type, command_name: str, field_of: dict[str, str] = FIELD_OF) -> set[str]:
    return {field.name for field in fields(config)} - config_fields(command_name, field_of) - INTERNAL


def test_every_config_field_has_a_flag_or_is_internal():
    for config in (EngineConfig, SchedulerConfig, ReplicaConfig):
        assert unflagged(config, "replica") == set(), config.__name__
    assert unflagged(EngineConfig, "embed") == set()
    assert unflagged(EmbedConfig, "embed") == set()
    assert unflagged(RayConfig, "embed", {**FIELD_OF, "ray": "address"}) == set()  # --ray ADDRESS
    assert unflagged(GatewayConfig, "gateway", GATEWAY_FIELD_OF) == set()
    assert unflagged(ServeConfig, "serve") == set()
    assert {field.name for field in fields(CudaGraphConfig)} - INTERNAL == {"enabled"}  # set by --cuda-graphs


def test_serve_takes_every_replica_and_gateway_option():
    assert flags("replica") - SERVE_PICKS - NOT_FOR_SERVE <= flags("serve")
    assert flags("gateway") - SERVE_PICKS - NOT_FOR_SERVE <= flags("serve")


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_replica_flags_land_in_their_configs(tmp_path: Path):
    table = tmp_path / "table.json"
    args = parse(
        "replica", "--model", str(tmp_path), "--device", "cpu", "--dtype", "bfloat16", "--attention-backend", "sdpa",
        "--attention-table", str(table), "--no-cuda-graphs", "--num-threads", "3", "--cpu-workers", "1",
        "--cpu-lone-step-tokens", "64", "--cpu-token-buckets", "8", "--cpu-warmup-tokens", "512",
        "--max-batch-tokens", "300", "--max-batch-seqs",
        "7", "--max-queue-tokens", "900", "--listen", "127.0.0.1:0", "--metrics-port", "9100", "--drain-seconds", "5",
    )  # fmt: skip
    engine = engine_config(args)
    assert engine == EngineConfig(
        tmp_path, "cpu", "bfloat16", "sdpa", num_threads=3, cpu_workers=1, cpu_lone_step_tokens=64,
        cpu_token_buckets=8, cpu_warmup_tokens=512, cuda_graphs=CudaGraphConfig(enabled=False), attention_table=table,
    )  # fmt: skip
    assert scheduler_config(args, engine.device) == SchedulerConfig(300, max_batch_seqs=7, max_queue_tokens=900)
    assert replica_config(args) == ReplicaConfig("127.0.0.1:0", 9100, 5.0)


def test_flags_not_given_leave_the_configs_defaults(tmp_path: Path):
    args = parse("replica", "--model", str(tmp_path), "--device", "cpu")
    assert engine_config(args) == EngineConfig(tmp_path, "cpu", resolve_dtype("auto", "cpu"))  # the probe's
    assert scheduler_config(args, "cpu") == SchedulerConfig.for_device("cpu")
    assert replica_config(args) == ReplicaConfig()
    assert engine_config(parse("replica", "--cuda-graphs", "--device", "cpu")).cuda_graphs == CudaGraphConfig()


def test_gateway_flags_land_in_its_config_and_its_workers_arguments(tmp_path: Path):
    args = parse(
        "gateway", "--replica", "10.0.0.1:5", "--replica", "10.0.0.2:5", "--model", str(tmp_path), "--port", "9000",
        "--workers", "2", "--api-key", "secret", "--max-attempts", "2", "--request-timeout", "7.5",
        "--probe-interval", "0.25", "--tokenizer-threads", "3", "--max-inputs", "10", "--drain-seconds", "4",
        "--max-connections", "50", "--max-header-bytes", "4096", "--header-timeout", "2", "--body-timeout", "3",
        "--idle-timeout", "9.5",
    )  # fmt: skip
    config = gateway_config(args)
    assert (config.replicas, config.model_dirs, config.port, config.workers) == (
        ("10.0.0.1:5", "10.0.0.2:5"), (tmp_path,), 9000, 2,
    )  # fmt: skip
    assert (config.max_attempts, config.request_timeout, config.probe_interval) == (2, 7.5, 0.25)
    assert (config.tokenizer_threads, config.max_inputs, config.drain_seconds, config.api_key) == (3, 10, 4.0, "secret")
    assert (config.max_connections, config.max_header_bytes) == (50, 4096)
    assert (config.header_timeout, config.body_timeout, config.idle_timeout) == (2.0, 3.0, 9.5)
    assert config.worker_args == (
        "--replica=10.0.0.1:5", "--replica=10.0.0.2:5", f"--model={tmp_path}", "--host=127.0.0.1", "--port=9000",
        "--drain-seconds=4.0", "--max-inputs=10", "--max-attempts=2", "--request-timeout=7.5",
        "--probe-interval=0.25", "--tokenizer-threads=3", "--max-connections=50", "--max-header-bytes=4096",
        "--header-timeout=2.0", "--body-timeout=3.0", "--idle-timeout=9.5", "--log-level=WARNING",
    )  # fmt: skip


def test_ray_flags_land_in_the_embed_config():
    assert embed_config(parse("embed", "in.jsonl", "-o", "out.npy")).ray is None
    assert embed_config(parse("embed", "in.jsonl", "-o", "out.npy", "--ray")).ray == RayConfig()
    argv = ["corpus", "-o", "out", "--ray", "10.0.0.1:6379", "--actors", "3", "--cpus-per-actor", "2",
            "--gpus-per-actor", "0.5", "--batch-rows", "256"]  # fmt: skip
    assert embed_config(parse("embed", *argv)).ray == RayConfig("10.0.0.1:6379", 3, 2.0, 0.5, 256)
    assert embed_config(parse("embed", "--ray=auto", "in.parquet", "-o", "out")).ray == RayConfig("auto")


def test_serve_passes_on_only_what_it_was_given_and_what_it_resolved(tmp_path: Path):
    config = serve_config(parse("--log-level", "INFO", "serve", "--model", str(tmp_path), "--ready-timeout", "60"))
    assert config.ready_timeout == 60.0
    assert config.replica_args == ((
        f"--model={tmp_path}", "--device=auto", "--dtype=auto", "--attention-backend=auto", "--drain-seconds=30.0",
        "--log-level=INFO",
    ),)  # fmt: skip
    assert config.gateway_args == (
        f"--model={tmp_path}", "--host=127.0.0.1", "--port=8080", "--drain-seconds=30.0", "--log-level=INFO",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gateway", "--replica", "h:1", "--request-timeout", "0"], "request_timeout must be positive"),
        (["gateway", "--replica", "h:1", "--probe-interval", "-1"], "probe_interval must be positive"),
        (["gateway", "--replica", "h:1", "--tokenizer-threads", "0"], "tokenizer_threads must be positive"),
        (["gateway", "--replica", "h:1", "--max-attempts", "0"], "max_attempts must be positive"),
        (["gateway", "--replica", "h:1", "--max-connections", "0"], "max_connections must be positive"),
        (["gateway", "--replica", "h:1", "--idle-timeout", "0"], "idle_timeout must be positive"),
        (["serve", "--ready-timeout", "0"], "ready_timeout must be positive"),
        (["serve", "--replicas", "0"], "replicas and workers must be positive"),
        (["embed", "in.jsonl", "-o", "o.npy", "--ray", "--actors", "0"], "actors must be positive"),
        (["embed", "in.jsonl", "-o", "o.npy", "--ray", "--batch-rows", "0"], "batch_rows must be positive"),
        (["embed", "in.jsonl", "-o", "o.npy", "--batch-rows", "8"], "--batch-rows is for --ray only"),
        (["embed", "in.parquet", "-o", "o.npy"], "input must be .jsonl or .txt, got in.parquet"),
    ],
)
def test_bad_values_are_refused_before_anything_starts(argv: list[str], message: str, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_engine_values_are_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="num_threads must be positive"):
        engine_config(parse("replica", "--model", str(tmp_path), "--device", "cpu", "--num-threads", "0"))
    with pytest.raises(ValueError, match="drain_seconds"):
        replica_config(parse("replica", "--drain-seconds", "-1"))


def replica_samples(model: Path, tmp_path: Path) -> dict[str, str]:
    """A value for every option serve passes to a replica (a value other than its default where it can run on
    this CPU), as given on serve's command line, keyed by flag."""
    return {
        "--model": str(model), "--device": "cpu", "--dtype": "float32", "--attention-backend": "sdpa",
        "--attention-table": str(tmp_path / "table.json"), "--cuda-graphs": "", "--num-threads": "1",
        "--cpu-workers": "1", "--cpu-lone-step-tokens": "64", "--cpu-token-buckets": "8", "--cpu-warmup-tokens": "256",
        "--max-batch-tokens": "512",
        "--max-batch-seqs": "32", "--max-queue-tokens": "100000", "--drain-seconds": "20.0", "--log-level": "INFO",
        "--served-model-name": "text-embedding-3-small",
    }  # fmt: skip


GATEWAY_SAMPLES = {
    "--max-inputs": "100", "--max-request-tokens": "50000", "--max-payload-bytes": "1000000",
    "--max-inflight-tokens": "100000", "--admission-seconds": "1.5", "--admission-wait": "0.5",
    "--max-concurrent-requests": "64", "--chunk-tokens": "256", "--max-attempts": "2", "--request-timeout": "60.0",
    "--probe-interval": "0.25", "--tokenizer-threads": "1", "--max-connections": "5000", "--max-header-bytes": "8192",
    "--header-timeout": "20.0", "--body-timeout": "20.0", "--idle-timeout": "60.0", "--token-id-input": "",
    "--allow-unknown-fields": "", "--cors-allow-origin": "http://a.example", "--long-input": "chunk",
}  # fmt: skip


def as_given(samples: dict[str, str]) -> list[str]:
    """Flags with an empty sample are switches, given in their `--no-` form (the non-default one)."""
    return [f"--no-{flag[2:]}" if value == "" else f"{flag}={value}" for flag, value in samples.items()]


def test_serve_passes_every_replica_and_gateway_option_to_its_children(minilm_path: Path, tmp_path: Path):
    replica_given = as_given(replica_samples(minilm_path, tmp_path))
    gateway_given = as_given(GATEWAY_SAMPLES)
    # Every option is sampled: a new one fails here until it is given and seen to arrive.
    replica_flags = flags("replica") - SERVE_PICKS - NOT_FOR_SERVE
    assert {arg.split("=")[0].replace("--no-", "--") for arg in replica_given} == replica_flags
    assert set(GATEWAY_SAMPLES) | {"--model", "--host", "--port", "--drain-seconds", "--log-level"} == flags(
        "gateway"
    ) - SERVE_PICKS - NOT_FOR_SERVE - {"--workers", "--api-key", "--api-key-file"}
    port = free_port()
    serve = start_serve(port, "--replicas", "2", *replica_given, *gateway_given)
    try:
        serve.wait_ready()
        commands = children(serve.process.pid)
        replicas = [command.split() for command in commands if "bouquet.cli replica" in command]
        gateways = [command.split() for command in commands if "bouquet.cli gateway" in command]
        assert len(replicas) == 2 and len(gateways) == 1
        for replica in replicas:
            assert set(replica_given) <= set(replica)
        shared = {f"--model={minilm_path}", "--host=127.0.0.1", f"--port={port}", "--drain-seconds=20.0"}
        assert {*gateway_given, *shared, "--log-level=INFO"} <= set(gateways[0])
    finally:
        assert serve.stop() == 0


def test_serve_reports_a_replica_option_its_replica_refuses():
    port = free_port()
    command = [sys.executable, "-m", "bouquet.cli", "serve", "--port", str(port), "--device", "cpu", "--cpu-workers",
               "0"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 1
    assert "cpu_workers must be positive, got 0" in result.stderr
    assert "waiting for replicas to load: replica0 exited" in result.stderr


def test_serve_gives_each_model_its_own_replicas(tmp_path: Path):
    first, second = tmp_path / "a", tmp_path / "b"
    config = serve_config(parse("serve", "--model", str(first), "--model", str(second), "--dtype", "bfloat16"))
    assert [args[0] for args in config.replica_args] == [f"--model={first}", f"--model={second}"]
    assert all("--dtype=bfloat16" in args for args in config.replica_args)
    assert config.gateway_args[:2] == (f"--model={first}", f"--model={second}")


def test_api_key_from_a_file(tmp_path: Path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    config = gateway_config(parse("gateway", "--replica", "h:1", "--api-key-file", str(key_file)))
    assert config.api_key == "s3cret"  # and no key in the command line `ps` shows
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="holds no API key"):
        gateway_config(parse("gateway", "--replica", "h:1", "--api-key-file", str(key_file)))
