"""The gateway's parts, assembled once by :func:`lmfleet.gateway.build.build_gateway`, and their lifecycle."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from lmfleet.gateway.routing.backends import ProviderBackend
from lmfleet.gateway.routing.fleet_watch import FleetWatch
from lmfleet.gateway.routing.health import HealthBoard
from lmfleet.gateway.observe.loopwatch import LoopWatch
from lmfleet.gateway.observe.metrics import GatewayMetrics
from lmfleet.gateway.routing.peers import PeerBoard
from lmfleet.gateway.routing.pollers import EngineStatsPoller
from lmfleet.gateway.routing.router import Router
from lmfleet.gateway.observe.recorder import Recorder
from lmfleet.gateway.observe.tracing import RequestTracer
from lmfleet.gateway.relay.upstream import HttpPool
from lmfleet.overflow.engine_stats import ReplicaTable
from lmfleet.tenants import TenantDirectory

GAUGE_PUBLISH_S = 1.0
"""With several gateway processes, how often each writes the gauges read from its state (in flight, readiness,
ledger backlog) for the node's /metrics: a scrape answered by another process reads them as of then."""


@dataclass
class Gateway:
    """Everything one gateway process holds: routing state, backends, health, metrics, ledger."""

    router: Router
    recorder: Recorder
    health: HealthBoard
    metrics: GatewayMetrics
    providers: dict[str, ProviderBackend]
    clients: list[HttpPool]
    tenants: TenantDirectory
    """Who holds which client key (as SHA-256 digests); ``is_open``: no key anywhere, /v1 is open."""
    admin_key: str | None
    """None: the admin API is disabled."""
    engine_stats: EngineStatsPoller | None = None
    peers: PeerBoard | None = None
    """Set by the process that runs the gateway on a Ray cluster (lmfleet.gateway.routing.peers); None in tests."""
    tracer: RequestTracer | None = None
    """OpenTelemetry spans per request (``observability.otlp_endpoint``); None: tracing off."""
    loopwatch: LoopWatch | None = None
    """The event-loop watchdog (``gateway.loop_stall_warn_ms``); None in tests that build a gateway by hand."""
    fleet_watch: FleetWatch | None = None
    """The cluster's running-fleet version as this process sees it (set where the fleet is stored); None: none."""
    new_model: Any = None
    """How a model added by a new fleet version is served here (:class:`~lmfleet.gateway.routing.live.NewModels`,
    set by :func:`~lmfleet.gateway.build.build_gateway`); None: models are not added live."""
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def models(self):
        return self.router.models

    @property
    def api_keys(self) -> TenantDirectory:
        """The client keys, for :func:`lmfleet.gateway.front.access.operator_may_see` (the same object as ``tenants``;
        no key is held in clear)."""
        return self.tenants

    def start(self) -> None:
        """Start the background work (ledger writer, health and engine-metrics pollers) on the running loop."""
        self.recorder.start()
        for c in self.clients:
            c.open()
        self._tasks.append(asyncio.create_task(self.health.run()))
        if self.engine_stats is not None:
            self._tasks.append(asyncio.create_task(self.engine_stats.run()))
        if self.peers is not None:
            self._tasks.append(asyncio.create_task(self.peers.run()))
        if self.loopwatch is not None:
            self._tasks.append(asyncio.create_task(self.loopwatch.run()))
        if self.fleet_watch is not None:
            self._tasks.append(asyncio.create_task(self.fleet_watch.run()))
        if self.metrics.multiproc_dir is not None:
            self._tasks.append(asyncio.create_task(self._publish_forever()))

    def served_replicas(self) -> ReplicaTable:
        """The engine poller's latest per-replica figures, for the models this gateway serves."""
        table = self.engine_stats.replicas if self.engine_stats is not None else {}
        return {n: table[n] for n in self.models if n in table}

    def publish_readiness(self) -> None:
        for n, h in self.health.models.items():
            self.metrics.model_ready.labels(n).set(1 if h.ready else 0)

    def publish_gauges(self) -> None:
        """Set the gauges that are read from this process's state to their values now."""
        metrics = self.metrics
        self.publish_readiness()
        for n, m in self.models.items():
            metrics.in_flight.labels(n, m.local.label).set(m.local.tracker.in_flight)
        for p in self.providers.values():
            for n in p.cfg.model_map:
                metrics.in_flight.labels(n, p.label).set(p.in_flight)
        metrics.set_replicas(self.served_replicas())
        self.recorder.status()  # the ledger writer's backlog gauges

    async def _publish_forever(self) -> None:
        while True:
            self.publish_gauges()
            await asyncio.sleep(GAUGE_PUBLISH_S)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.peers is not None:
            await self.peers.leave()
        await self.recorder.close()
        for c in self.clients:
            await c.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.close)
