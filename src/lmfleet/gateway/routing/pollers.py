"""Background I/O that feeds the gateway's decisions: vLLM's queue counts from every Ray node's metrics page.

(Deployment health is polled by :class:`lmfleet.gateway.routing.health.HealthBoard`.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from lmfleet.overflow.engine_stats import (EngineQueue, ReplicaTable, apply_engine_queues, parse_pages,
                                           parse_replica_pages)
from lmfleet.overflow.signals import LoadTracker

log = logging.getLogger("lmfleet.gateway")


class EngineStatsPoller:
    """Every ``period_s``: fetch the metrics pages, parse them, set each model's tracker."""

    def __init__(self, trackers: Mapping[str, LoadTracker], fetch: Callable[[], list[str]], period_s: float = 2.0):
        self.trackers = trackers
        self._fetch = fetch
        self.period_s = period_s
        self.replicas: ReplicaTable = {}
        """Latest per-replica figures (load, prefix-cache hits) per model, for /admin/state and /metrics."""

    @property
    def fetch(self) -> Callable[[], list[str]]:
        """The metrics-page fetcher (blocking), also read by ``lmfleet profile``'s snapshot."""
        return self._fetch

    def apply(self, texts: list[str]) -> None:
        apply_engine_queues(self.trackers, parse_pages(texts))
        self.replicas = parse_replica_pages(texts)

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                # fetch and parse off the event loop (a Ray metrics page is ~1 MB): only the sums come back
                queues, replicas = await asyncio.to_thread(lambda: _parse_both(self._fetch()))
                apply_engine_queues(self.trackers, queues)
                self.replicas = replicas
                failures = 0
            except Exception as e:  # the estimate falls back to gateway-side signals; say so once
                failures += 1
                if failures == 1:
                    log.warning("engine metrics unavailable (%s); the queue estimate uses gateway signals only", e)
            await asyncio.sleep(self.period_s)


def _parse_both(texts: list[str]) -> tuple[dict[str, EngineQueue], ReplicaTable]:
    return parse_pages(texts), parse_replica_pages(texts)


def ray_metrics_fetcher(timeout_s: float = 2.0) -> Callable[[], list[str]]:
    """Fetch every alive Ray node's metrics page (call it from a thread: it blocks)."""
    import httpx
    import ray

    # one client for the gateway's life: a new httpx.Client builds an SSL context (certifi's bundle) each time,
    # which py-spy found as the poller's largest cost (every 2 s, holding the GIL of the gateway's process)
    client: list[httpx.Client] = []

    def fetch() -> list[str]:
        pages = []
        if not client:
            client.append(httpx.Client(timeout=timeout_s, verify=False))  # plain http: no SSL context
        c = client[0]
        for n in ray.nodes():
            port = n.get("MetricsExportPort")
            if not (n.get("Alive") or n.get("alive")) or not port:
                continue
            try:
                r = c.get(f"http://{n['NodeManagerAddress']}:{port}/metrics")
                if r.status_code == 200:
                    pages.append(r.text)
            except httpx.HTTPError:
                continue  # a node going away: its engines' counts are gone with it
        return pages

    return fetch
