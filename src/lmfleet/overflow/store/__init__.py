"""Exact, shared spend caps for paid providers: reserve the worst case before dispatch, settle after.

    decision.py   pure: a request's worst-case cost, caps (key, window, cap), fit and retry-after
    base.py       the SpendStore protocol, its records, its errors
    _sql.py       the store over SQL (reservations, settled buckets, ledger rows in one database)
    _rate.py      tenants' slots in flight and rate windows in the same database (``admit_tenant``)
    sqlite.py     one node, several processes (the embedded default; the ledger's SQLite file)
    postgres.py   several nodes (``ledger.url: postgresql://...``); its ``PgDatabase`` also serves the ledger

See ``_sql.py`` for the tables and the locking, ``decision.py`` for the arithmetic.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from lmfleet.config.models import LedgerConfig
from lmfleet.overflow.store.base import (
    Reservation,
    Spend,
    SpendStore,
    SpendStoreError,
    StoreUnavailable,
    UsageRecord,
)
from lmfleet.overflow.store.decision import (
    GLOBAL,
    Cap,
    Refusal,
    caps_exceeded,
    caps_for_budget,
    retry_after_s,
    tenant_key,
    worst_case_cost_nusd,
)
from lmfleet.overflow.store.postgres import PostgresSpendStore
from lmfleet.overflow.store.sqlite import SqliteSpendStore

__all__ = [
    "GLOBAL",
    "Cap",
    "PostgresSpendStore",
    "Refusal",
    "Reservation",
    "Spend",
    "SpendStore",
    "SpendStoreError",
    "SqliteSpendStore",
    "StoreUnavailable",
    "UsageRecord",
    "caps_exceeded",
    "caps_for_budget",
    "database_password",
    "open_spend_store",
    "retry_after_s",
    "tenant_key",
    "worst_case_cost_nusd",
]


def open_spend_store(cfg: LedgerConfig, *, environ: Mapping[str, str] = os.environ,
                     clock: Callable[[], float] | None = None) -> SpendStore:
    """The store ``ledger:`` names: PostgreSQL at ``url`` (password from ``password_env``), else SQLite at ``path``.

    Raises ``StoreUnavailable`` (one line) when the database cannot be reached or opened, within
    ``connect_timeout_s``; ``SpendStoreError`` when the password variable is unset or psycopg is missing.
    """
    extra = {} if clock is None else {"clock": clock}
    if cfg.url is None:
        return SqliteSpendStore(cfg.path, ttl_s=cfg.reservation_ttl_s, busy_timeout_s=cfg.connect_timeout_s, **extra)
    return PostgresSpendStore(cfg.url, password=database_password(cfg, environ), ttl_s=cfg.reservation_ttl_s,
                              connect_timeout_s=cfg.connect_timeout_s, statement_timeout_s=cfg.connect_timeout_s,
                              **extra)


def database_password(cfg: LedgerConfig, environ: Mapping[str, str]) -> str | None:
    """The PostgreSQL password from the variable ``password_env`` names (None: none configured).
    ``SpendStoreError`` when that variable is not set."""
    if cfg.password_env is None:
        return None
    password = environ.get(cfg.password_env)
    if password is None:
        raise SpendStoreError(f"ledger.password_env names {cfg.password_env}, which is not set")
    return password
