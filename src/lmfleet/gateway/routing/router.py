"""Where a request may go: the routing decision for one request, as an ordered list of backends.

    plan = await router.route(model)     # estimate the local wait, ask the overflow policy, add fallbacks
    plan.backends                        # the chosen backend first, then the fallbacks, in order
    plan.reason                          # why (x-lmfleet-route-reason)

The decision itself is :func:`lmfleet.overflow.decide` (a pure function); this module gathers its inputs
(load, breakers, budget) and turns its answer into backend objects. It does no HTTP: trying the backends
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
from lmfleet.overflow import (
    BudgetStatus,
    OverflowMode,
    ProviderCandidate,
    QueueSignals,
    Reason,
    RouteDecision,
    check_budget,
    decide,
    estimate_wait_ms,
)
from lmfleet.overflow.budget import DAY_S
from lmfleet.overflow.margin import applied_margin_ms
from lmfleet.overflow.policy import LOCAL
from lmfleet.overflow.policies import Action, AttemptState, Permissions, Policy, PolicyTimers, next_step
from lmfleet.store import Cap, Ledger, StoreUnavailable, caps_for_budget, tenant_key
from lmfleet.tenants import PRIORITY_HEADER, Outcome, Tenant, TenantBook, Ticket

log = logging.getLogger("lmfleet.gateway")

BUDGET_CACHE_S = 1.0


_LOCAL_FIRST = frozenset({Policy.TTFT_TIMEOUT, Policy.ON_ERROR})
"""Policies that send every request locally first, whatever the estimate."""
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
    if order is not None and waiting_by_order:
        behind = sum(n for o, n in waiting_by_order.items() if o > order)
        if behind:
            signals = dataclasses.replace(signals, in_flight=max(0, signals.in_flight - behind))
    return estimate_wait_ms(signals, capacity, cold_service_s=cold_service_s, cold_ttft_s=cold_ttft_s,
                            prompt_tokens=prompt_tokens)


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
        o = m.app.cfg.overflow
        q = m.queue
        waiting = q.waiting_by_order if q is not None and order is not None else _NO_WAITING
        return class_wait_ms(signals or m.local.tracker.snapshot(), m.app.capacity, waiting, order,
                             cold_service_s=o.cold_service_s, cold_ttft_s=o.cold_ttft_s, prompt_tokens=prompt_tokens)

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

        ``tenant``/``cls``: who sent it and in which priority class (None: no tenant admission). A tenant over
        its limits gets 429 (:func:`lmfleet.tenants.admit`); a class with a local deadline (batch) stays local
        while the predicted wait is within it and reaches a paid provider only when the tenant allows it.

        Raises a 429 :class:`GatewayError` when the budget is spent, the local queue is too long and the
        fleet is configured to reject rather than queue, or when the tenant's admission refuses it.
        """
        signals = m.local.tracker.snapshot()
        estimate = self.estimate(m, signals, order=cls.order if cls is not None else None,
                                 prompt_tokens=prompt_tokens)
        m.last_estimate_ms = estimate
        self._child(self.metrics.queue_estimate, m.name).set(estimate)
        candidates = [ProviderCandidate(p.name, p.cfg.model_map, p.healthy(), p.in_flight, p.cfg.max_concurrency)
                      for p in m.providers]
        budget = await self.budget_status() if candidates else None
        guard = self.guard if candidates else None
        store_down = (guard is not None and guard.is_down) or self.ledger_down
        if guard is not None and store_down:
            guard.probe_if_due()  # the route reopens once a probe gets through
        mode = m.mode
        local_down = not m.local.health.is_ready(m.name)
        if local_down and mode is not OverflowMode.FORCE_OFF and candidates:
            mode = OverflowMode.FORCE_ON  # anyone healthy beats a 503
        o = m.app.cfg.overflow
        # the decision weighs the estimate plus the miss margin (how much longer than predicted recent requests near
        # the threshold waited, or its prior while too few did and the engine is busy); the plan, its header and the
        # ledger keep the estimate itself
        margin = m.margin.margin_ms(m.threshold_ms, idle=signals.in_flight == 0)
        self._child(self.metrics.miss_margin, m.name).set(margin)
        d = decide(model=m.name, estimate_ms=estimate + applied_margin_ms(estimate, margin, m.threshold_ms),
                   threshold_ms=m.threshold_ms, hysteresis=o.hysteresis,
                   state=m.hysteresis, mode=mode, enabled=o.enabled or m.mode is OverflowMode.FORCE_ON,
                   budget=budget, on_exhausted=self.budget.on_exhausted, candidates=candidates,
                   store_down=store_down, peers_overflowing=m.peers_overflowing())
        if cls is None or cls.max_wait_s is None or m.queue is None:
            # with a queue, only requests whose route follows decide() move the model's hysteresis band (reported
            # to the peers and the dashboard as "overflowing"): a batch request's estimate counts the whole queue,
            # which an interactive one overtakes, and must not lower the bar interactive requests overflow at
            m.hysteresis = d.state
        reason: Reason = (Reason.LOCAL_UNAVAILABLE if mode is not m.mode and d.is_provider
                                            else d.reason)
        if (d.reason is Reason.QUEUE_ESTIMATE_ABOVE_THRESHOLD and m.timers.policy in _LOCAL_FIRST
                and (cls is None or cls.max_wait_s is None)):  # a batch class's deadline is the tenant's rule
            d, reason = self._policy_admission(m, d, estimate, cls, tenant)
        if tenant is not None and cls is not None and self.tenants is not None:
            plan = await self._admit(m, tenant, cls, prompt_tokens, d, reason, estimate, budget, store_down,
                                     local_down)
            caps = self.tenant_caps.get(tenant.name)
            return dataclasses.replace(plan, spend_caps=caps) if caps else plan
        self._child(self.metrics.overflowed, m.name, d.target, reason.value).inc()
        return self._plan(m, d, reason, estimate, budget, store_down)

    @staticmethod
    def _policy_admission(m: ServedModel, d: RouteDecision, estimate: float, cls: PriorityClass | None,
                          tenant: Tenant | None) -> tuple[RouteDecision, Reason]:
        """``decide()`` would spill ``d`` on the estimate; under ttft_timeout and on_error,
        :func:`lmfleet.overflow.policies.next_step` at admission keeps it local. (predictive and hedge admit as
        ``decide()`` does: its hysteresis band and the miss margin included.)"""
        step = next_step(m.timers, now=time.monotonic(), estimate_ms=estimate, threshold_ms=m.threshold_ms,
                         permissions=_permissions(cls, tenant), provider_open=True, attempt=AttemptState())
        if step.action is Action.SEND_LOCAL:
            return dataclasses.replace(d, target=LOCAL, reason=Reason.LOCAL_FIRST), Reason.LOCAL_FIRST
        return d, d.reason

    async def _admit(self, m: ServedModel, tenant: Tenant, cls: PriorityClass, prompt_tokens: int, d: RouteDecision,
                     reason: Reason, estimate: float, budget: BudgetStatus | None, store_down: bool,
                     local_down: bool) -> Plan:
        """Today's decision ``d`` under the tenant's admission: its limits (429), and for a class with a local
        deadline: local while within it, a paid provider only when the tenant allows it, else 429. Admission and
        counting are one step (:meth:`TenantBook.enter`: one transaction when the limits are shared)."""
        book = self.tenants
        assert book is not None
        headers = self._class_headers[cls.name]
        ticket: Ticket | None = None
        if book.is_limited(tenant) or cls.max_wait_s is not None:
            # an interactive request that decide() rejects is refused by _plan: checked, not counted
            a, ticket = await book.enter(tenant, cls, estimate_ms=estimate, threshold_ms=m.threshold_ms,
                                         provider_ok=d.is_provider, prompt_tokens=prompt_tokens,
                                         take=not (d.is_reject and cls.max_wait_s is None))
            if a.outcome is Outcome.REJECT:
                self._child(self.metrics.overflowed, m.name, "reject", a.reason.value).inc()
                self._child(self.metrics.tenant_rejected, tenant.name, a.reason.value).inc()
                body = a.body() or {}
                err = body.get("error", {})
                raise GatewayError(429, a.message or "Rate limit reached.", type=err.get("type"),
                                   code=err.get("code"), headers={**a.headers, **headers})
            if a.headers:
                headers = {**a.headers, **headers}
            if cls.max_wait_s is not None and a.outcome is not Outcome.PROVIDER and not (
                    local_down and d.is_provider and tenant.batch_may_use_providers):
                # held locally (within its deadline): a paid provider only as a fallback the tenant allows
                why = Reason.WITHIN_DEADLINE if d.is_provider or d.is_reject else reason
                self._child(self.metrics.overflowed, m.name, "local", why.value).inc()
                fallbacks = self._fallbacks(m, None, budget, store_down) if tenant.batch_may_use_providers else []
                return Plan([m.local, *fallbacks], why, estimate, ticket, headers, cls,
                            permissions=_permissions(cls, tenant))
        self._child(self.metrics.overflowed, m.name, d.target, reason.value).inc()
        return self._plan(m, d, reason, estimate, budget, store_down, tenant, headers, cls, ticket)

    def _fallbacks(self, m: ServedModel, chosen: str | None, budget: BudgetStatus | None,
                   store_down: bool) -> list[Backend]:
        if (budget is None or budget.allowed) and not store_down and m.mode is not OverflowMode.FORCE_OFF:
            return [p for p in m.providers if p.name != chosen and p.healthy()]
        return []

    def _plan(self, m: ServedModel, d: RouteDecision, reason: Reason, estimate: float,
              budget: BudgetStatus | None, store_down: bool, tenant: Tenant | None = None,
              headers: Mapping[str, str] = _NO_HEADERS, cls: PriorityClass | None = None,
              ticket: Ticket | None = None) -> Plan:
        """The backends of decision ``d``: the chosen one first, then the fallbacks (429 for a reject); the
        tenant's request is counted (``ticket``, unless admission counted it already) only once it cannot be
        refused any more."""
        if d.is_reject:
            if ticket is not None:  # not reached (_admit counts no such request); never leak a slot
                ticket.release()
            why = ("The budget store cannot be reached, so paid providers are closed,"
                   if d.reason is Reason.BUDGET_STORE_DOWN else "External spending budget exhausted")
            raise GatewayError(429, f"{why} and the local queue for {m.name!r} is "
                               f"full (predicted wait {estimate:.0f} ms). Retry later.", code="budget_exhausted",
                               headers={"retry-after": str(max(1, int(d.retry_after_s or 60)))})
        fallbacks = self._fallbacks(m, d.target, budget, store_down)
        if ticket is None and tenant is not None and self.tenants is not None:
            ticket = self.tenants.take(tenant)
        perms = _permissions(cls, tenant)
        if d.is_provider:
            chosen = next(p for p in m.providers if p.name == d.target)
            return Plan([chosen, *fallbacks, m.local], reason, estimate, ticket, headers, cls, permissions=perms)
        return Plan([m.local, *fallbacks], reason, estimate, ticket, headers, cls, permissions=perms)


def _permissions(cls: PriorityClass | None, tenant: Tenant | None) -> Permissions:
    """What the request's class and tenant allow: a class with a local deadline (batch) pays for a provider only
    when its tenant allows it."""
    return Permissions(batch=cls is not None and cls.max_wait_s is not None,
                       batch_may_use_providers=tenant is not None and tenant.batch_may_use_providers)
