"""The overflow decision: serve locally, send to a provider, or reject. A pure function.

Order of the checks (first match wins)::

    mode force_off, or overflow disabled for the model  -> local   "forced_local" / "overflow_disabled"
    mode auto and no pressure                           -> local   "local_ok"
    (pressure, or mode force_on)
      budget exhausted, on_exhausted == "reject"        -> reject  "budget_exhausted" (retry_after_s)
      budget exhausted, on_exhausted == "queue"         -> local   "budget_exhausted"
      budget store down, on_exhausted == "reject"       -> reject  "budget_store_down" (STORE_DOWN_RETRY_S)
      budget store down, on_exhausted == "queue"        -> local   "budget_store_down"
      no candidate maps the model and its breaker allows -> local  "no_healthy_provider"
      healthy candidates, all at max_concurrency        -> local   "providers_at_capacity"
      first healthy candidate with headroom             -> NAME    "queue_estimate_above_threshold" / "forced_overflow"

``estimate_ms`` is what the route weighs: the gateway passes the predicted wait plus the miss margin
(:mod:`lmfleet.overflow.margin`). Hysteresis: *pressure* is ``estimate_ms > threshold_ms`` while not overflowing, and
``estimate_ms > threshold_ms * (1 - hysteresis)`` while overflowing, so the route does not flap
around the threshold. The caller owns the state: it passes the model's current
:class:`HysteresisState` and stores ``decision.state`` for the next request. The state follows
pressure only (a forced mode resets it), so a budget or provider outage does not reset it.

Several gateways: ``peers_overflowing`` says another gateway of the fleet is overflowing this model (as it
last reported). Its bar is then the lower one too, so N gateways that share one queue estimate also share one
hysteresis band: without it, one gateway inside the band keeps overflowing while another, having entered the
band from below, keeps sending local, and together they let the queue grow past where one gateway would stop.
Only this gateway's own pressure becomes its next state, so the shared band cannot keep itself alive.

A budget store that is down (the spend ledger cannot be written) is treated as a spent budget: no paid
request may start while its cost cannot be held, so the provider route is closed until it answers.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lmfleet.config.models import ModelConfig, ProviderConfig
from lmfleet.overflow.budget import BudgetStatus

__all__ = [
    "LOCAL",
    "REJECT",
    "STORE_DOWN_RETRY_S",
    "HysteresisState",
    "OverflowMode",
    "ProviderCandidate",
    "Reason",
    "RouteDecision",
    "decide",
    "providers_for",
]

LOCAL = "local"
REJECT = "reject"
STORE_DOWN_RETRY_S = 10.0
"""Retry-After of a 429 answered because the budget store is down (its recovery time is unknown)."""


class OverflowMode(str, enum.Enum):
    """The operator's switch for a model."""

    AUTO = "auto"
    FORCE_ON = "force_on"  # every request overflows while a provider and budget allow
    FORCE_OFF = "force_off"  # every request stays local


class Reason(str, enum.Enum):
    """Why a request went where it went (``x-lmfleet-route-reason``, the ``route_reason`` ledger column), or why
    it was refused: the overflow decision's reasons, the gateway's, and tenant admission's
    (:func:`lmfleet.tenants.admit`)."""

    LOCAL_OK = "local_ok"
    FORCED_LOCAL = "forced_local"
    OVERFLOW_DISABLED = "overflow_disabled"
    QUEUE_ESTIMATE_ABOVE_THRESHOLD = "queue_estimate_above_threshold"
    FORCED_OVERFLOW = "forced_overflow"
    BUDGET_EXHAUSTED = "budget_exhausted"
    BUDGET_STORE_DOWN = "budget_store_down"
    NO_HEALTHY_PROVIDER = "no_healthy_provider"
    PROVIDERS_AT_CAPACITY = "providers_at_capacity"
    # set by the gateway, not by decide(): the local deployment is down, or an earlier attempt failed
    LOCAL_UNAVAILABLE = "local_unavailable"
    FALLBACK_AFTER_LOCAL_ERROR = "fallback_after_local_error"
    FALLBACK_AFTER_PROVIDER_ERROR = "fallback_after_provider_error"
    # set by the gateway under overflow.policy (lmfleet.overflow.policies): kept local at admission whatever the
    # estimate (ttft_timeout, on_error); served by a provider after the local attempt was cancelled at its timer
    # (ttft_timeout); a hedged request's answer from the provider or the local engine; the ledger row of an
    # attempt cancelled by either (its prompt and whatever it generated, status 499)
    LOCAL_FIRST = "local_first"
    TTFT_TIMEOUT = "ttft_timeout"
    TTFT_TIMEOUT_CANCELLED = "ttft_timeout_cancelled"
    HEDGE_WON = "hedge_won"
    HEDGE_LOCAL_WON = "hedge_local_won"
    HEDGE_CANCELLED = "hedge_cancelled"
    # tenant admission (lmfleet.tenants.admission): a class's local deadline, a tenant's limits
    WITHIN_DEADLINE = "within_deadline"
    NO_PROVIDER = "no_provider"
    OVER_THRESHOLD = "over_threshold"
    OVER_DEADLINE = "over_deadline"
    CONCURRENCY_LIMIT = "concurrency_limit"
    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_MINUTE = "tokens_per_minute"
    DEADLINE = "deadline"


