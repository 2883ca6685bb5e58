"""A DNS server for tests, run inside a test host's namespace: answers A queries for the names in a JSON zone file
(`{"name": ["10.0.0.1", ...]}`), read again on every query so a test adds and removes records by rewriting it.
A name not in the file is NXDOMAIN; AAAA for a known name is an empty answer. Usage: dns_zone_server.py ZONE
[ADDRESS] (port 53); prints "dns ready" to stderr once it answers."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSServer


class ZoneFile(BaseResolver):
    def __init__(self, path: Path):
        self.path = path

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        zone = json.loads(self.path.read_text())
        if name not in zone:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype in (QTYPE.A, QTYPE.ANY):
            for address in zone[name]:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=0))
        return reply


class _Quiet:
    """dnslib's logger, silenced: a line per query would flood the test's output."""

    def __getattr__(self, name: str) -> object:
        return lambda *args: None


def main() -> None:
    zone, address = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"
    server = DNSServer(ZoneFile(zone), port=53, address=address, logger=_Quiet())
    server.start_thread()
    print("dns ready", file=sys.stderr, flush=True)
    while server.isAlive():
        time.sleep(0.5)


if __name__ == "__main__":
    main()
