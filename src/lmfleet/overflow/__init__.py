"""Queue-aware overflow: load signals, wait estimate, routing policy, breaker, budget and cost.

Pure decision modules (no I/O): ``signals``, ``estimator``, ``margin``, ``policy``, ``breaker``, ``budget``, ``cost``,
``money`` (integer nano-dollars). The ledger and the spend store (SQLite or PostgreSQL) are ``lmfleet.store``.
See docs/overflow.md.
"""

from lmfleet.overflow.breaker import BreakerState, CircuitBreaker, backoff_s, parse_retry_after
from lmfleet.overflow.budget import BudgetStatus, check_budget
from lmfleet.overflow.cost import LocalCostMeter, external_cost_usd, local_hourly_cost_usd, local_usd_per_token
from lmfleet.overflow.estimator import estimate_wait_ms, local_capacity
from lmfleet.overflow.policy import (
    HysteresisState,
    OverflowMode,
    ProviderCandidate,
    Reason,
    RouteDecision,
    decide,
    providers_for,
)
from lmfleet.overflow.signals import LoadTracker, QueueSignals, Ticket

__all__ = [
    "BreakerState",
    "BudgetStatus",
    "CircuitBreaker",
    "HysteresisState",
    "LoadTracker",
    "LocalCostMeter",
    "OverflowMode",
    "ProviderCandidate",
    "QueueSignals",
    "Reason",
    "RouteDecision",
    "Ticket",
    "backoff_s",
    "check_budget",
    "decide",
    "estimate_wait_ms",
    "external_cost_usd",
    "local_capacity",
    "local_hourly_cost_usd",
    "local_usd_per_token",
    "parse_retry_after",
    "providers_for",
]
