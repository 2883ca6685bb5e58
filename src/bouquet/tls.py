"""TLS on the gRPC ports: between gateways and replicas on other hosts, the replica presents a certificate (and,
given a client CA, asks the gateway for one: mutual TLS) and the gateway checks it against a CA it is given; and
on the gateway's own Open Inference Protocol port, towards its clients. `serve`'s own replicas need none: they
listen on Unix sockets only their user can reach."""

from __future__ import annotations

from pathlib import Path

import grpc


def _read(path: Path | None) -> bytes | None:
    return path.read_bytes() if path is not None else None


def server_credentials(cert: Path, key: Path, client_ca: Path | None) -> grpc.ServerCredentials:
    """A server's side (a replica's, or the gateway's OIP port); with `client_ca`, a client must present a
    certificate that CA signed."""
    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=_read(client_ca),
        require_client_auth=client_ca is not None,
    )


def channel_credentials(ca: Path, cert: Path | None, key: Path | None) -> grpc.ChannelCredentials:
    """The gateway's side: replicas are trusted when `ca` signed their certificate (for the host dialled);
    `cert` and `key` are what the gateway presents to a replica that asks (mutual TLS)."""
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(), private_key=_read(key), certificate_chain=_read(cert)
    )
