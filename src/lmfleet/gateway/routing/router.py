"""Where a request may go: the routing decision for one request, as an ordered list of backends.

    plan = await router.route(model)     # estimate the local wait, ask the overflow policy, add fallbacks
    plan.backends                        # the chosen backend first, then the fallbacks, in order
    plan.reason                          # why (x-lmfleet-route-reason)

The decision itself is :func:`lmfleet.gateway.routing.decision.route_plan` (a pure function, over
:func:`lmfleet.overflow.decide`); this module gathers its inputs (load, margin, breakers, budget, the tenant's
admission) and applies its effects (hysteresis state, metrics, the tenant's ticket), turning it into backend objects. It does no HTTP: trying the backends
is :mod:`lmfleet.gateway.relay.run`'s job. A request's predicted local wait is :func:`class_wait_ms` (pure): with
priority classes, only the requests ahead of it in the local queue count.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from lmfleet.config.models import BudgetConfig
from lmfleet.config.tenants import PriorityClass
from lmfleet.gateway.routing.backends import Backend
from lmfleet.gateway.routing.budget import BudgetGuard
from lmfleet.gateway.routing.served import ServedModel
from lmfleet.gateway.core.errors import GatewayError
from lmfleet.gateway.observe.metrics import GatewayMetrics
from lmfleet.gateway.routing.decision import LOCAL, RouteInputs, route_plan
from lmfleet.overflow import BudgetStatus, ProviderCandidate, QueueSignals, Reason, check_budget, estimate_wait_ms
from lmfleet.overflow.admission import Admission
from lmfleet.overflow.budget import DAY_S
from lmfleet.overflow.estimator import cold_ttft_for
from lmfleet.overflow.margin import applied_margin_ms
from lmfleet.overflow.policies import Permissions, Policy
from lmfleet.store import Cap, Ledger, StoreUnavailable, caps_for_budget, tenant_key
from lmfleet.tenants import PRIORITY_HEADER, Tenant, TenantBook, Ticket

log = logging.getLogger("lmfleet.gateway")

BUDGET_CACHE_S = 1.0
RACED = (Policy.HEDGE, Policy.TTFT_TIMEOUT)
"""Policies whose local attempts race a timer and so do not pass the prefill gate."""


_NO_HEADERS: Mapping[str, str] = MappingProxyType({})
_NO_WAITING: Mapping[int, int] = MappingProxyType({})


def class_wait_ms(signals: QueueSignals, capacity: int, waiting_by_order: Mapping[int, int], order: int | None, *,
                  cold_service_s: float = 10.0, cold_ttft_s: float = 1.0, prompt_tokens: int = 0) -> float:
    """Predicted local wait (ms) of a request of class ``order`` arriving now: :func:`estimate_wait_ms` over the
    requests ahead of it, i.e. those running plus those waiting in the local queue in its class or a more urgent
    one (an order <= ``order``). Requests waiting in a less urgent class are dispatched after it
    (:func:`lmfleet.tenants.next_to_dispatch`: classes strictly), so they do not delay it and are left out.

    ``signals.in_flight`` counts every local request, those waiting in the gateway's queue included;
    ``waiting_by_order``: how many of them wait there, per class order
    (:attr:`~lmfleet.tenants.queue.DispatchQueue.waiting_by_order`).
    ``prompt_tokens``: the request's prompt (its prefill; 0: unknown).
    ``order`` None (no class, or no queue): every request in flight counts, as without tenants. Requests that
    already left the queue (running, or in the engine's own FIFO queue) are ahead whatever their class.
    Pure; O(classes).
    """
    return estimate_wait_ms(class_signals(signals, waiting_by_order, order), capacity, cold_service_s=cold_service_s,
                            cold_ttft_s=cold_ttft_s, prompt_tokens=prompt_tokens)


def class_signals(signals: QueueSignals, waiting_by_order: Mapping[int, int], order: int | None) -> QueueSignals:
    """``signals`` as a request of class ``order`` sees them: without the requests waiting in the local queue in a
    less urgent class (:func:`class_wait_ms`). Pure."""
    if order is not None and waiting_by_order:
        behind = sum(n for o, n in waiting_by_order.items() if o > order)
        if behind:
            return dataclasses.replace(signals, in_flight=max(0, signals.in_flight - behind))
    return signals


@dataclass(frozen=True)
class Plan:
    """The routing decision for one request."""

    backends: list[Backend]
    reason: Reason
    estimate_ms: float
    ticket: Ticket | None = None
    """The tenant's admission (None: no tenant): its slot in flight is freed when the request ends."""
    headers: Mapping[str, str] = field(default_factory=lambda: _NO_HEADERS)
    """Tenant headers for every answer: ``x-lmfleet-priority`` and OpenAI's ``x-ratelimit-*``."""
    priority: PriorityClass | None = None
    """The request's class: its place in the model's local queue and, with ``max_wait_s``, its deadline there."""
    spend_caps: tuple[Cap, ...] = ()
    """The tenant's own spend caps: a paid attempt reserves against them beside the fleet's (none: no tenant caps)."""
    permissions: Permissions = Permissions()
    """Whether a provider may take it later (a hedge, a failover): a batch class only when its tenant allows it."""
    admission: Admission | None = None
    """What the estimate was computed from, for the ledger row of a request the local engines answer."""


class Router:
    """Routing decisions for every model of a fleet. Reads load, breakers and budget; never does HTTP."""

    def __init__(self, models: dict[str, ServedModel], budget: BudgetConfig, ledger: Ledger | None,
                 metrics: GatewayMetrics, guard: BudgetGuard | None = None, tenants: TenantBook | None = None):
        self.models = models
        self.tenants = tenants
        """Live usage per tenant (None: no tenant admission, e.g. a router built by hand)."""
        self._class_headers = {c.name: MappingProxyType({PRIORITY_HEADER: c.name})
                               for c in (tenants.classes if tenants is not None else ())}
        self.tenant_caps: dict[str, tuple[Cap, ...]] = {}
        """Each tenant's own external-spend caps (``limits.hourly_usd`` / ``daily_usd``, key ``tenant:NAME``)."""
        for name, t in (tenants.directory.tenants.items() if tenants is not None else ()):
            caps = tuple(caps_for_budget(t.limits, tenant_key(name)))
            if caps:
                self.tenant_caps[name] = caps
        self.guard = guard
        """The budget store's guard (None: no caps): while its store is down, the provider route is closed."""
        self.budget = budget
        self.ledger = ledger
        self.metrics = metrics
        self._budget_cache: tuple[float, BudgetStatus | None] = (float("-inf"), None)
        self.ledger_down = False
        """The ledger's spend could not be read at the last look: paid providers are closed (fail closed)."""
        self._metric_children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def model_or_404(self, name: str) -> ServedModel:
        m = self.models.get(name)
        if m is None:
            served = ", ".join(sorted(self.models))
            raise GatewayError(404, f"The model {name!r} does not exist here. Served models: {served}.",
                               param="model", code="model_not_found")
        return m

    def estimate(self, m: ServedModel, signals: QueueSignals | None = None, order: int | None = None,
                 prompt_tokens: int = 0) -> float:
        """Predicted local wait (ms) for a request of ``m`` arriving now; ``order``: its priority class's order
        (requests waiting in the model's queue in a less urgent class are not ahead of it), None: behind every
        request in flight (no class; what /admin/state and the dashboard show); ``prompt_tokens``: its prompt
        (0: none, what /admin/state and the dashboard show)."""
        return self._estimate(m, self._class_signals(m, signals or m.local.tracker.snapshot(), order), prompt_tokens)

    @staticmethod
    def _class_signals(m: ServedModel, signals: QueueSignals, order: int | None) -> QueueSignals:
        q = m.queue
        return class_signals(signals, q.waiting_by_order if q is not None and order is not None else _NO_WAITING,
                             order)

    @staticmethod
    def _estimate(m: ServedModel, fed: QueueSignals, prompt_tokens: int) -> float:
        o = m.app.cfg.overflow
        return estimate_wait_ms(fed, m.app.capacity, cold_service_s=o.cold_service_s,
                                cold_ttft_s=cold_ttft_for(fed, o.cold_ttft_s, m.threshold_ms),
                                prompt_tokens=prompt_tokens, gated=Router._gated(m), gate_limit=m.local.gate.limit)

    @staticmethod
    def _gated(m: ServedModel) -> bool:
        """Whether a request of ``m`` would pass the prefill gate and is priced on its service line: the gate on,
        ``gate_line`` on, and a policy whose local attempts race no timer."""
        return m.gated and m.gate_line and m.timers.policy not in RACED

    async def budget_status(self) -> BudgetStatus | None:
        """External spend against the caps (read from the ledger at most once per ``BUDGET_CACHE_S``)."""
        b = self.budget
        if self.ledger is None or (b.hourly_usd is None and b.daily_usd is None):
            return None
        at, cached = self._budget_cache
        if time.monotonic() - at < BUDGET_CACHE_S:
            return cached
        now = time.time()
        try:
            events = await asyncio.to_thread(self.ledger.spend_events, now - DAY_S)
        except StoreUnavailable as e:  # spend cannot be checked, so none is admitted: the provider route closes
            if not self.ledger_down:
                log.error("ledger unreadable, paid providers closed until it is back: %s", e)
            self.ledger_down = True
            self._budget_cache = (time.monotonic(), None)
            return None
        if self.ledger_down:
            log.warning("ledger readable again: paid providers reopen")
        self.ledger_down = False
        status = check_budget(events, hourly_usd=b.hourly_usd, daily_usd=b.daily_usd, now=now)
        self._budget_cache = (time.monotonic(), status)
        return status

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once per label set (a few microseconds a call otherwise)."""
        key = (id(metric), labels)
        child = self._metric_children.get(key)
        if child is None:
            child = metric.labels(*labels)
            if len(self._metric_children) < 10_000:  # label sets are bounded: models x targets x reasons
                self._metric_children[key] = child
        return child

    async def route(self, m: ServedModel, tenant: Tenant | None = None, cls: PriorityClass | None = None,
                    prompt_tokens: int = 0) -> Plan:
        """Decide where one request of ``m`` goes: the chosen backend first, then the fallbacks.

        ``tenant``/``cls``: who sent it and in which priority class (None: no tenant admission). The decision is
        :func:`~lmfleet.gateway.routing.decision.route_plan` (pure); this method gathers its inputs and applies
        its effects: the model's hysteresis state, the metrics, the tenant's admission and ticket.

        Raises a 429 :class:`GatewayError` when the budget is spent, the local queue is too long and the
        fleet is configured to reject rather than queue, or when the tenant's admission refuses it.
        """
        signals = m.local.tracker.snapshot()
        fed = self._class_signals(m, signals, cls.order if cls is not None else None)
        estimate = self._estimate(m, fed, prompt_tokens)
        m.last_estimate_ms = estimate
        self._child(self.metrics.queue_estimate, m.name).set(estimate)
        candidates = [ProviderCandidate(p.name, p.cfg.model_map, p.healthy(), p.in_flight, p.cfg.max_concurrency)
                      for p in m.providers]
        budget = await self.budget_status() if candidates else None
        guard = self.guard if candidates else None
        store_down = (guard is not None and guard.is_down) or self.ledger_down
        if guard is not None and store_down:
            guard.probe_if_due()  # the route reopens once a probe gets through
        # the decision weighs the estimate plus the miss margin (how much longer than predicted recent requests near
        # the threshold waited, or its prior while too few did and the engine is busy, or the floor on an idle engine
        # with a measured prefill line); the plan, its header and the ledger keep the estimate itself
        margin = m.margin.margin_for(m.threshold_ms, signals)
        self._child(self.metrics.miss_margin, m.name).set(margin)
        book = self.tenants
        admitted = tenant is not None and cls is not None and book is not None
        o = m.app.cfg.overflow
        inp = RouteInputs(
            m.name, estimate, m.threshold_ms, margin, o.hysteresis, m.hysteresis, m.peers_overflowing(), m.mode,
            o.enabled, m.timers.policy, budget, self.budget.on_exhausted, candidates, store_down,
            m.local.health.is_ready(m.name), m.queue is not None,
            tenant if admitted else None, cls if admitted else None,
            admitted and book.is_limited(tenant),  # type: ignore[union-attr, arg-type]
            self._class_headers[cls.name] if admitted else _NO_HEADERS)  # type: ignore[union-attr]
        p = route_plan(inp)
        if p.state is not None:
            m.hysteresis = p.state
        ticket: Ticket | None = None
        if p.ask is not None:
            a, ticket = await book.enter(  # type: ignore[union-attr]
                tenant, cls, estimate_ms=p.ask.estimate_ms, threshold_ms=p.ask.threshold_ms,  # type: ignore[arg-type]
                provider_ok=p.ask.provider_ok, prompt_tokens=prompt_tokens, take=p.ask.take)
            p = route_plan(inp, a)
        if p.counted is not None:
            self._child(self.metrics.overflowed, m.name, *p.counted[:1], p.counted[1].value).inc()
        if p.refusal is not None:
            if ticket is not None:  # never leak a slot
                ticket.release()
            r = p.refusal
            if r.tenant_reason is not None:
                self._child(self.metrics.tenant_rejected, tenant.name, r.tenant_reason.value).inc()  # type: ignore
            raise GatewayError(429, r.message, type=r.type, code=r.code, headers=dict(r.headers))
        if p.take_ticket:
            ticket = book.take(tenant)  # type: ignore[union-attr, arg-type]
        backends: list[Backend] = [m.local if name == LOCAL else m.provider(name) for name in p.order]
        caps = self.tenant_caps.get(tenant.name, ()) if admitted else ()  # type: ignore[union-attr]
        # the estimate's inputs, for the ledger row of a request the local engines answer (lmfleet.overflow.admission)
        seen = Admission(fed, m.app.capacity, prompt_tokens, cls.order if cls is not None else None, estimate, margin,
                         applied_margin_ms(estimate, margin, m.threshold_ms), m.threshold_ms)
        return Plan(backends, p.reason, estimate, ticket, p.headers, cls if admitted else None, caps, p.permissions,
                    seen)
