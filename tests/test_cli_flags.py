"""The command's options: every config field a user may set is declared once, on the field, and has an option that
lands in it; `bouquet serve` and `gateway --workers` hand each child its config whole (`--config FILE`), so that a
child serve started holds the configs the same options give that command run by hand."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
from test_replica_tls import make_certificates

from bouquet.cli import (
    build_parser,
    embed_config,
    engine_config,
    gateway_config,
    main,
    replica_config,
    replica_sections,
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
from bouquet.flags import write_config_file
from bouquet.gateway.testing import children, free_port, start_serve
from bouquet.processes.gateway_workers import worker_sections

# Fields declared without an option, each commented as internal in config.py or set by cli.py from elsewhere: the
# secrets from the environment or a file (argv shows in `ps`), embed's positional INPUT and -o, --ray ADDRESS, and
# serve's children's configs.
INTERNAL = {
    "token_buckets", "seq_buckets", "max_graphs", "max_steps_in_flight", "sort_window", "token", "replica_token",
    "api_key", "input_path", "output_path", "address", "ray", "device", "replica_configs", "gateway_config",
    "replicas_followed",
}  # fmt: skip
SERVE_PICKS = {"--listen", "--metrics-port", "--replica", "--config"}  # serve gives these itself, per child
# What serve has no use for: its replicas are its own children on Unix sockets (no TLS, no DNS, always a token).
NOT_FOR_SERVE = {"--replica-tls-ca", "--replica-tls-cert", "--replica-tls-key", "--replica-tls-server-name",
                 "--replicas-dns", "--dns-interval", "--insecure"}  # fmt: skip
# A replica's own TLS: serve's options of these names are its gateways' (HTTPS for its clients).
REPLICA_TLS = {"--tls-cert", "--tls-key", "--tls-client-ca"}


def command(name: str) -> argparse.ArgumentParser:
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subcommands.choices[name]


def flags(name: str) -> set[str]:
    return {action.option_strings[0] for action in command(name)._actions if action.dest != "help"}


def dests(name: str) -> set[str]:
    return {action.dest for action in command(name)._actions}


def unflagged(config: type, command_name: str) -> set[str]:
    """Fields of `config` no option of the command sets (a nested config's fields by their dotted path)."""
    names = {f"{f.name}__{inner.name}" if f.name == "cuda_graphs" else f.name for f in fields(config)
             for inner in (fields(CudaGraphConfig) if f.name == "cuda_graphs" else [f])}  # fmt: skip
    return {name.replace("__", ".") for name in names - dests(command_name)} - INTERNAL - {"cuda_graphs.token_buckets",
            "cuda_graphs.seq_buckets", "cuda_graphs.max_graphs"}  # fmt: skip


def test_every_config_field_has_an_option_or_is_internal():
    for config in (EngineConfig, SchedulerConfig, ReplicaConfig):
        assert unflagged(config, "replica") == set(), config.__name__
    assert unflagged(EngineConfig, "embed") == set()
    assert unflagged(EmbedConfig, "embed") == set()
    assert unflagged(RayConfig, "embed") == set()
    assert unflagged(GatewayConfig, "gateway") == set()
    assert unflagged(ServeConfig, "serve") == set()


def test_an_option_takes_its_fields_help_and_default():
    help_of = {action.dest: action.help for action in command("gateway")._actions}
    assert help_of["max_inputs"] == "inputs a request (default 2048)"
    assert help_of["chunk_tokens"] == "tokens a chunk sent to a replica (default: 2x the replica's batch budget)"
    assert "default on" in help_of["token_id_input"]
    switch = next(a for a in command("replica")._actions if a.dest == "cuda_graphs__enabled")
    assert switch.option_strings == ["--cuda-graphs", "--no-cuda-graphs"]


def test_serve_takes_every_replica_and_gateway_option():
    assert flags("replica") - SERVE_PICKS - NOT_FOR_SERVE - REPLICA_TLS <= flags("serve")
    assert flags("gateway") - SERVE_PICKS - NOT_FOR_SERVE - {"--workers"} <= flags("serve")


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def replica_configs(args: argparse.Namespace) -> tuple[EngineConfig, SchedulerConfig, ReplicaConfig]:
    sections = replica_sections(args)
    engine = engine_config(sections["engine"])
    return engine, scheduler_config(sections["scheduler"], engine.device), replica_config(sections["replica"])


def test_replica_flags_land_in_their_configs(tmp_path: Path):
    table = tmp_path / "table.json"
    args = parse(
        "replica", "--model", str(tmp_path), "--device", "cpu", "--dtype", "bfloat16", "--attention-backend", "sdpa",
        "--attention-table", str(table), "--no-cuda-graphs", "--num-threads", "3", "--cpu-workers", "1",
        "--cpu-lone-step-tokens", "64", "--cpu-token-buckets", "8", "--cpu-warmup-tokens", "512",
        "--max-batch-tokens", "300", "--max-batch-seqs",
        "7", "--max-queue-tokens", "900", "--listen", "127.0.0.1:0", "--metrics-port", "9100", "--drain-seconds", "5",
    )  # fmt: skip
    engine, scheduler, replica = replica_configs(args)
    assert engine == EngineConfig(
        tmp_path, "cpu", "bfloat16", "sdpa", num_threads=3, cpu_workers=1, cpu_lone_step_tokens=64,
        cpu_token_buckets=8, cpu_warmup_tokens=512, cuda_graphs=CudaGraphConfig(enabled=False), attention_table=table,
    )  # fmt: skip
    assert scheduler == SchedulerConfig(300, max_batch_seqs=7, max_queue_tokens=900)
    assert replica == ReplicaConfig("127.0.0.1:0", 9100, 5.0)


def test_flags_not_given_leave_the_configs_defaults(tmp_path: Path):
    engine, scheduler, replica = replica_configs(parse("replica", "--model", str(tmp_path), "--device", "cpu"))
    assert engine == EngineConfig(tmp_path, "cpu", resolve_dtype("auto", "cpu", tmp_path))  # the probe's
    assert scheduler == SchedulerConfig.for_device("cpu")
    assert replica == ReplicaConfig()
    assert replica_configs(parse("replica", "--cuda-graphs", "--device", "cpu"))[0].cuda_graphs == CudaGraphConfig()


def test_a_config_file_is_the_configs_and_options_beside_it_override(tmp_path: Path):
    path = write_config_file(tmp_path / "replica.json", {
        "engine": {"model_path": tmp_path, "device": "cpu", "dtype": "float32", "cuda_graphs": {"enabled": False}},
        "scheduler": {"max_batch_tokens": 300}, "replica": {"served_model_names": ("a", "b"), "drain_seconds": 5},
    })  # fmt: skip
    engine, scheduler, replica = replica_configs(parse("replica", "--config", str(path), "--max-batch-tokens", "64"))
    assert engine == EngineConfig(tmp_path, "cpu", "float32", cuda_graphs=CudaGraphConfig(enabled=False))
    assert scheduler == SchedulerConfig(64)
    assert replica == ReplicaConfig(drain_seconds=5.0, served_model_names=("a", "b"))
    path.write_text(json.dumps({"engine": {"no_such_field": 1}}))
    with pytest.raises(ValueError, match="has no field no_such_field"):
        replica_configs(parse("replica", "--config", str(path)))
    path.write_text(json.dumps({"engines": {}}))
    assert main(["replica", "--config", str(path)]) == 2


def test_gateway_flags_land_in_its_config_and_each_worker_gets_it_whole(tmp_path: Path):
    args = parse(
        "gateway", "--replica", "10.0.0.1:5", "--replica", "10.0.0.2:5", "--model", str(tmp_path), "--port", "9000",
        "--workers", "2", "--api-key", "secret", "--max-attempts", "2", "--request-timeout", "7.5",
        "--probe-interval", "0.25", "--tokenizer-threads", "3", "--max-inputs", "10", "--drain-seconds", "4",
        "--max-connections", "50", "--max-header-bytes", "4096", "--header-timeout", "2", "--body-timeout", "3",
        "--idle-timeout", "9.5", "--cors-allow-origin", "http://a.example", "--no-token-id-input",
    )  # fmt: skip
    config = gateway_config(args)
    assert (config.replicas, config.model_dirs, config.port, config.workers) == (
        ("10.0.0.1:5", "10.0.0.2:5"), (tmp_path,), 9000, 2,
    )  # fmt: skip
    assert (config.max_attempts, config.request_timeout, config.probe_interval) == (2, 7.5, 0.25)
    assert (config.tokenizer_threads, config.max_inputs, config.drain_seconds, config.api_key) == (3, 10, 4.0, "secret")
    assert (config.max_connections, config.max_header_bytes) == (50, 4096)
    assert (config.header_timeout, config.body_timeout, config.idle_timeout) == (2.0, 3.0, 9.5)
    assert (config.cors_allow_origin, config.token_id_input) == (("http://a.example",), False)
    path = write_config_file(tmp_path / "worker.json", worker_sections(config))
    assert "secret" not in path.read_text()  # the key goes by environment
    worker = gateway_config(parse("gateway", "--config", str(path)))
    assert worker == replace(config, workers=1, api_key=None)


def test_ray_flags_land_in_the_embed_config():
    assert embed_config(parse("embed", "in.jsonl", "-o", "out.npy")).ray is None
    assert embed_config(parse("embed", "in.jsonl", "-o", "out.npy", "--ray")).ray == RayConfig()
    argv = ["corpus", "-o", "out", "--ray", "10.0.0.1:6379", "--actors", "3", "--cpus-per-actor", "2",
            "--gpus-per-actor", "0.5", "--batch-rows", "256"]  # fmt: skip
    assert embed_config(parse("embed", *argv)).ray == RayConfig("10.0.0.1:6379", 3, 2.0, 0.5, 256)
    assert embed_config(parse("embed", "--ray=auto", "in.parquet", "-o", "out")).ray == RayConfig("auto")
    assert embed_config(parse("embed", "in.txt", "-o", "o.npy", "--no-normalize", "--batch-tokens", "9")) == (
        EmbedConfig(Path("in.txt"), Path("o.npy"), normalize=False, batch_tokens=9)
    )


def test_serve_hands_on_only_what_it_was_given_and_what_it_resolved(tmp_path: Path):
    config = serve_config(parse("serve", "--model", str(tmp_path), "--ready-timeout", "60", "--max-inputs", "9"))
    assert config.ready_timeout == 60.0
    assert config.replica_configs == ({
        "engine": {"model_path": str(tmp_path)}, "scheduler": {},
        "replica": {"drain_seconds": 30.0, "served_model_names": ()},
    },)  # fmt: skip
    assert config.gateway_config == {"gateway": {
        "max_inputs": 9, "model_dirs": [str(tmp_path)], "host": "127.0.0.1", "port": 8080, "drain_seconds": 30.0,
    }}  # fmt: skip


def test_serve_gives_its_tls_options_to_its_gateways_only(tmp_path: Path):
    tls = {"--tls-cert": tmp_path / "s.pem", "--tls-key": tmp_path / "s.key", "--tls-client-ca": tmp_path / "ca.pem"}
    config = serve_config(parse("serve", *(f"{flag}={path}" for flag, path in tls.items())))
    gateway = config.gateway_config["gateway"]
    assert (gateway["tls_cert"], gateway["tls_key"], gateway["tls_client_ca"]) == tuple(tls.values())
    assert not any(name.startswith("tls_") for name in config.replica_configs[0]["replica"])


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
        replica_configs(parse("replica", "--model", str(tmp_path), "--device", "cpu", "--num-threads", "0"))
    with pytest.raises(ValueError, match="drain_seconds"):
        replica_configs(parse("replica", "--drain-seconds", "-1", "--device", "cpu"))


def replica_samples(model: Path, tmp_path: Path) -> dict[str, str]:
    """A value for every option serve passes to a replica (a value other than its default where it can run on
    this CPU), as given on serve's command line, keyed by flag."""
    return {
        "--model": str(model), "--device": "cpu", "--dtype": "float32", "--attention-backend": "sdpa",
        "--attention-table": str(tmp_path / "table.json"), "--cuda-graphs": "", "--cpu-graphs": "",
        "--num-threads": "1",
        "--cpu-workers": "1", "--cpu-lone-step-tokens": "64", "--cpu-token-buckets": "8", "--cpu-warmup-tokens": "256",
        "--max-batch-tokens": "512",
        "--max-batch-seqs": "32", "--max-queue-tokens": "100000", "--drain-seconds": "20.0",
        "--served-model-name": "text-embedding-3-small", "--local-lane": "",
    }  # fmt: skip


GATEWAY_SAMPLES = {
    "--max-inputs": "100", "--max-request-tokens": "50000", "--max-token-vectors": "4096",
    "--max-payload-bytes": "1000000", "--max-image-bytes": "500000", "--max-image-pixels": "4000000",
    "--max-inflight-tokens": "100000", "--admission-seconds": "1.5", "--admission-wait": "0.5",
    "--max-concurrent-requests": "64", "--chunk-tokens": "256", "--max-attempts": "2", "--request-timeout": "60.0",
    "--probe-interval": "0.25", "--tokenizer-threads": "1", "--max-connections": "5000", "--max-header-bytes": "8192",
    "--header-timeout": "20.0", "--body-timeout": "20.0", "--body-min-rate": "500", "--idle-timeout": "60.0",
    "--token-id-input": "",
    "--allow-unknown-fields": "", "--cors-allow-origin": "http://a.example", "--long-input": "chunk",
    "--grpc-port": str(free_port()),  # the gateway listens there: a free one
    "--image-url-origin": "https://images.example", "--image-url-timeout": "5.0",
}  # fmt: skip


def as_given(samples: dict[str, str]) -> list[str]:
    """Flags with an empty sample are switches, given in their non-default form."""
    switched = {"--cuda-graphs": "--no-cuda-graphs", "--cpu-graphs": "--no-cpu-graphs",
                "--token-id-input": "--no-token-id-input", "--local-lane": "--no-local-lane",
                "--allow-unknown-fields": "--allow-unknown-fields"}  # fmt: skip
    return [switched[flag] if value == "" else f"{flag}={value}" for flag, value in samples.items()]


def config_file_of(command_line: str) -> str:
    words = shlex.split(command_line)
    return words[words.index("--config") + 1]


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
@pytest.mark.process
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the gateways' certificates")
def test_serve_hands_each_child_the_configs_its_options_give(minilm_path: Path, tmp_path: Path):
    """A replica serve started holds the configs `bouquet replica` builds from the same options (but the socket
    serve gives it); its gateway those `bouquet gateway` builds (but the replicas, and the shared fields)."""
    replica_given = as_given(replica_samples(minilm_path, tmp_path))
    tls = make_certificates(tmp_path)  # the gateways' HTTPS, mutual (test_replica_tls's CA)
    gateway_tls = {
        "--tls-cert": tls / "replica.pem", "--tls-key": tls / "replica.key", "--tls-client-ca": tls / "ca.pem",
    }  # fmt: skip
    gateway_given = [*as_given(GATEWAY_SAMPLES), *(f"{flag}={path}" for flag, path in gateway_tls.items())]
    # Every option is sampled: a new one fails here until it is given and seen to arrive.
    replica_flags = flags("replica") - SERVE_PICKS - NOT_FOR_SERVE - REPLICA_TLS - {"--log-level"}
    assert set(replica_samples(minilm_path, tmp_path)) == replica_flags
    assert set(GATEWAY_SAMPLES) | set(gateway_tls) | {"--model", "--host", "--port", "--drain-seconds"} == flags(
        "gateway"
    ) - SERVE_PICKS - NOT_FOR_SERVE - {"--workers", "--api-key", "--api-key-file", "--log-level"}
    port = free_port()
    serve = start_serve(port, "--replicas", "2", *replica_given, *gateway_given)
    try:
        serve.wait_ready()
        commands = children(serve.process.pid)
        replicas = [config_file_of(command) for command in commands if "bouquet.cli replica" in command]
        gateways = [config_file_of(command) for command in commands if "bouquet.cli gateway" in command]
        assert len(replicas) == 2 and len(gateways) == 1
        by_hand = replica_configs(parse("replica", *replica_given))
        for path in replicas:
            engine, scheduler, replica = replica_configs(parse("replica", "--config", path))
            assert (engine, scheduler) == by_hand[:2]
            assert replica == replace(by_hand[2], listen=replica.listen, token=replica.token)
            assert replica.listen.startswith("unix:")
        shared = [f"--model={minilm_path}", f"--port={port}", "--drain-seconds=20.0"]
        expected = gateway_config(parse("gateway", *gateway_given, *shared, "--replica", "any:1"))
        gateway = gateway_config(parse("gateway", "--config", gateways[0]))
        assert gateway == replace(expected, replicas=gateway.replicas, replica_token=gateway.replica_token)
    finally:
        assert serve.stop() == 0


@pytest.mark.process
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
    assert [c["engine"]["model_path"] for c in config.replica_configs] == [str(first), str(second)]
    assert all(c["engine"]["dtype"] == "bfloat16" for c in config.replica_configs)
    assert config.gateway_config["gateway"]["model_dirs"] == [str(first), str(second)]


def test_api_key_from_a_file(tmp_path: Path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    config = gateway_config(parse("gateway", "--replica", "h:1", "--api-key-file", str(key_file)))
    assert config.api_key == "s3cret"  # and no key in the command line `ps` shows
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="holds no API key"):
        gateway_config(parse("gateway", "--replica", "h:1", "--api-key-file", str(key_file)))
