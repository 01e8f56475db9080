"""The dashboard's readings: what the gateway knows at one instant (live values and its cumulative counters).

:func:`read_gateway` is the edge that reads a :class:`~lmfleet.gateway.service.Gateway`; everything after it
(:mod:`lmfleet.gateway.admin.dashboard`) is pure: readings in, JSON out.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lmfleet.gateway.observe.metrics import GatewayMetrics
from lmfleet.gateway.service import Gateway
from lmfleet.overflow import BudgetStatus
from lmfleet.overflow.calibration import Calibration
from lmfleet.provenance import is_external

__all__ = ["BudgetReading", "Counters", "ModelReading", "ProviderReading", "Reading", "read_counters", "read_gateway"]


@dataclass(frozen=True)
class Counters:
    """One model's cumulative counters since the gateway started (its Prometheus metrics)."""

    local: float = 0.0
    """Requests answered by the local engines (any status)."""
    external: float = 0.0
    """Requests answered by external providers."""
    gateway: float = 0.0
    """Requests the gateway answered itself (refused, invalid, no backend)."""
    errors: tuple[tuple[str, float], ...] = ()
    """(HTTP status, count), non-200 answers."""
    output_tokens: float = 0.0
    external_cost_usd: float = 0.0
    local_cost_usd: float = 0.0
    ttft: tuple[tuple[float, float], ...] = ()
    """TTFT histogram, every backend together: (upper bound in s, cumulative count), +inf last."""


@dataclass(frozen=True)
class ModelReading:
    name: str
    ready: bool
    degraded: bool
    health: str
    running_replicas: int
    capacity: int
    in_flight_local: int
    """This gateway's local requests in flight."""
    in_flight_peers: int
    """Other gateways' local requests in flight (multi-gateway fleets; 0 otherwise)."""
    in_flight_external: int
    """Requests in flight at this model's providers (all models they serve: see ``external_shared``)."""
    external_shared: bool
    """One of its providers also serves other models, so ``in_flight_external`` counts theirs too."""
    queue_estimate_ms: float
    threshold_ms: float
    mode: str
    overflowing: bool
    drain_rps: float | None
    local_output_tps: float | None
    ttft_median_s: float | None
    base_ttft_s: float | None
    engine_running: int | None
    engine_waiting: int | None
    providers: tuple[str, ...]
    counters: Counters = field(default_factory=Counters)
    calibration: Calibration | None = None
    """The wait estimate over this process's last minutes of requests kept local (None: none in the window)."""


@dataclass(frozen=True)
class ProviderReading:
    name: str
    breaker: str
    retry_after_s: float
    in_flight: int
    max_concurrency: int | None
    models: tuple[str, ...]


@dataclass(frozen=True)
class BudgetReading:
    hourly_usd: float | None
    daily_usd: float | None
    status: BudgetStatus | None
    """None when no cap is set or there is no ledger."""


@dataclass(frozen=True)
class Reading:
    t: float
    """Epoch seconds."""
    models: dict[str, ModelReading]
    providers: tuple[ProviderReading, ...]
    budget: BudgetReading


def read_counters(metrics: GatewayMetrics) -> dict[str, Counters]:
    """Per model, the cumulative counters of ``metrics`` (the node's, with several gateway processes; one pass over
    each metric's samples)."""
    acc: dict[str, dict[str, Any]] = {}

    def slot(model: str) -> dict[str, Any]:
        a = acc.get(model)
        if a is None:
            a = acc[model] = {"local": 0.0, "external": 0.0, "gateway": 0.0, "errors": {}, "output_tokens": 0.0,
                              "external_cost_usd": 0.0, "local_cost_usd": 0.0, "ttft": {}}
        return a

    requests, errors, tokens, cost, ttft = metrics.families(metrics.requests, metrics.errors, metrics.tokens,
                                                            metrics.cost, metrics.ttft)
    for s in _samples(requests, "_total"):
        a, by = slot(s.labels["model"]), s.labels["served_by"]
        a["gateway" if by == "none" else "external" if is_external(by) else "local"] += s.value
    for s in _samples(errors, "_total"):
        errs = slot(s.labels["model"])["errors"]
        errs[s.labels["code"]] = errs.get(s.labels["code"], 0.0) + s.value
    for s in _samples(tokens, "_total"):
        if s.labels["kind"] == "output":
            slot(s.labels["model"])["output_tokens"] += s.value
    for s in _samples(cost, "_total"):
        key = "external_cost_usd" if is_external(s.labels["served_by"]) else "local_cost_usd"
        slot(s.labels["model"])[key] += s.value
    for s in _samples(ttft, "_bucket"):
        b = slot(s.labels["model"])["ttft"]
        le = float(s.labels["le"])
        b[le] = b.get(le, 0.0) + s.value
    return {m: Counters(a["local"], a["external"], a["gateway"], tuple(sorted(a["errors"].items())),
                        a["output_tokens"], a["external_cost_usd"], a["local_cost_usd"],
                        tuple(sorted(a["ttft"].items())))
            for m, a in acc.items()}


def _samples(family: Any, suffix: str) -> Iterable[Any]:
    for s in family.samples if family is not None else ():
        if s.name.endswith(suffix):
            yield s


def read_gateway(gw: Gateway, budget: BudgetStatus | None, now: float | None = None) -> Reading:
    """What ``gw`` knows at this instant (``budget``: ``await gw.router.budget_status()``, read by the caller)."""
    counters = read_counters(gw.metrics)
    served_by: dict[str, set[str]] = {}
    for m in gw.models.values():
        for p in m.providers:
            served_by.setdefault(p.name, set()).add(m.name)
    models: dict[str, ModelReading] = {}
    for name, m in gw.models.items():
        s = m.local.tracker.snapshot()
        h = gw.health.models.get(name)
        own = m.local.tracker.in_flight
        models[name] = ModelReading(
            name=name, ready=bool(h and h.ready), degraded=bool(h and h.degraded), health=h.message if h else "unknown",
            running_replicas=h.running_replicas if h else 0, capacity=m.app.capacity,
            in_flight_local=own, in_flight_peers=max(0, s.in_flight - own),
            in_flight_external=sum(p.in_flight for p in m.providers),
            external_shared=any(served_by[p.name] != {name} for p in m.providers),
            queue_estimate_ms=gw.router.estimate(m, s), threshold_ms=m.threshold_ms, mode=m.mode.value,
            overflowing=m.hysteresis.overflowing, drain_rps=s.drain_rps, local_output_tps=s.output_tps,
            ttft_median_s=s.ttft_s, base_ttft_s=s.base_ttft_s, engine_running=s.engine_running,
            engine_waiting=s.engine_waiting, providers=tuple(p.name for p in m.providers),
            counters=counters.get(name, Counters()), calibration=gw.recorder.calibration.summary(name))
    providers = tuple(ProviderReading(n, p.breaker.state().value, p.breaker.retry_after_s(), p.in_flight,
                                      p.cfg.max_concurrency, tuple(sorted(served_by.get(n, ()))))
                      for n, p in gw.providers.items())
    b = gw.router.budget
    return Reading(time.time() if now is None else now, models, providers,
                   BudgetReading(b.hourly_usd, b.daily_usd, budget))
