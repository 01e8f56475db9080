"""Gateways that know about each other: every gateway process of a fleet (workers of ``lmfleet serve``,
``lmfleet gateway`` on other nodes) reports itself every ``gateway.peers_period_s`` (0.25 s) to one small registry actor in the Ray cluster.

What a gateway reports: where it listens, its pid and node, and per model its own in-flight requests and drain
rate. What it gets back: every gateway's last report. Two uses:

* **One queue estimate**: each gateway adds the others' in-flight requests and drain rates to its own
  (:meth:`lmfleet.overflow.signals.LoadTracker.set_peer_load`), so N gateways behind a load balancer overflow at
  the point one gateway would, instead of each seeing 1/N of the queue. Reports are at most ``period_s`` old
  (0.25 s by default): a burst shorter than that is seen by each gateway only in its own share, and by the engines' own
  counts (vLLM running/waiting, polled from Ray's metrics) a few seconds later.
* **``lmfleet cluster status``** lists every gateway (address, pid, in-flight, last seen).

The registry is a detached named actor (``lmfleet-gateways`` in namespace ``lmfleet``, no CPU); a gateway that
stops removes its entry, one that dies stops being counted ``fresh_s`` after its last report (the registry
answers with its own clock, so clock skew between nodes does not matter).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lmfleet.overflow.cost import LocalCostMeter
from lmfleet.overflow.signals import LoadTracker

log = logging.getLogger("lmfleet.gateway")

REGISTRY_NAME = "lmfleet-gateways"
NAMESPACE = "lmfleet"
FRESH_S = 5.0
"""A gateway whose last report is older than this is not counted (it died or is stuck)."""
FORGET_S = 300.0
"""...and is forgotten after this."""
ALONE_PERIOD_S = 2.0
"""How often a gateway that the registry shows no fresh peer reports (its configured period, if longer). Alone,
there is nobody to share a queue estimate with: the report only keeps it listed (``lmfleet cluster status``) and
lets a newcomer find it. At 4 reports a second the registry actor and the reporting thread cost ~2 % of a core on an
idle 2-core node (docs/benchmarks.md); a gateway that starts later is counted by this one at its next
report, within this period."""


@dataclass(frozen=True)
class PeerLoad:
    in_flight: int
    drain_rps: float
    window_tokens: int = 0
    """Output tokens the others served locally in their cost meters' windows (their share of the local cost)."""
    overflowing: bool = False
    """Some other gateway is overflowing the model (in its hysteresis band): this one's bar is the lower one too."""
    queue_running: int = 0
    """Local slots the others' priority queues hold (tenants configured): taken out of this one's share."""


def peer_loads(entries: list[dict[str, Any]], self_id: str, now: float, fresh_s: float = FRESH_S
               ) -> dict[str, PeerLoad]:
    """Model name -> the other fresh gateways' in-flight requests, drain rates and window tokens, summed."""
    out: dict[str, list[float]] = {}
    for e in entries:
        if e.get("id") == self_id or now - float(e.get("last_seen", 0.0)) > fresh_s:
            continue
        for model, load in (e.get("models") or {}).items():
            acc = out.setdefault(model, [0, 0.0, 0, 0, 0])
            acc[0] += int(load.get("in_flight", 0))
            acc[1] += float(load.get("drain_rps") or 0.0)
            acc[2] += int(load.get("window_tokens") or 0)
            acc[3] += 1 if load.get("overflowing") else 0
            acc[4] += int(load.get("queue_running") or 0)
    return {m: PeerLoad(int(n), d, int(k), bool(o), int(q)) for m, (n, d, k, o, q) in out.items()}


def has_fresh_peer(entries: list[dict[str, Any]], self_id: str, now: float, fresh_s: float = FRESH_S) -> bool:
    """Does the registry's answer list another gateway that reported within ``fresh_s``?"""
    return any(e.get("id") != self_id and now - float(e.get("last_seen", 0.0)) <= fresh_s for e in entries)


def next_report_s(period_s: float, alone: bool, alone_period_s: float = ALONE_PERIOD_S) -> float:
    """Seconds to the next report: ``period_s`` among peers, at least ``alone_period_s`` alone."""
    return max(period_s, alone_period_s) if alone else period_s


class GatewayRegistry:
    """The registry actor's body (wrapped by :func:`registry`): gateway id -> its last report."""

    def __init__(self) -> None:
        self._gateways: dict[str, dict[str, Any]] = {}

    def report(self, entry: dict[str, Any]) -> dict[str, Any]:
        now = time.time()
        self._gateways[entry["id"]] = {**entry, "last_seen": now}
        for gid in [g for g, e in self._gateways.items() if now - e["last_seen"] > FORGET_S]:
            del self._gateways[gid]
        return {"now": now, "gateways": list(self._gateways.values())}

    def remove(self, gateway_id: str) -> None:
        self._gateways.pop(gateway_id, None)

    def list(self) -> dict[str, Any]:
        return {"now": time.time(), "gateways": list(self._gateways.values())}


def registry(create: bool = True) -> Any:
    """The cluster's registry actor (created on first use). Needs a connected Ray."""
    import ray

    if not create:
        return ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
    return ray.remote(GatewayRegistry).options(
        name=REGISTRY_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=-1).remote()


def list_gateways(timeout_s: float = 5.0) -> dict[str, Any] | None:
    """Every gateway's last report (``{"now", "gateways"}``), or None when no gateway ever registered."""
    import ray

    try:
        actor = registry(create=False)
    except ValueError:
        return None
    return ray.get(actor.list.remote(), timeout=timeout_s)


