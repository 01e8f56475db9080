"""vLLM's own queue counts (``num_requests_running`` / ``num_requests_waiting``) for the estimator.

Under Ray Serve LLM (``log_engine_metrics``), each engine records vLLM's gauges through Ray's metrics
system; every Ray node's metrics agent serves them at ``http://<node>:<MetricsExportPort>/metrics`` as
``ray_vllm_num_requests_running{model_name=...}``. A bare vLLM server serves the same gauges as
``vllm:num_requests_running`` on its own ``/metrics``. :func:`parse_engine_queues` reads either, summed
per model over engines and replicas; :class:`EngineStatsPoller` scrapes every alive Ray node and hands
the sums to each model's :class:`~lmfleet.overflow.signals.LoadTracker`.

What the figures are worth: they are as old as Ray's metrics report interval (seconds), so they refine
the gateway's own in-flight count rather than replace it. They see what the gateway cannot: requests that
reached the engines another way (a second gateway, a client on Serve's port), and an engine that runs
fewer sequences than ``max_num_seqs`` because its KV cache is full (``waiting > 0`` while
``running < capacity``). See :func:`lmfleet.overflow.estimator.estimate_wait_ms` for how they are used.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from lmfleet.overflow.signals import LoadTracker

log = logging.getLogger("lmfleet.gateway")

__all__ = ["EngineQueue", "EngineStatsPoller", "merge", "parse_engine_queues", "ray_metrics_fetcher"]

_RUNNING = {"ray_vllm_num_requests_running", "vllm:num_requests_running"}
_WAITING = {"ray_vllm_num_requests_waiting", "vllm:num_requests_waiting"}
_NAMES = tuple(_RUNNING | _WAITING)


@dataclass(frozen=True)
class EngineQueue:
    running: int = 0
    waiting: int = 0

    def __add__(self, other: "EngineQueue") -> "EngineQueue":
        return EngineQueue(self.running + other.running, self.waiting + other.waiting)


def parse_engine_queues(text: str) -> dict[str, EngineQueue]:
    """Per ``model_name``: running and waiting requests summed over every engine in ``text``.

    ``text`` is Prometheus exposition (a Ray node's metrics page or a vLLM server's ``/metrics``). Only
    the two gauges' lines are parsed; samples without a ``model_name`` label or with a bad value are skipped.
    """
    lines = [ln for ln in text.splitlines() if ln.startswith(_NAMES)]
    if not lines:
        return {}
    out: dict[str, EngineQueue] = {}
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except ValueError as e:  # a malformed page must not break routing
        log.debug("engine metrics unparsable: %s", e)
        return {}
    for fam in families:
        for s in fam.samples:
            model = s.labels.get("model_name")
            if not model or s.value != s.value or s.value < 0:  # NaN or nonsense
                continue
            n = int(round(s.value))
            q = EngineQueue(n, 0) if s.name in _RUNNING else EngineQueue(0, n) if s.name in _WAITING else None
            if q is not None:
                out[model] = out.get(model, EngineQueue()) + q
    return out


def merge(pages: list[dict[str, EngineQueue]]) -> dict[str, EngineQueue]:
    """Sum several pages (one per node)."""
    out: dict[str, EngineQueue] = {}
    for page in pages:
        for model, q in page.items():
            out[model] = out.get(model, EngineQueue()) + q
    return out


class EngineStatsPoller:
    """Every ``period_s``: fetch the metrics pages, parse them, set each model's tracker."""

    def __init__(self, trackers: Mapping[str, LoadTracker], fetch: Callable[[], list[str]], period_s: float = 2.0):
        self.trackers = trackers
        self._fetch = fetch
        self.period_s = period_s
        self.last: dict[str, EngineQueue] = {}

    def apply(self, texts: list[str]) -> None:
        self.set(merge([parse_engine_queues(t) for t in texts]))

    def set(self, queues: dict[str, EngineQueue]) -> None:
        self.last = queues
        for model, tracker in self.trackers.items():
            q = self.last.get(model)
            if q is not None:
                tracker.set_engine_stats(q.running, q.waiting)

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                # fetch and parse off the event loop (a Ray metrics page is ~1 MB): only the sums come back
                self.set(await asyncio.to_thread(lambda: merge([parse_engine_queues(t) for t in self._fetch()])))
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
