"""Background I/O that feeds the gateway's decisions: vLLM's queue counts from every Ray node's metrics page.

(Deployment health is polled by :class:`lmfleet.gateway.health.HealthBoard`.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from lmfleet.overflow.engine_stats import apply_engine_queues, parse_pages
from lmfleet.overflow.signals import LoadTracker

log = logging.getLogger("lmfleet.gateway")


class EngineStatsPoller:
    """Every ``period_s``: fetch the metrics pages, parse them, set each model's tracker."""

    def __init__(self, trackers: Mapping[str, LoadTracker], fetch: Callable[[], list[str]], period_s: float = 2.0):
        self.trackers = trackers
        self._fetch = fetch
        self.period_s = period_s

    def apply(self, texts: list[str]) -> None:
        apply_engine_queues(self.trackers, parse_pages(texts))

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                # fetch and parse off the event loop (a Ray metrics page is ~1 MB): only the sums come back
                queues = await asyncio.to_thread(lambda: parse_pages(self._fetch()))
                apply_engine_queues(self.trackers, queues)
                failures = 0
            except Exception as e:  # the estimate falls back to gateway-side signals; say so once
                failures += 1
                if failures == 1:
                    log.warning("engine metrics unavailable (%s); the queue estimate uses gateway signals only", e)
            await asyncio.sleep(self.period_s)


def ray_metrics_fetcher(timeout_s: float = 2.0) -> Callable[[], list[str]]:
    """Fetch every alive Ray node's metrics page (call it from a thread: it blocks)."""
    import httpx
    import ray

    def fetch() -> list[str]:
        pages = []
        with httpx.Client(timeout=timeout_s) as c:
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
