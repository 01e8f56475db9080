"""vLLM's own queue counts (``num_requests_running`` / ``num_requests_waiting``) for the estimator.

Under Ray Serve LLM (``log_engine_metrics``), each engine records vLLM's gauges through Ray's metrics
system; every Ray node's metrics agent serves them at ``http://<node>:<MetricsExportPort>/metrics`` as
``ray_vllm_num_requests_running{model_name=...}``. A bare vLLM server serves the same gauges as
``vllm:num_requests_running`` on its own ``/metrics``. :func:`parse_engine_queues` reads either, summed
per model over engines and replicas; the gateway's poller (``lmfleet.gateway.routing.pollers``) scrapes every
alive Ray node and hands the sums to each model's :class:`~lmfleet.overflow.signals.LoadTracker`.
Pure functions: no I/O here.

What the figures are worth: they are as old as Ray's metrics report interval plus the gateway's poll period,
so they refine the gateway's own in-flight count rather than replace it. At Ray's default interval (10 s) a gauge
on the page is 5 s old on average; ``lmfleet serve`` has the engines' replicas export every
:data:`REPORT_INTERVAL_MS` (:func:`metrics_env`, unless the operator's environment sets it), while the nodes'
metrics agents keep the default, and with it their 20-s hold on a gauge that a busy replica exports late (an agent
set to 1 s drops a gauge 2 s after its last export: under load the series comes and goes). They see what the
gateway cannot: requests that reached the engines another way (a second gateway, a client on Serve's port), and
an engine that runs fewer sequences than ``max_num_seqs`` because its KV cache is full (``waiting > 0`` while
``running < capacity``). See :func:`lmfleet.overflow.estimator.estimate_wait_ms` for how they are used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from lmfleet.overflow.signals import LoadTracker

__all__ = ["REPORT_INTERVAL_ENV", "REPORT_INTERVAL_MS", "EngineQueue", "ReplicaStats", "apply_engine_queues",
           "imbalance", "merge", "merge_replicas", "metrics_env", "parse_engine_queues", "parse_pages",
           "parse_replica_pages", "parse_replica_stats", "since"]

REPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"
REPORT_INTERVAL_MS = 1000
"""How often the engines' replicas export their metrics to their node's agent (Ray's default: 10,000 ms; its
floor: 1,000)."""


def metrics_env() -> dict[str, str]:
    """Environment for the engines' replicas (their job's ``runtime_env``): Ray exports their gauges every
    :data:`REPORT_INTERVAL_MS`."""
    return {REPORT_INTERVAL_ENV: str(REPORT_INTERVAL_MS)}


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


# ---------------------------------------------------------------------------------------------
# per replica: load and prefix-cache hits (what cache-aware routing is judged by; docs/routing.md)
# ---------------------------------------------------------------------------------------------
_REPLICA_FIELDS = {
    "vllm_num_requests_running": "running",
    "vllm_num_requests_waiting": "waiting",
    "vllm_prefix_cache_hits": "prefix_cache_hits",
    "vllm_prefix_cache_queries": "prefix_cache_queries",
    "vllm_request_success": "requests",
}
_REPLICA_PREFIXES = ("ray_vllm_num_requests_", "vllm:num_requests_", "ray_vllm_prefix_cache_", "vllm:prefix_cache_",
                     "ray_vllm_request_success", "vllm:request_success")


def _field(sample_name: str) -> str | None:
    """``ray_vllm_prefix_cache_hits_total`` / ``vllm:prefix_cache_hits_total`` -> ``prefix_cache_hits``."""
    name = sample_name.removeprefix("ray_").replace(":", "_").removesuffix("_total")
    return _REPLICA_FIELDS.get(name)


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's engine figures: queue gauges now, and counters since its engine started.

    ``prefix_cache_hits`` / ``prefix_cache_queries`` count prompt *tokens* (vLLM's ``prefix_cache_*`` counters):
    their ratio is the share of prompt tokens found in the replica's prefix cache. ``requests``: requests the
    engine finished (vLLM's ``request_success``, every finish reason).
    """

    running: int = 0
    waiting: int = 0
    prefix_cache_hits: float = 0.0
    prefix_cache_queries: float = 0.0
    requests: float = 0.0

    def __add__(self, other: "ReplicaStats") -> "ReplicaStats":
        return ReplicaStats(self.running + other.running, self.waiting + other.waiting,
                            self.prefix_cache_hits + other.prefix_cache_hits,
                            self.prefix_cache_queries + other.prefix_cache_queries, self.requests + other.requests)

    @property
    def load(self) -> int:
        """Requests in the engine: running plus waiting."""
        return self.running + self.waiting

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Share of prompt tokens served from the prefix cache (None before any prompt)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries > 0 else None

    def as_dict(self) -> dict[str, float | int | None]:
        rate = self.prefix_cache_hit_rate
        return {"running": self.running, "waiting": self.waiting, "requests_finished": int(self.requests),
                "prefix_cache_hits": int(self.prefix_cache_hits), "prefix_cache_queries": int(self.prefix_cache_queries),
                "prefix_cache_hit_rate": None if rate is None else round(rate, 4)}


