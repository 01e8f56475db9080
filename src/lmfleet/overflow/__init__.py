"""Queue-aware overflow: load signals, wait estimate, routing policy, breaker, budget, cost and ledger.

Pure decision modules (no I/O): ``signals``, ``estimator``, ``policy``, ``breaker``, ``budget``, ``cost``,
``money`` (integer nano-dollars).
The I/O packages are ``ledger`` and ``store`` (SQLite or PostgreSQL). See docs/overflow.md.
"""

from lmfleet.overflow.breaker import BreakerState, CircuitBreaker, backoff_s, parse_retry_after
from lmfleet.overflow.budget import BudgetStatus, check_budget
from lmfleet.overflow.cost import LocalCostMeter, external_cost_usd, local_hourly_cost_usd, local_usd_per_token
from lmfleet.overflow.estimator import estimate_wait_ms, local_capacity
from lmfleet.overflow.ledger import (
    Ledger,
    PostgresLedger,
    SqlLedger,
    UsageRow,
    open_ledger,
    served_by_local,
    served_by_provider,
)
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
    "Ledger",
    "LoadTracker",
    "LocalCostMeter",
    "OverflowMode",
    "PostgresLedger",
    "ProviderCandidate",
    "QueueSignals",
    "Reason",
    "RouteDecision",
    "SqlLedger",
    "Ticket",
    "UsageRow",
    "backoff_s",
    "check_budget",
    "decide",
    "estimate_wait_ms",
    "external_cost_usd",
    "local_capacity",
    "local_hourly_cost_usd",
    "local_usd_per_token",
    "open_ledger",
    "parse_retry_after",
    "providers_for",
    "served_by_local",
    "served_by_provider",
]
