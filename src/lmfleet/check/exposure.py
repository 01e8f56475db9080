"""Unauthenticated ports on public-looking node addresses (HAProxy mode, ``gateway.serve_proxy: haproxy``).

With HAProxy on a joined cluster, Ray Serve binds every replica's HTTP port (30000-31000), Serve's
``serve_port`` and HAProxy's stats/metrics pages on all interfaces, with no auth; a node whose Ray
address is public (not loopback, private or link-local) exposes them to whoever can reach it. Pure.
"""

from __future__ import annotations

import ipaddress

from lmfleet.check.result import CheckResult, passed, skipped, warned
from lmfleet.config.models import FleetConfig

CHECK = "security.replica_ports"


def is_public_address(address: str) -> bool:
    """True for an IP that routes beyond the local network; False for loopback, private (RFC 1918, ULA,
    CGNAT 100.64/10, documentation and other reserved ranges), link-local, unspecified, and for host names."""
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return False  # a host name: nothing to judge without resolving it
    if ip.version == 6 and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    if ip in ipaddress.ip_network("100.64.0.0/10"):  # carrier-grade NAT: shared, not public
        return False
    return ip.is_global and not ip.is_multicast


def check_replica_exposure(cfg: FleetConfig, node_addresses: list[str], *, joined: bool) -> list[CheckResult]:
    """Warn once per public node address when the fleet runs HAProxy mode on a joined cluster
    (``joined``: the check ran against a cluster, not a throwaway local head)."""
    if cfg.gateway.serve_proxy != "haproxy":
        return [skipped(CHECK, "cluster", "gateway.serve_proxy: serve: replicas have no HTTP ports of their own")]
    if not joined:
        return [passed(CHECK, "cluster", "local head: replica ports and serve_port listen on loopback only")]
    public = sorted({a for a in node_addresses if is_public_address(a)})
    if not public:
        return [passed(CHECK, "cluster", "every node address is loopback or private")]
    return [warned(
        CHECK, addr,
        f"node {addr} has a public address; with gateway.serve_proxy: haproxy on a joined cluster, Ray Serve binds "
        "replica HTTP ports (30000-31000) and HAProxy's ports on all interfaces, without authentication",
        "firewall those ports to the cluster's own addresses, run Ray on a private network, "
        "or set gateway.serve_proxy: serve (docs/multinode.md)",
        address=addr,
    ) for addr in public]