ReplicaTable = dict[str, dict[str, ReplicaStats]]
"""model name -> replica id (Ray Serve's ``ReplicaId`` label; ``""`` for a bare vLLM server) -> figures."""


def parse_replica_stats(text: str) -> ReplicaTable:
    """Per model and replica, the queue gauges and prefix-cache/request counters in ``text`` (engines of one
    replica summed). Counters may carry Prometheus' ``_total`` suffix or not; other metrics are skipped."""
    lines = [ln for ln in text.splitlines() if ln.startswith(_REPLICA_PREFIXES)]
    if not lines:
        return {}
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except ValueError:
        return {}
    out: ReplicaTable = {}
    for fam in families:
        for s in fam.samples:
            field_name = _field(s.name)
            model = s.labels.get("model_name")
            if field_name is None or not model or s.value != s.value or s.value < 0:
                continue
            value = int(round(s.value)) if field_name in ("running", "waiting") else float(s.value)
            replicas = out.setdefault(model, {})
            replica = s.labels.get("ReplicaId", "")
            replicas[replica] = replicas.get(replica, ReplicaStats()) + ReplicaStats(**{field_name: value})
    return out


def merge_replicas(pages: list[ReplicaTable]) -> ReplicaTable:
    """Several pages (one per node) in one table; a replica seen on two pages is summed."""
    out: ReplicaTable = {}
    for page in pages:
        for model, replicas in page.items():
            mine = out.setdefault(model, {})
            for rid, st in replicas.items():
                mine[rid] = mine.get(rid, ReplicaStats()) + st
    return out


def parse_replica_pages(texts: list[str]) -> ReplicaTable:
    return merge_replicas([parse_replica_stats(t) for t in texts])


def since(before: Mapping[str, ReplicaStats], after: Mapping[str, ReplicaStats]) -> dict[str, ReplicaStats]:
    """Per replica of ``after``: counters accumulated since ``before`` (gauges as in ``after``). A replica that is
    new, or whose counters went down (its engine restarted), counts from zero."""
    out = {}
    for rid, a in after.items():
        b = before.get(rid)
        if b is None or a.prefix_cache_queries < b.prefix_cache_queries or a.requests < b.requests:
            b = ReplicaStats()
        out[rid] = ReplicaStats(a.running, a.waiting, a.prefix_cache_hits - b.prefix_cache_hits,
                                a.prefix_cache_queries - b.prefix_cache_queries, a.requests - b.requests)
    return out


def imbalance(replicas: Mapping[str, ReplicaStats]) -> int:
    """Busiest minus least busy replica's requests in the engine (0 with fewer than two replicas)."""
    loads = [st.load for st in replicas.values()]
    return max(loads) - min(loads) if len(loads) > 1 else 0
