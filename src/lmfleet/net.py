"""Free ports for servers that lmfleet (and its tests and benchmarks) start: one port picker for everyone.

A port chosen now and bound later must not be one the OS or Ray may hand out meanwhile, so the picker avoids
the kernel's ephemeral range and the ports Ray and its neighbours use.
"""

from __future__ import annotations

import random
import socket

# Ports chosen now and bound only later (HAProxy binds its stats, Prometheus and serve ports tens of seconds
# after lmfleet picks them, once Ray and Serve are up) must not be ones the OS or Ray may hand out meanwhile:
# the kernel's ephemeral range (every outgoing connection and every bind to port 0 takes one; a test run
# lost a fleet to "cannot bind socket (Address already in use)" for HAProxy's Prometheus port); everything
# below 20000: the well-known ports of Ray and its neighbours (GCS 6379, dashboard 8265, Serve 8000/9000,
# HAProxy's defaults 8404/9101, the fallback proxy's 8500, PostgreSQL 5432, ...) and Ray's worker ports
# (10002-19999, the client's 10001); and Serve's direct-ingress replica ports (HTTP 30000-31000, gRPC
# 40000-41000). What is left: 20000-29999, 31001-32767 and 61000-65535 with Linux's default ephemeral range.
RESERVED_PORTS: tuple[tuple[int, int], ...] = ((0, 19999), (30000, 31000), (40000, 41000))
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range


def quiet_port_ranges(ephemeral: tuple[int, int], reserved: tuple[tuple[int, int], ...] = RESERVED_PORTS,
                      top: int = 65535) -> list[tuple[int, int]]:
    """Inclusive port ranges outside ``ephemeral`` and every ``reserved`` range (all inclusive)."""
    out: list[tuple[int, int]] = []
    nxt = 0
    for lo, hi in sorted([ephemeral, *reserved]):
        if lo > nxt:
            out.append((nxt, min(lo - 1, top)))
        nxt = max(nxt, hi + 1)
    if nxt <= top:
        out.append((nxt, top))
    return [(lo, hi) for lo, hi in out if lo <= hi]


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def free_port(host: str = "", tries: int = 200, exclude: frozenset[int] = frozenset()) -> int:
    """A port free on ``host`` now, outside the ranges others may take before we bind it (``RESERVED_PORTS``
    and the ephemeral range); an OS-chosen one if ``tries`` random picks all fail."""
    ranges = quiet_port_ranges(ephemeral_port_range())
    weights = [hi - lo + 1 for lo, hi in ranges]
    for _ in range(tries if ranges else 0):
        lo, hi = random.choices(ranges, weights)[0]
        port = random.randint(lo, hi)
        if port in exclude:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