@dataclass(frozen=True)
class GatewayRow:
    """One front door for ``lmfleet cluster status``: the gateway processes that share one node and port."""

    address: str
    role: str
    pids: tuple[int, ...]
    in_flight: int
    last_seen_s: float
    """Seconds since the most recent report of any of its processes."""
    fresh: bool

    @property
    def workers(self) -> int:
        return len(self.pids)


def gateway_rows(answer: Mapping[str, Any], fresh_s: float = FRESH_S) -> list[GatewayRow]:
    """The registry's answer (:func:`list_gateways`) grouped by node and port, sorted by address. A process that
    listens on every interface is shown at its node's address."""
    now = float(answer.get("now", 0.0))
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for e in answer.get("gateways", []):
        host = str(e.get("host") or "")
        shown = (e.get("node") or host) if host in ("", "0.0.0.0", "::") else host
        groups.setdefault((str(shown), int(e.get("port", 0))), []).append(e)
    rows = []
    for (host, port), entries in sorted(groups.items()):
        age = now - max(float(e.get("last_seen", 0.0)) for e in entries)
        roles = {str(e.get("role", "gateway")) for e in entries}
        rows.append(GatewayRow(
            address=f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
            role="serve" if "serve" in roles else "gateway",
            pids=tuple(sorted(int(e.get("pid", 0)) for e in entries)),
            in_flight=sum(int(m.get("in_flight", 0)) for e in entries for m in (e.get("models") or {}).values()),
            last_seen_s=max(0.0, age), fresh=age <= fresh_s))
    return rows


def node_address() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostname()


class PeerBoard:
    """This gateway's side: report once every ``period_s``, apply the others' loads to the trackers."""

    def __init__(self, trackers: Mapping[str, LoadTracker], *, host: str, port: int, role: str = "gateway",
                 period_s: float = 0.25, call: Callable[[str, Any], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 meters: Mapping[str, LocalCostMeter] | None = None,
                 routes: Mapping[str, Any] | None = None) -> None:
        self.id = f"{node_address()}:{port}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.trackers = trackers
        self.meters = meters or {}
        """Each model's local cost meter: its window tokens are reported, the others' counted with its own."""
        self.routes = routes or {}
        """Each model's routing state (the router's ``ServedModel``: ``.hysteresis.overflowing`` is reported, the
        others' flag goes to ``.set_peers_overflowing(flag, now)``), so all gateways share one hysteresis band."""
        self.host, self.port, self.role = host, port, role
        self.period_s = period_s
        self.started_at = time.time()
        self._call = call or _ray_call()
        self._clock = clock
        self.last_ok: float | None = None
        self.alone = True
        """No other fresh gateway in the registry's last answer: reports slow down to :data:`ALONE_PERIOD_S`."""

    def entry(self) -> dict[str, Any]:
        models = {}
        for name, tr in self.trackers.items():
            s = tr.snapshot(with_peers=False)
            models[name] = {"in_flight": s.in_flight, "drain_rps": s.drain_rps or 0.0}
            meter = self.meters.get(name)
            if meter is not None:
                models[name]["window_tokens"] = meter.window_tokens()
            route = self.routes.get(name)
            if route is not None:
                models[name]["overflowing"] = bool(route.hysteresis.overflowing)
                if getattr(route, "queue", None) is not None:
                    models[name]["queue_running"] = route.queue.running
        return {"id": self.id, "role": self.role, "node": node_address(), "host": self.host, "port": self.port,
                "pid": os.getpid(), "started_at": self.started_at, "models": models}

    def apply(self, answer: dict[str, Any]) -> None:
        entries, now = answer.get("gateways", []), float(answer.get("now", 0.0))
        self.alone = not has_fresh_peer(entries, self.id, now)
        loads = peer_loads(entries, self.id, now)
        for name, tr in self.trackers.items():  # stamped with each tracker's own clock
            load = loads.get(name, PeerLoad(0, 0.0))
            tr.set_peer_load(load.in_flight, load.drain_rps)
            meter = self.meters.get(name)
            if meter is not None:
                meter.set_peer_tokens(load.window_tokens)
        for name, route in self.routes.items():
            load = loads.get(name)
            route.set_peers_overflowing(load is not None and load.overflowing, self._clock())
            if getattr(route, "queue", None) is not None:  # one local capacity for the priority queues of all
                route.queue.set_peer_running(load.queue_running if load is not None else 0)

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                answer = await asyncio.to_thread(self._call, "report", self.entry())
                self.apply(answer)
                self.last_ok = self._clock()
                if failures:
                    log.info("gateway registry reachable again")
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:  # each gateway then estimates from its own requests and the engines' counts
                failures += 1
                if failures == 1:
                    log.warning("gateway registry unreachable (%s); the queue estimate counts this gateway's "
                                "requests only", e)
            await asyncio.sleep(next_report_s(self.period_s, self.alone and not failures))

    async def leave(self) -> None:
        try:
            await asyncio.wait_for(asyncio.to_thread(self._call, "remove", self.id), timeout=3)
        except Exception:
            pass  # it is forgotten once its reports stop


def _ray_call(timeout_s: float = 5.0) -> Callable[[str, Any], Any]:
    actor = None

    def call(method: str, arg: Any) -> Any:
        nonlocal actor
        import ray

        if actor is None:
            actor = registry()
        try:
            return ray.get(getattr(actor, method).remote(arg), timeout=timeout_s)
        except Exception:
            actor = None  # look it up again next time (it may have been restarted)
            raise

    return call
