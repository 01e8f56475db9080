"""Prometheus metrics of the gateway (one registry per gateway, served at /metrics)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lmfleet.overflow.engine_stats import ReplicaTable, imbalance

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60)
_ESTIMATE_ERROR_BUCKETS = (-10, -5, -2.5, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_PREPARE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
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
                               ["model", "served_by"], registry=r)
        self.tokens = Counter("lmfleet_tokens", "Tokens processed, by model, who served them, kind, and where the "
                              "count came from (usage_source: provider, or estimated with the model's tokenizer "
                              "for an answer without usage).", ["model", "served_by", "kind", "usage_source"],
                              registry=r)
        self.cost = Counter("lmfleet_cost_usd", "Cost of served requests in USD.", ["model", "served_by"], registry=r)
        self.queue_estimate = Gauge("lmfleet_queue_estimate_ms", "Latest predicted local wait before first token.",
                                    ["model"], registry=r)
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
                                 ["model"], registry=r)
        self.upstream_failures = Counter(
            "lmfleet_upstream_failures", "Failed upstream attempts by backend and kind (UpstreamMisconfigured: a "
            "provider refused the gateway's key or model: alert on it).", ["served_by", "kind"], registry=r)
        self.retries = Counter("lmfleet_upstream_retries", "Attempts that failed before the first byte and were retried.",
                               ["model", "from_target"], registry=r)
        self.budget_store_failures = Counter(
            "lmfleet_budget_store_failures", "Budget store (ledger database) calls that failed: reservations and "
            "recovery probes. Paid providers stay closed while it fails.", registry=r)
        self.budget_store_up = Gauge("lmfleet_budget_store_up", "0 while the budget store (ledger database) cannot "
                                     "be used and paid providers are closed, else 1.", registry=r)
        self.budget_store_up.set(1)
        self.ledger_pending = Gauge("lmfleet_ledger_pending_rows", "Rows of finished requests waiting to be written "
                                    "to the ledger (they wait in memory, in order, while its database fails).",
                                    registry=r)
        self.ledger_failing = Gauge("lmfleet_ledger_write_failing", "1 while the ledger write at the head of the "
                                    "queue keeps failing (retried with backoff), else 0.", registry=r)
        self.ledger_dropped = Gauge("lmfleet_ledger_rows_dropped", "Ledger rows dropped since start: the in-memory "
                                    "backlog was full, or a write failed for a reason a retry cannot fix.",
                                    registry=r)
        # per tenant: the label takes configured tenant names (and "default") only, so the set stays bounded
        self.tenant_requests = Counter("lmfleet_tenant_requests", "Requests answered, by tenant and HTTP status "
                                       "(429s from tenant limits included).", ["tenant", "status"], registry=r)
        self.tenant_rejected = Counter("lmfleet_tenant_rejected", "Requests refused by tenant admission, by tenant "
                                       "and reason (concurrency_limit, requests_per_minute, tokens_per_minute, "
                                       "deadline).", ["tenant", "reason"], registry=r)
        self.tenant_tokens = Counter("lmfleet_tenant_tokens", "Tokens of served requests, by tenant and kind.",
                                     ["tenant", "kind"], registry=r)
        # per engine replica, from Ray's metrics pages (gateway.engine_metrics_poll_s): the label set is the
        # replicas alive at the last poll (reset at each), so it stays bounded
        self.replica_running = Gauge("lmfleet_replica_requests_running", "Requests running in one replica's engine.",
                                     ["model", "replica"], registry=r)
        self.replica_waiting = Gauge("lmfleet_replica_requests_waiting", "Requests waiting in one replica's engine.",
                                     ["model", "replica"], registry=r)
        self.replica_finished = Gauge("lmfleet_replica_requests_finished", "Requests one replica's engine finished "
                                      "since it started (vLLM request_success): the share per replica shows "
                                      "where the request router sends traffic.", ["model", "replica"], registry=r)
        self.replica_prefix_hits = Gauge("lmfleet_replica_prefix_cache_hit_tokens", "Prompt tokens found in one "
                                         "replica's prefix cache since its engine started (vLLM prefix_cache_hits).",
                                         ["model", "replica"], registry=r)
        self.replica_prefix_queries = Gauge("lmfleet_replica_prefix_cache_query_tokens", "Prompt tokens looked up "
                                            "in one replica's prefix cache since its engine started (vLLM "
                                            "prefix_cache_queries).", ["model", "replica"], registry=r)
        self.replica_imbalance = Gauge("lmfleet_replica_load_imbalance", "Busiest minus least busy replica's requests "
                                       "in the engine (running + waiting), per model (docs/routing.md).", ["model"],
                                       registry=r)
        self.prepare = Histogram("lmfleet_gateway_prepare_seconds", "Time in the gateway before the first upstream "
                                 "call (body, validation, tokenizing, routing), by model (lmfleet profile).",
                                 ["model"], buckets=_PREPARE_BUCKETS, registry=r)
        self._prepare_children: dict[str, Any] = {}
        self.loop_lag = Histogram("lmfleet_gateway_loop_lag_seconds", "How late the gateway's event loop woke up from "
                                  "a 0.1 s timer (blocked or starved of CPU; docs/gateways.md).",
                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=r)

    def observe_prepare(self, model: str, seconds: float) -> None:
        """One request's gateway phase; ``model`` is a served model's name (the label set stays bounded)."""
        child = self._prepare_children.get(model)
        if child is None:
            child = self._prepare_children[model] = self.prepare.labels(model)
        child.observe(seconds)

    def set_replicas(self, table: ReplicaTable) -> None:
        """Publish the latest per-replica engine figures; replicas gone since the last poll disappear."""
        gauges = (self.replica_running, self.replica_waiting, self.replica_finished, self.replica_prefix_hits,
                  self.replica_prefix_queries)
        for g in (*gauges, self.replica_imbalance):
            g.clear()
        for model, replicas in table.items():
            for rid, st in replicas.items():
                for g, v in zip(gauges, (st.running, st.waiting, st.requests, st.prefix_cache_hits,
                                         st.prefix_cache_queries)):
                    g.labels(model, rid).set(v)
            self.replica_imbalance.labels(model).set(imbalance(replicas))
