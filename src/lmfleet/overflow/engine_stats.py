"""vLLM's own queue counts (``num_requests_running`` / ``num_requests_waiting``) for the estimator.

Under Ray Serve LLM (``log_engine_metrics``), each engine records vLLM's gauges through Ray's metrics
system; every Ray node's metrics agent serves them at ``http://<node>:<MetricsExportPort>/metrics`` as
``ray_vllm_num_requests_running{model_name=...}``. A bare vLLM server serves the same gauges as
``vllm:num_requests_running`` on its own ``/metrics``. :func:`parse_engine_queues` reads either, summed
per model over engines and replicas; the gateway's poller (``lmfleet.gateway.pollers``) scrapes every
alive Ray node and hands the sums to each model's :class:`~lmfleet.overflow.signals.LoadTracker`.
Pure functions: no I/O here.

What the figures are worth: they are as old as Ray's metrics report interval (seconds), so they refine
the gateway's own in-flight count rather than replace it. They see what the gateway cannot: requests that
reached the engines another way (a second gateway, a client on Serve's port), and an engine that runs
fewer sequences than ``max_num_seqs`` because its KV cache is full (``waiting > 0`` while
``running < capacity``). See :func:`lmfleet.overflow.estimator.estimate_wait_ms` for how they are used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from lmfleet.overflow.signals import LoadTracker

__all__ = ["EngineQueue", "apply_engine_queues", "merge", "parse_engine_queues", "parse_pages"]

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
    except ValueError:
        # a malformed page must not break routing: no figures from it, the estimate keeps gateway signals
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


def parse_pages(texts: list[str]) -> dict[str, EngineQueue]:
    """Per-model sums over several metrics pages (one per Ray node, or one bare vLLM server)."""
    return merge([parse_engine_queues(t) for t in texts])


def apply_engine_queues(trackers: Mapping[str, LoadTracker], queues: Mapping[str, EngineQueue]) -> None:
    """Hand each model's counts to its tracker; models absent from ``queues`` keep gateway-side signals."""
    for model, tracker in trackers.items():
        q = queues.get(model)
        if q is not None:
            tracker.set_engine_stats(q.running, q.waiting)
