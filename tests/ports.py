"""Ports for the servers the tests start (HTTP, gRPC, ZeroMQ, Redis, Envoy).

A port taken with ``bind(("127.0.0.1", 0))`` and released comes from the kernel's ephemeral
range, the range every process on the machine also draws its outgoing connections' local
ports from: between the pick and the server's own bind, any connection (Envoy's, a client's,
another test's) may take it, and the server then fails with "address already in use". So
the ports here lie outside that range, are checked free by a bind, and are never handed out
twice in one test run.
"""

from __future__ import annotations

import random
import socket

#: Ports handed out in this process.
_GIVEN: set = set()
_PICK = random.Random()  # seeded from the system: two runs side by side pick differently


def _ephemeral_range() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return low, high


def free_port() -> int:
    """A loopback port free now, outside the ephemeral range, not handed out before here."""
    low, high = _ephemeral_range()
    spans = [span for span in ((10000, low - 1), (high + 1, 65535)) if span[1] - span[0] > 100]
    for _ in range(500):
        first, last = _PICK.choice(spans) if spans else (10000, 65535)
        port = _PICK.randint(first, last)
        if port in _GIVEN:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError("no free loopback port outside the ephemeral range")
