"""The route decision for one request, as one pure function: :func:`route_plan` (inputs in, a plan out).

The router (:class:`lmfleet.gateway.routing.router.Router`) gathers the inputs (load, margin, breakers, budget,
store and local health, the tenant's class) and applies the plan's effects (the model's hysteresis state, the
metrics, the tenant's ticket, the 429); nothing here reads a clock, a lock or the network.

The bar (the one threshold semantics of the route, the tenants' admission and the policy)::

    weighed = estimate_ms + applied_margin_ms(estimate_ms, margin_ms, threshold_ms)     (overflow.margin)
    bar     = threshold_ms x (1 - hysteresis)   while this model overflows here or at a peer
              threshold_ms                      otherwise
    over the bar  <=>  weighed > bar

:func:`lmfleet.overflow.decide` applies it, and a tenant's admission (:func:`lmfleet.tenants.admit`) is asked
with the same two numbers (``weighed``, ``bar``), so "within the threshold" means one thing everywhere. A batch
class's deadline (``max_wait_s``) is compared with ``weighed`` too.

Order of the rules (first match wins where they exclude each other)::

    local deployment not ready, mode not force_off,
        and a provider maps the model                      -> decide() in force_on; reason "local_unavailable"
    decide(weighed, bar, mode, budget, store, candidates)  -> local / NAME / reject       (overflow.policy)
    policy ttft_timeout or on_error, decide() spilled
        on the estimate, class without max_wait_s          -> local "local_first" (next_step's admission row)
    tenant limited or class with max_wait_s, no admission  -> ask: admit with (weighed, bar, provider_ok, take)
    admission refused                                      -> 429 (its code, message, headers)
    class with max_wait_s, admission not "provider"        -> local "within_deadline" (or decide()'s local reason);
        (unless the local deployment is down and the           fallbacks: healthy providers only when the tenant
         tenant may use providers)                             allows them
    decide() rejects                                       -> 429 budget_exhausted (Retry-After from the budget)
    decide() chose provider NAME                           -> NAME, healthy fallbacks, local last
    otherwise                                              -> local, healthy fallbacks

Fallbacks are the healthy providers (other than the chosen one) while the budget allows, its store is up and the
operator's mode is not force_off. The hysteresis state moves with every request whose route follows ``decide()``:
not a batch request behind a local queue (its estimate counts the whole queue, which an interactive request
overtakes, and must not lower the bar interactive requests overflow at).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from lmfleet.config.tenants import PriorityClass
from lmfleet.overflow import BudgetStatus, HysteresisState, OverflowMode, ProviderCandidate, Reason, decide
from lmfleet.overflow.margin import applied_margin_ms
from lmfleet.overflow.policy import LOCAL, REJECT
from lmfleet.overflow.policies import Permissions, Policy
from lmfleet.tenants import Admission, Outcome, Tenant

__all__ = ["LOCAL", "AdmissionAsk", "Refusal", "RouteInputs", "RoutePlan", "route_plan"]

LOCAL_FIRST_POLICIES = frozenset({Policy.TTFT_TIMEOUT, Policy.ON_ERROR})
"""Policies that send every request locally first, whatever the estimate (next_step's admission row)."""
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class RouteInputs:
    """Everything the route of one request depends on, read by the router at one moment."""

    model: str
    estimate_ms: float
    """The predicted local wait for this request (its class's place in the queue, its prompt)."""
    threshold_ms: float
    margin_ms: float = 0.0
    """The model's miss margin now (:class:`lmfleet.overflow.margin.MissMargin`); applied per the module docstring."""
    hysteresis: float = 0.0
    state: HysteresisState = HysteresisState()
    peers_overflowing: bool = False
    mode: OverflowMode = OverflowMode.AUTO
    """The operator's mode for the model."""
    enabled: bool = True
    """``overflow.enabled`` for the model."""
    policy: Policy = Policy.PREDICTIVE
    budget: BudgetStatus | None = None
    on_exhausted: str = "queue"
    candidates: Sequence[ProviderCandidate] = ()
    """The model's providers in priority order, with their health and concurrency now."""
    store_down: bool = False
    """The budget store (or the ledger) cannot be read or written: paid providers are closed."""
    local_ready: bool = True
    has_queue: bool = False
    """The model has a local priority queue (tenants configured)."""
    tenant: Tenant | None = None
    cls: PriorityClass | None = None
    tenant_limited: bool = False
    """The tenant has a rate or concurrency limit (its admission counts it)."""
    class_headers: Mapping[str, str] = field(default_factory=lambda: _NO_HEADERS)
    """The headers of the request's class on every answer (``x-lmfleet-priority``)."""


@dataclass(frozen=True)
class AdmissionAsk:
    """The tenant's admission to ask for (:meth:`lmfleet.tenants.TenantBook.enter`) before the plan is final."""

    estimate_ms: float
    """The weighed estimate (module docstring)."""
    threshold_ms: float
    """The bar (module docstring)."""
    provider_ok: bool
    take: bool
    """Count the request on admission (False: the route refuses it anyway; checked, not counted)."""


@dataclass(frozen=True)
class Refusal:
    """A 429 the router answers with."""

    message: str
    code: str | None
    type: str | None = None
    headers: Mapping[str, str] = field(default_factory=lambda: _NO_HEADERS)
    tenant_reason: Reason | None = None
    """The tenant's admission refused it (counted per tenant), None: the route did."""


@dataclass(frozen=True)
class RoutePlan:
    """The route of one request: where it goes (``order``: ``LOCAL`` or provider names), or what the router must
    do first (``ask``), or the 429 to answer (``refusal``)."""

    order: tuple[str, ...]
    reason: Reason
    state: HysteresisState | None
    """The model's hysteresis state from now on (None: this request leaves it as it is)."""
    counted: tuple[str, Reason] | None = None
    """The overflow decision's metric labels (target, reason); None while ``ask`` is pending."""
    ask: AdmissionAsk | None = None
    refusal: Refusal | None = None
    take_ticket: bool = False
    """Count the request on its tenant now (no admission counted it)."""
    headers: Mapping[str, str] = field(default_factory=lambda: _NO_HEADERS)
    permissions: Permissions = Permissions()

    @property
    def target(self) -> str:
        return REJECT if self.refusal is not None else self.order[0]


def route_plan(inp: RouteInputs, admission: Admission | None = None) -> RoutePlan:
    """The plan for one request (the module docstring's rules). ``admission``: the tenant's admission, once the
    router has asked for it (a first call returns :attr:`RoutePlan.ask` when it is needed). Pure."""
    mode = inp.mode
    local_down = not inp.local_ready
    if local_down and mode is not OverflowMode.FORCE_OFF and inp.candidates:
        mode = OverflowMode.FORCE_ON  # anyone healthy beats a 503
    weighed = inp.estimate_ms + applied_margin_ms(inp.estimate_ms, inp.margin_ms, inp.threshold_ms)
    d = decide(model=inp.model, estimate_ms=weighed, threshold_ms=inp.threshold_ms, hysteresis=inp.hysteresis,
               state=inp.state, mode=mode, enabled=inp.enabled or inp.mode is OverflowMode.FORCE_ON,
               budget=inp.budget, on_exhausted=inp.on_exhausted, candidates=inp.candidates,
               store_down=inp.store_down, peers_overflowing=inp.peers_overflowing)
    cls, tenant = inp.cls, inp.tenant
    batch = cls is not None and cls.max_wait_s is not None
    state = d.state if not (batch and inp.has_queue) else None
    reason = Reason.LOCAL_UNAVAILABLE if mode is not inp.mode and d.is_provider else d.reason
    if d.reason is Reason.QUEUE_ESTIMATE_ABOVE_THRESHOLD and inp.policy in LOCAL_FIRST_POLICIES and not batch:
        d = dataclasses.replace(d, target=LOCAL, reason=Reason.LOCAL_FIRST)  # a batch class's deadline rules it
        reason = Reason.LOCAL_FIRST
    perms = Permissions(batch=batch, batch_may_use_providers=tenant is not None and tenant.batch_may_use_providers)
    headers = inp.class_headers
    fallbacks_open = ((inp.budget is None or inp.budget.allowed) and not inp.store_down
                      and inp.mode is not OverflowMode.FORCE_OFF)
    counted = admission is not None
    if tenant is not None and cls is not None and (inp.tenant_limited or batch):
        if admission is None:
            bar = inp.threshold_ms * (1.0 - inp.hysteresis) if (
                inp.state.overflowing or inp.peers_overflowing) else inp.threshold_ms
            return RoutePlan((), reason, state, ask=AdmissionAsk(weighed, bar, d.is_provider,
                                                                  take=not (d.is_reject and not batch)))
        if admission.outcome is Outcome.REJECT:
            err = (admission.body() or {}).get("error", {})
            return RoutePlan((), admission.reason, state, ("reject", admission.reason), refusal=Refusal(
                admission.message or "Rate limit reached.", err.get("code"), err.get("type"),
                {**admission.headers, **headers}, admission.reason))
        if admission.headers:
            headers = {**admission.headers, **headers}
        if batch and admission.outcome is not Outcome.PROVIDER and not (
                local_down and d.is_provider and tenant.batch_may_use_providers):
            # held locally (within its deadline): a paid provider only as a fallback the tenant allows
            why = Reason.WITHIN_DEADLINE if d.is_provider or d.is_reject else reason
            fallbacks = _healthy(inp.candidates, None) if fallbacks_open and tenant.batch_may_use_providers else ()
            return RoutePlan((LOCAL, *fallbacks), why, state, ("local", why), headers=headers, permissions=perms)
    if d.is_reject:
        why = ("The budget store cannot be reached, so paid providers are closed,"
               if d.reason is Reason.BUDGET_STORE_DOWN else "External spending budget exhausted")
        return RoutePlan((), reason, state, (d.target, reason), refusal=Refusal(
            f"{why} and the local queue for {inp.model!r} is full (predicted wait {inp.estimate_ms:.0f} ms). "
            "Retry later.", "budget_exhausted", headers={"retry-after": str(max(1, int(d.retry_after_s or 60)))}))
    fallbacks = _healthy(inp.candidates, d.target) if fallbacks_open else ()
    order = (d.target, *fallbacks, LOCAL) if d.is_provider else (LOCAL, *fallbacks)
    return RoutePlan(order, reason, state, (d.target, reason), take_ticket=tenant is not None and not counted,
                     headers=headers, permissions=perms)


def _healthy(candidates: Sequence[ProviderCandidate], chosen: str | None) -> tuple[str, ...]:
    return tuple(c.name for c in candidates if c.name != chosen and c.healthy)
