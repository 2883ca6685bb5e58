"""Hosts for multi-host tests: Linux network namespaces on a bridge of their own, with links that can be cut and
slowed. Root and iproute2 only; nothing of the machine's own network is touched.

Layout. A "switch" namespace holds a bridge (`br0`, no address: a plain L2 switch). Each host is a namespace with
loopback up and one veth, `eth0`, whose other end is a port of that bridge; the hosts share a private /24
(10.77.N.0/24, N picked per run). Every veth is created directly inside the switch namespace with its peer placed
in the host's, so no interface ever appears in the root namespace, and because each cluster's switch is its own,
two runs (parallel, or one aborted and the next) cannot see each other's traffic even on the same subnet. Names are
`bqt-<pid>.<seq>-<host>`; a cluster deletes, on start, the namespaces of runs whose process is gone.

Reaching a host from the test. The test process stays in the root namespace, which has no route into the
subnet, and gets none: `host.forward(port)` returns `127.0.0.1:P`, a socket the test bound on the root
namespace's loopback and handed (as an inherited fd) to a small TCP forwarder running inside the host's
namespace, which connects on to the host's address. Traffic thus stays on loopback and inside the namespaces, the
test talks plain HTTP to 127.0.0.1 (the existing helpers work unchanged), and the gateway really runs on a host of
its own, reaching its replicas only over the bridge. (The alternatives: a veth from the bridge into the root
namespace would put a 10.77 address on the machine's network stack; a load client run inside the namespace
would have to report its results as JSON over a pipe.)

Faults. `host.cut()` sets the bridge's port of the host down (`restore()` sets it up): the cable is pulled at the
switch. Packets either way are dropped silently, so a TCP peer sees a stall (retransmissions, unanswered pings),
never a reset, and nothing on the host itself changes: its `eth0` keeps its address and routes (it only loses
carrier), and no process there gets a local error such as ENETUNREACH that would make a cut look like a crash.
A new connection to a cut host fails once ARP gives up (EHOSTUNREACH after about 3 s), as for a LAN host gone.
`host.delay(ms)` adds `ms` to everything the host sends: `tc qdisc ... netem delay` on its eth0 when the kernel has
sch_netem, otherwise (the kernel this was written on lacks it) a delaying TCP proxy on the host, in front of a
port: `host.endpoint(port)` is the address to give clients, the port itself with netem, the proxy's without; the
proxy holds each chunk the server sends for `ms` before forwarding it (order kept, throughput not capped).

Later tests can add and remove hosts on a live cluster (`add_host`, `remove_host`), and give a host its own /etc
files (`host.write_etc("resolv.conf", ...)`: `ip netns exec` mounts /etc/netns/<ns>/* over /etc) for a DNS server
on one of these addresses.

Use:

    with Cluster(["gw", "r1", "r2"]) as cluster:
        r1 = cluster["r1"]
        replica = start_replica(50051, host=r1.address, prefix=r1.prefix)    # bouquet.gateway.testing
        ...
        url = "http://" + cluster["gw"].forward(8000)
        r1.cut(); r1.restore(); r1.delay(200)

Run as a script, this file is that forwarder/proxy: `python netns.py proxy (--listen HOST:PORT | --listen-fd N)
--to HOST:PORT`, printing `ready HOST:PORT` once it listens; a line `MS` on its stdin sets the delay (answered
`delay MS`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

PREFIX = "bqt-"  # every namespace this harness makes; stale ones are found by it
_SWITCH = "sw"
_BRIDGE = "br0"
_ETC = Path("/etc/netns")
_sequence = 0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _namespaces() -> list[str]:
    listing = _ip("netns", "list", check=False).stdout.splitlines()
    return [line.split()[0] for line in listing if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_all_in(namespace: str) -> None:
    """Every process in the namespace: here, only ever those this harness (or a test through it) started."""
    pids = [int(pid) for pid in _ip("netns", "pids", namespace, check=False).stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _delete(namespace: str) -> None:
    _kill_all_in(namespace)
    _ip("netns", "del", namespace, check=False)  # takes its veths with it (and so their peers)
    if (_ETC / namespace).exists():  # write_etc's files
        shutil.rmtree(_ETC / namespace, ignore_errors=True)
        with contextlib.suppress(OSError):
            _ETC.rmdir()  # only if no one else's files are left there


def cleanup_stale() -> list[str]:
    """Deletes the namespaces (and their processes) of earlier runs whose process is gone; returns their names."""
    stale = []
    for namespace in _namespaces():
        if not namespace.startswith(PREFIX):
            continue
        try:
            pid = int(namespace[len(PREFIX) :].split("-", 1)[0].split(".", 1)[0])
        except ValueError:
            continue
        if not _alive(pid):
            _delete(namespace)
            stale.append(namespace)
    return stale


@functools.cache
def netns_available() -> tuple[bool, str]:
    """Whether this machine can run the harness, and if not why (a pytest skip reason)."""
    if sys.platform != "linux":
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return False, "iproute2's `ip` is not installed"
    probe = f"{PREFIX}{os.getpid()}.probe-{_SWITCH}"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", _BRIDGE, "type", "bridge")
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except (RuntimeError, OSError) as error:
        return False, f"cannot create a namespace with a bridge and a veth pair: {error}"
    finally:
        _ip("netns", "del", probe, check=False)
    return True, ""


@functools.cache
def netem_available() -> bool:
    """Whether `tc ... netem` works (the kernel may lack sch_netem); probed on a throwaway namespace's loopback."""
    if shutil.which("tc") is None:
        return False
    probe = f"{PREFIX}{os.getpid()}.netem-{_SWITCH}"
    try:
        _ip("netns", "add", probe)
        tc = ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
        return subprocess.run(tc, capture_output=True).returncode == 0
    except RuntimeError:
        return False
    finally:
        _ip("netns", "del", probe, check=False)


