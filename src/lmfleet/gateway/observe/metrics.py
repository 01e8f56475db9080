"""Prometheus metrics of the gateway, served at /metrics.

One gateway process: an in-process registry. Several processes on one node (``gateway.workers`` > 1): the process
that starts them owns a :class:`SharedMetricsDir`; every process then writes its metrics to files there
(prometheus_client's multiprocess mode) and /metrics, whichever process answers it, sums them: counters and
histograms over every process, gauges as their ``multiprocess_mode`` says (docs/gateways.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from lmfleet.overflow.calibration import WINDOW_S, CalibrationBook
from lmfleet.overflow.engine_stats import ReplicaTable, imbalance

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60)
_ESTIMATE_ERROR_BUCKETS = (-10, -5, -2.5, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_PREPARE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


def multiproc_dir() -> str | None:
    """The folder this process writes its metrics to when they are summed over a node's gateway processes (set by
    :class:`SharedMetricsDir` or inherited from the process that started this one), else None."""
    return os.environ.get(MULTIPROC_ENV) if values.ValueClass is not values.MutexValue else None


class SharedMetricsDir:
    """The folder where a node's gateway processes write their metrics, owned by the process that starts them.

    Start the workers with :meth:`env` in their environment (they read it when they import prometheus_client);
    :meth:`use_here` before this process creates any metric, when it serves too (prometheus_client picks where a
    metric's values live when the metric is created); :meth:`worker_gone` for each worker that ended; :meth:`close`
    at the end, also after a failure: the folder is removed and this process is back to in-process metrics."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="lmfleet-metrics-")
        self._before: str | None = None
        self._used_here = False

    def env(self) -> dict[str, str]:
        return {MULTIPROC_ENV: self.path}

    def use_here(self) -> None:
        self._before, self._used_here = os.environ.get(MULTIPROC_ENV), True
        os.environ[MULTIPROC_ENV] = self.path
        values.ValueClass = values.MultiProcessValue()

    def worker_gone(self, pid: int) -> None:
        """Drop the ``live*`` gauges of an ended worker (its counters keep counting in the sums)."""
        with contextlib.suppress(OSError):
            mark_process_dead(pid, self.path)

    def close(self) -> None:
        if self._used_here:
            if self._before is None:
                os.environ.pop(MULTIPROC_ENV, None)
            else:
                os.environ[MULTIPROC_ENV] = self._before
            values.ValueClass = values.get_value_class()
            self._used_here = False
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> SharedMetricsDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_REPLICA_GAUGES = (
    ("lmfleet_replica_requests_running", "Requests running in one replica's engine.", "running"),
    ("lmfleet_replica_requests_waiting", "Requests waiting in one replica's engine.", "waiting"),
    ("lmfleet_replica_requests_finished", "Requests one replica's engine finished since it started (vLLM "
     "request_success): the share per replica shows where the request router sends traffic.", "requests"),
    ("lmfleet_replica_prefix_cache_hit_tokens", "Prompt tokens found in one replica's prefix cache since its engine "
     "started (vLLM prefix_cache_hits).", "prefix_cache_hits"),
    ("lmfleet_replica_prefix_cache_query_tokens", "Prompt tokens looked up in one replica's prefix cache since its "
     "engine started (vLLM prefix_cache_queries).", "prefix_cache_queries"),
)
_IMBALANCE = ("lmfleet_replica_load_imbalance", "Busiest minus least busy replica's requests in the engine (running "
              "+ waiting), per model (docs/routing.md).")


class ReplicaGauges(Collector):
    """Per engine replica, the figures of the last poll of Ray's metrics pages (gateway.engine_metrics_poll_s).

    Exactly the replicas of the last poll: ones gone since disappear (multiprocess files cannot forget a label
    set, so these are never written there). Every gateway process polls the same pages, so with several processes
    /metrics shows the answering process's last poll."""

    def __init__(self) -> None:
        self.table: ReplicaTable = {}

    def describe(self) -> Iterable[GaugeMetricFamily]:
        yield from self._families({})

    def collect(self) -> Iterable[GaugeMetricFamily]:
        yield from self._families(self.table)

    @staticmethod
    def _families(table: ReplicaTable) -> Iterable[GaugeMetricFamily]:
        for name, doc, field in _REPLICA_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model", "replica"])
            for model, replicas in table.items():
                for rid, st in replicas.items():
                    g.add_metric([model, rid], getattr(st, field))
            yield g
        g = GaugeMetricFamily(*_IMBALANCE, labels=["model"])
        for model, replicas in table.items():
            g.add_metric([model], imbalance(replicas))
        yield g


class GatewayMetrics:
    """Every metric of one gateway process. ``registry`` holds this process's own values; :meth:`exposition` is
    /metrics: the node's sums when this process writes to a shared folder (:func:`multiproc_dir`)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.multiproc_dir = multiproc_dir()
        # Gauges with several processes: each process sets its own value and /metrics combines them per
        # multiprocess_mode ("live*": only processes still running count). livesum: the node's total (each holds a
        # part); livemin: the worst view, for states a process acts on alone (a process that sees the model not
        # ready or the budget store down routes its requests that way); livemax: any process; livemostrecent: the
        # newest value, for a figure each process computes from the same shared counts.
        self.requests = Counter("lmfleet_requests", "Requests answered, by model, who served them and HTTP status.",
                                ["model", "served_by", "status"], registry=r)
        self.errors = Counter("lmfleet_errors", "Error answers by model and HTTP status code.",
                              ["model", "code"], registry=r)
        self.latency = Histogram("lmfleet_request_latency_seconds", "End-to-end request latency at the gateway.",
                                 ["model", "served_by"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("lmfleet_time_to_first_token_seconds", "Time to first token of streamed requests.",
                              ["model", "served_by"], buckets=_TTFT_BUCKETS, registry=r)
        self.estimate_error = Histogram(
            "lmfleet_queue_estimate_error_seconds", "Signed error of the predicted local wait of requests kept "
            "local: the realised time to first token minus the estimate the router used (positive: the request "
            "waited longer than predicted).", ["model"], buckets=_ESTIMATE_ERROR_BUCKETS, registry=r)
        self.in_flight = Gauge("lmfleet_in_flight_requests", "Requests in flight at the gateway.",
                               ["model", "served_by"], registry=r, multiprocess_mode="livesum")
        self.tokens = Counter("lmfleet_tokens", "Tokens processed, by model, who served them, kind, and where the "
                              "count came from (usage_source: provider, or estimated with the model's tokenizer "
                              "for an answer without usage).", ["model", "served_by", "kind", "usage_source"],
                              registry=r)
        self.cost = Counter("lmfleet_cost_usd", "Cost of served requests in USD.", ["model", "served_by"], registry=r)
        self.queue_estimate = Gauge("lmfleet_queue_estimate_ms", "Latest predicted local wait before first token.",
                                    ["model"], registry=r, multiprocess_mode="livemostrecent")
        self.miss_margin = Gauge("lmfleet_overflow_miss_margin_ms", "Margin added to the predicted local wait "
                                 "before it is compared with the overflow threshold (overflow.miss_quantile).",
                                 ["model"], registry=r, multiprocess_mode="livemostrecent")
        # the estimate's calibration, set when /metrics is read; each process keeps its own window, so with several
        # the ratios show the worst process's and the request count the node's
        calib = f"over the last {WINDOW_S / 60:g} minutes' requests kept local and streamed"
        self.estimate_miss_ratio = Gauge("lmfleet_estimate_local_miss_ratio", "Share of the requests kept local whose "
                                         f"time to first token exceeded the overflow threshold, {calib} (NaN: none).",
                                         ["model"], registry=r, multiprocess_mode="livemax")
        self.estimate_p90_error = Gauge("lmfleet_estimate_p90_abs_error_ms", "P90 of |realised - predicted local "
                                        f"wait|, {calib} (NaN: none).", ["model"], registry=r,
                                        multiprocess_mode="livemax")
        self.estimate_p90_share = Gauge("lmfleet_estimate_p90_abs_error_threshold_ratio", "The P90 absolute error of "
                                        f"the predicted local wait as a share of the overflow threshold, {calib} (NaN: "
                                        "none).", ["model"], registry=r, multiprocess_mode="livemax")
        self.estimate_requests = Gauge("lmfleet_estimate_window_requests", "Requests the estimate's calibration "
                                       f"gauges rest on, {calib}.", ["model"], registry=r, multiprocess_mode="livesum")
        self.overflowed = Counter("lmfleet_routed", "Routing decisions by model, target and reason.",
                                  ["model", "target", "reason"], registry=r)
        self.hedges = Counter("lmfleet_hedges", "Hedged requests (overflow.policy hedge), by model and outcome: "
                              "started (a provider attempt beside the local one), won (the provider's first token "
                              "came first), lost (the local one's did), failed (the provider attempt failed).",
                              ["model", "outcome"], registry=r)
        self.ttft_failovers = Counter("lmfleet_ttft_timeout_failovers", "Local requests cancelled at "
                                      "overflow.ttft_timeout_ms without a first token, by model and outcome: "
                                      "started (sent to a provider), served (the provider answered), failed (it "
                                      "did not).", ["model", "outcome"], registry=r)
        self.model_ready = Gauge("lmfleet_model_ready", "1 when the model's local deployment is serving.",
                                 ["model"], registry=r, multiprocess_mode="livemin")
        self.upstream_failures = Counter(
            "lmfleet_upstream_failures", "Failed upstream attempts by backend and kind (UpstreamMisconfigured: a "
            "provider refused the gateway's key or model: alert on it).", ["served_by", "kind"], registry=r)
        self.retries = Counter("lmfleet_upstream_retries", "Attempts that failed before the first byte and were retried.",
                               ["model", "from_target"], registry=r)
        self.budget_store_failures = Counter(
            "lmfleet_budget_store_failures", "Budget store (ledger database) calls that failed: reservations and "
            "recovery probes. Paid providers stay closed while it fails.", registry=r)
        self.budget_store_up = Gauge("lmfleet_budget_store_up", "0 while the budget store (ledger database) cannot "
                                     "be used and paid providers are closed, else 1.", registry=r,
                                     multiprocess_mode="livemin")
        self.budget_store_up.set(1)
        self.ledger_pending = Gauge("lmfleet_ledger_pending_rows", "Rows of finished requests waiting to be written "
                                    "to the ledger (they wait in memory, in order, while its database fails).",
                                    registry=r, multiprocess_mode="livesum")
        self.ledger_failing = Gauge("lmfleet_ledger_write_failing", "1 while the ledger write at the head of the "
                                    "queue keeps failing (retried with backoff), else 0.", registry=r,
                                    multiprocess_mode="livemax")
        self.ledger_dropped = Gauge("lmfleet_ledger_rows_dropped", "Ledger rows dropped since start: the in-memory "
                                    "backlog was full, or a write failed for a reason a retry cannot fix.",
                                    registry=r, multiprocess_mode="sum")  # since start: ended workers' drops too
        # per tenant: the label takes configured tenant names (and "default") only, so the set stays bounded
        self.tenant_requests = Counter("lmfleet_tenant_requests", "Requests answered, by tenant and HTTP status "
                                       "(429s from tenant limits included).", ["tenant", "status"], registry=r)
        self.tenant_rejected = Counter("lmfleet_tenant_rejected", "Requests refused by tenant admission, by tenant "
                                       "and reason (concurrency_limit, requests_per_minute, tokens_per_minute, "
                                       "deadline).", ["tenant", "reason"], registry=r)
        self.tenant_tokens = Counter("lmfleet_tenant_tokens", "Tokens of served requests, by tenant and kind.",
                                     ["tenant", "kind"], registry=r)
        # per engine replica, from Ray's metrics pages: the replicas alive at the last poll, so the set stays bounded
        self.replicas = ReplicaGauges()
        r.register(self.replicas)
        self.prepare = Histogram("lmfleet_gateway_prepare_seconds", "Time in the gateway before the first upstream "
                                 "call (body, validation, tokenizing, routing), by model (lmfleet profile).",
                                 ["model"], buckets=_PREPARE_BUCKETS, registry=r)
        self._prepare_children: dict[str, Any] = {}
        self._estimate_error_children: dict[str, Any] = {}
        self.loop_lag = Histogram("lmfleet_gateway_loop_lag_seconds", "How late the gateway's event loop woke up from "
                                  "a 0.1 s timer (blocked or starved of CPU; docs/gateways.md).",
                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=r)
        self._page = r
        if self.multiproc_dir is not None:
            self._page = CollectorRegistry()
            MultiProcessCollector(self._page, self.multiproc_dir)
            self._page.register(self.replicas)

    def observe_estimate_error(self, model: str, seconds: float) -> None:
        """One local answer's realised wait minus its estimate; ``model`` is a served model's name (bounded).
        The labelled child is looked up once per model: ``labels()`` costs a few microseconds a request."""
        child = self._estimate_error_children.get(model)
        if child is None:
            child = self._estimate_error_children[model] = self.estimate_error.labels(model)
        child.observe(seconds)

    def observe_prepare(self, model: str, seconds: float) -> None:
        """One request's gateway phase; ``model`` is a served model's name (the label set stays bounded)."""
        child = self._prepare_children.get(model)
        if child is None:
            child = self._prepare_children[model] = self.prepare.labels(model)
        child.observe(seconds)

    def set_calibration(self, book: CalibrationBook) -> None:
        """Publish the estimate's calibration of every model ``book`` has seen (:mod:`lmfleet.overflow.calibration`)."""
        for model in book.models():
            c = book.summary(model)
            figures = (None, None, None) if c is None else (c.miss_ratio, c.p90_abs_error_ms, c.p90_share_of_threshold)
            for g, v in zip((self.estimate_miss_ratio, self.estimate_p90_error, self.estimate_p90_share), figures):
                g.labels(model).set(float("nan") if v is None else v)
            self.estimate_requests.labels(model).set(0 if c is None else c.count)

    def set_replicas(self, table: ReplicaTable) -> None:
        """Publish the latest per-replica engine figures; replicas gone since the last poll disappear."""
        self.replicas.table = table

    def families(self, *metrics: Any) -> list[Metric | None]:
        """The current family of each of ``metrics`` (of this object): this process's values, or the node's sums
        when the processes share a folder (None: nothing recorded yet)."""
        if self.multiproc_dir is None:
            return [next(iter(m.collect()), None) for m in metrics]
        merged = {f.name: f for f in self._page.collect()}
        return [merged.get(m.describe()[0].name) for m in metrics]

    def exposition(self) -> bytes:
        """The /metrics page: this process's metrics, or the node's (every process's, summed) when this process
        writes to a shared folder."""
        return generate_latest(self._page)