@dataclass(frozen=True)
class HysteresisState:
    overflowing: bool = False


@dataclass(frozen=True)
class ProviderCandidate:
    """One provider as the gateway sees it right now, in priority order."""

    name: str
    model_map: Mapping[str, str]
    healthy: bool
    """The breaker lets a request through now (``CircuitBreaker.allows()``), not rate-limit blocked."""
    in_flight: int = 0
    max_concurrency: int | None = None

    def has_headroom(self) -> bool:
        return self.max_concurrency is None or self.in_flight < self.max_concurrency


@dataclass(frozen=True)
class RouteDecision:
    target: str
    """``"local"``, a provider name, or ``"reject"``."""
    reason: Reason
    state: HysteresisState
    """Hysteresis state to store for the model's next decision."""
    retry_after_s: float | None = None
    """For ``"reject"``: seconds to put in the Retry-After header."""
    estimate_ms: float | None = field(default=None, compare=False)

    @property
    def is_local(self) -> bool:
        return self.target == LOCAL

    @property
    def is_reject(self) -> bool:
        return self.target == REJECT

    @property
    def is_provider(self) -> bool:
        return not (self.is_local or self.is_reject)


def decide(
    *,
    model: str,
    estimate_ms: float,
    threshold_ms: float,
    hysteresis: float,
    state: HysteresisState,
    mode: OverflowMode = OverflowMode.AUTO,
    enabled: bool = True,
    budget: BudgetStatus | None = None,
    on_exhausted: str = "queue",
    candidates: Sequence[ProviderCandidate] = (),
    store_down: bool = False,
    peers_overflowing: bool = False,
) -> RouteDecision:
    """Route one request of ``model`` (see the module docstring for the rules). ``store_down``: the budget
    store cannot hold a reservation now (``BudgetGuard.is_down``)."""
    if mode is OverflowMode.FORCE_OFF or not enabled:
        reason = Reason.FORCED_LOCAL if mode is OverflowMode.FORCE_OFF else Reason.OVERFLOW_DISABLED
        return RouteDecision(LOCAL, reason, HysteresisState(False), estimate_ms=estimate_ms)

    bar = threshold_ms * (1.0 - hysteresis) if (state.overflowing or peers_overflowing) else threshold_ms
    pressure = estimate_ms > bar
    next_state = HysteresisState(pressure)
    if mode is OverflowMode.AUTO and not pressure:
        return RouteDecision(LOCAL, Reason.LOCAL_OK, next_state, estimate_ms=estimate_ms)

    if budget is not None and not budget.allowed:
        if on_exhausted == "reject":
            return RouteDecision(REJECT, Reason.BUDGET_EXHAUSTED, next_state,
                                 retry_after_s=budget.retry_after_s, estimate_ms=estimate_ms)
        return RouteDecision(LOCAL, Reason.BUDGET_EXHAUSTED, next_state, estimate_ms=estimate_ms)
    if store_down:
        if on_exhausted == "reject":
            return RouteDecision(REJECT, Reason.BUDGET_STORE_DOWN, next_state, retry_after_s=STORE_DOWN_RETRY_S,
                                 estimate_ms=estimate_ms)
        return RouteDecision(LOCAL, Reason.BUDGET_STORE_DOWN, next_state, estimate_ms=estimate_ms)

    healthy = [c for c in candidates if model in c.model_map and c.healthy]
    if not healthy:
        return RouteDecision(LOCAL, Reason.NO_HEALTHY_PROVIDER, next_state, estimate_ms=estimate_ms)
    chosen = next((c for c in healthy if c.has_headroom()), None)
    if chosen is None:
        return RouteDecision(LOCAL, Reason.PROVIDERS_AT_CAPACITY, next_state, estimate_ms=estimate_ms)
    reason = Reason.FORCED_OVERFLOW if mode is OverflowMode.FORCE_ON else Reason.QUEUE_ESTIMATE_ABOVE_THRESHOLD
    return RouteDecision(chosen.name, reason, next_state, estimate_ms=estimate_ms)


def providers_for(model: ModelConfig, providers: Sequence[ProviderConfig]) -> list[ProviderConfig]:
    """The providers that may take ``model``'s overflow, in priority order.

    ``model.overflow.providers`` when set (its order), else every provider in file order; either
    way only those whose ``model_map`` names the model.
    """
    if model.overflow.providers is None:
        chosen = list(providers)
    else:
        by_name = {p.name: p for p in providers}
        chosen = [by_name[n] for n in model.overflow.providers if n in by_name]
    return [p for p in chosen if model.name in p.model_map]