class Host:
    """One namespace on the cluster's bridge. Created by `Cluster`, not directly."""

    def __init__(self, cluster: Cluster, name: str, index: int):
        self.cluster = cluster
        self.name = name
        self.namespace = f"{cluster.stem}-{name}"
        self.address = f"{cluster.subnet}.{index}"
        self.port = f"p{index}"  # the bridge's end of the host's veth, in the switch namespace
        # Runs a command inside this host. Its processes share the cluster's replica token, as hosts of one
        # deployment do: a replica listening on the bridge refuses to start without one.
        self.prefix = ["ip", "netns", "exec", self.namespace, "env", f"BOUQUET_REPLICA_TOKEN={cluster.token}"]
        self._proxies: dict[int, _Proxy] = {}  # port -> the delaying proxy in front of it (no netem)
        self._delay_ms = 0

    def _create(self) -> None:
        sw = self.cluster.switch
        _ip("netns", "add", self.namespace)
        _ip("-n", self.namespace, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", self.port, "type", "veth", "peer", "name", "eth0", "netns", self.namespace)
        _ip("-n", sw, "link", "set", self.port, "master", _BRIDGE, "up")
        _ip("-n", self.namespace, "addr", "add", f"{self.address}/24", "dev", "eth0")
        _ip("-n", self.namespace, "link", "set", "eth0", "up")

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address})"

    def addr(self, port: int) -> str:
        return f"{self.address}:{port}"

    # Processes. Each is killed when the cluster closes (and anything else left in the namespace with it).

    def popen(self, argv: Sequence[str], **kwargs: object) -> subprocess.Popen:
        process = subprocess.Popen([*self.prefix, *argv], **kwargs)  # type: ignore[call-overload]
        self.cluster._processes.append(process)
        return process

    def run(self, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix, *argv], **kwargs)  # type: ignore[call-overload]

    def write_etc(self, name: str, text: str) -> Path:
        """A file that processes on this host see as /etc/NAME (resolv.conf, hosts); removed with the host."""
        path = _ETC / self.namespace / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    # Links.

    def cut(self) -> None:
        """Pulls the host's cable at the switch: its traffic is dropped both ways, silently (see the docstring)."""
        _ip("-n", self.cluster.switch, "link", "set", self.port, "down")

    def restore(self) -> None:
        _ip("-n", self.cluster.switch, "link", "set", self.port, "up")

    def endpoint(self, port: int) -> str:
        """The address clients should use for a server on `port` of this host for `delay()` to reach them: the
        port itself with netem; without, a proxy's (started on first use, delaying by the host's current delay)."""
        if self.cluster.netem:
            return self.addr(port)
        if port not in self._proxies:
            self._proxies[port] = _Proxy(self, ["--listen", self.addr(0), "--to", self.addr(port)])
            self._proxies[port].set_delay(self._delay_ms)
        return self._proxies[port].address

    def delay(self, ms: int) -> None:
        """Adds `ms` to every packet this host sends (0: none). Without netem: to what its endpoints send."""
        self._delay_ms = ms
        if self.cluster.netem:
            if ms:
                self.run(["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{ms}ms"], check=True)
            else:
                self.run(["tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True)  # none there: fine
        else:
            for proxy in self._proxies.values():
                proxy.set_delay(ms)

    def forward(self, port: int) -> str:
        """`127.0.0.1:P` on the test's (root namespace's) loopback, forwarded to this host's `address:port` by a
        process inside the host: how the test process reaches a server here without any route into the subnet."""
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(512)
        try:
            fd = str(listener.fileno())
            _Proxy(self, ["--listen-fd", fd, "--to", self.addr(port)], pass_fds=(listener.fileno(),))
            return f"127.0.0.1:{listener.getsockname()[1]}"
        finally:
            listener.close()  # the forwarder holds its own copy

    def close(self) -> None:
        _delete(self.namespace)


class _Proxy:
    """This file run as a proxy inside a host (see `_proxy_main`)."""

    def __init__(self, host: Host, args: list[str], pass_fds: tuple[int, ...] = ()):
        argv = [sys.executable, "-u", str(Path(__file__).resolve()), "proxy", *args]
        self.process = host.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=pass_fds)
        self.address = self._expect("ready")

    def _expect(self, word: str) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().split()
        if line[:1] != [word]:
            raise RuntimeError(f"proxy: expected {word!r}, got {line!r} (exit {self.process.poll()})")
        return line[1]

    def set_delay(self, ms: int) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{ms}\n")
        self.process.stdin.flush()
        self._expect("delay")


class Cluster:
    """A bridge in a namespace of its own and hosts on it; a context manager that always cleans up: every process
    in its namespaces killed, the namespaces (and with them the veths and the bridge) deleted."""

    def __init__(self, hosts: Iterable[str] = (), netem: bool | None = None):
        """`netem`: None uses it where the kernel has it; False always uses the delaying proxy."""
        global _sequence
        _sequence += 1
        self.stem = f"{PREFIX}{os.getpid()}.{_sequence}"
        self.switch = f"{self.stem}-{_SWITCH}"
        # Each cluster's bridge is private, so addresses never clash; still, one subnet per run reads better in
        # logs and keeps a future veth into another cluster possible.
        self.subnet = f"10.77.{(os.getpid() + _sequence) % 250 + 1}"
        self.token = secrets.token_hex(16)  # the replica token its hosts share (Host.prefix)
        self.netem = netem_available() if netem is None else netem
        self.hosts: dict[str, Host] = {}
        self._processes: list[subprocess.Popen] = []
        self._next_index = 1
        self._initial = list(hosts)

    def __enter__(self) -> Cluster:
        cleanup_stale()
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", _BRIDGE, "type", "bridge")  # STP off: ports forward at once
            _ip("-n", self.switch, "link", "set", _BRIDGE, "up")
            for name in self._initial:
                self.add_host(name)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def add_host(self, name: str) -> Host:
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        index = self._next_index  # never reused, so a removed host's address is not given to a new one
        self._next_index += 1
        host = Host(self, name, index)
        try:
            host._create()
        except BaseException:
            host.close()
            raise
        self.hosts[name] = host
        return host

    def remove_host(self, name: str) -> None:
        self.hosts.pop(name).close()

    def close(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.terminate()
        for process in self._processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        for host in list(self.hosts.values()):
            host.close()
        self.hosts.clear()
        _delete(self.switch)


# The proxy, run inside a host.


async def _proxy_main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    delay = [args.delay_ms / 1000]
    target_host, target_port = args.to.rsplit(":", 1)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: bool) -> None:
        """Copies until EOF; with `delayed`, writes each chunk `delay` after it was read (in order)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read() -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(1 << 16):
                    queue.put_nowait((loop.time() + (delay[0] if delayed else 0.0), data))
            queue.put_nowait((loop.time(), b""))

        reading = asyncio.ensure_future(read())
        try:
            while True:
                due, data = await queue.get()
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        except OSError:
            return
        finally:
            reading.cancel()

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(target_host, int(target_port))
        except OSError:
            client_writer.close()
            return
        try:
            await asyncio.gather(
                pipe(client_reader, server_writer, delayed=False),
                pipe(server_reader, client_writer, delayed=True),  # what the server sends: the host's egress
            )
        finally:
            for writer in (client_writer, server_writer):
                writer.close()

    if args.listen_fd is not None:
        server = await asyncio.start_server(handle, sock=socket.socket(fileno=args.listen_fd))
    else:
        host, port = args.listen.rsplit(":", 1)
        server = await asyncio.start_server(handle, host, int(port))
    address = server.sockets[0].getsockname()
    print(f"ready {address[0]}:{address[1]}", flush=True)

    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():  # a delay in ms a line; EOF (the test gone) ends the proxy
        delay[0] = float(line) / 1000
        print(f"delay {line.decode().strip()}", flush=True)
    server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netns.py")
    commands = parser.add_subparsers(dest="command", required=True)
    proxy = commands.add_parser("proxy", help="TCP forwarder with an optional delay on what the target sends")
    where = proxy.add_mutually_exclusive_group(required=True)
    where.add_argument("--listen", help="HOST:PORT (port 0: any)")
    where.add_argument("--listen-fd", type=int, help="an inherited listening socket (one in another namespace)")
    proxy.add_argument("--to", required=True, help="HOST:PORT to connect to")
    proxy.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_proxy_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
