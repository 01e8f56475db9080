"""Everything lmfleet keeps in a database: the request ledger, spend reservations, tenants' counters and overrides.

One database holds it all: a SQLite file (``ledger.path``, one node, the embedded default) or PostgreSQL
(``ledger.url``, several nodes). Module map::

    schema.py     every table, declared once; the one list of migrations (the version reached is in the database)
    sqlite.py     SqliteDatabase: the SQLite file (WAL, BEGIN IMMEDIATE for locked keys)
    postgres.py   PgDatabase: a small connection pool, row locks per key, advisory lock for migrations
    records.py    the records, the Database and SpendStore interfaces, the errors
    caps.py       pure: a request's worst-case cost, spend caps (key, window, cap) and whether an amount fits
    ledger.py     SqlLedger (Ledger, PostgresLedger): append requests; spend and usage summaries
    spend.py      SqlSpendStore (SqliteSpendStore, PostgresSpendStore): reserve, settle, release, record
    tenants.py    tenants' slots in flight, rate windows and settings overrides (mixed into SqlSpendStore)

``open_ledger(cfg)`` and ``open_spend_store(cfg)`` open the database ``ledger:`` names. The rolling-window
arithmetic (when a capped amount fits again) is ``lmfleet.overflow.budget.retry_after_s``.

Exceptions::

    LmfleetError
     └── SpendStoreError       anything the store cannot do (password variable unset, psycopg missing)
          └── StoreUnavailable the database cannot be read or written (down, locked, full, unreachable):
                               reservations fail closed; the gateway closes the provider route
                               (keeps the request local or answers 429). Recoverable: a later call retries.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

from lmfleet.config.models import LedgerConfig
from lmfleet.store.caps import (
    GLOBAL,
    Cap,
    Refusal,
    caps_exceeded,
    caps_for_budget,
    tenant_key,
    worst_case_cost_nusd,
)
from lmfleet.store.ledger import DEFAULT_TENANT, Grouping, Ledger, PostgresLedger, SqlLedger, UsageRow
from lmfleet.store.postgres import PgDatabase, redact_url
from lmfleet.store.records import (
    Database,
    Reservation,
    Spend,
    SpendStore,
    SpendStoreError,
    StoreUnavailable,
    UsageRecord,
)
from lmfleet.store.schema import MIGRATIONS, TABLES
from lmfleet.store.spend import PostgresSpendStore, SqliteSpendStore, SqlSpendStore
from lmfleet.store.sqlite import SqliteDatabase
from lmfleet.store.tenants import TenantCounts, TenantOverride

__all__ = [
    "DEFAULT_TENANT",
    "GLOBAL",
    "MIGRATIONS",
    "TABLES",
    "Cap",
    "Database",
    "Grouping",
    "Ledger",
    "PgDatabase",
    "PostgresLedger",
    "PostgresSpendStore",
    "Refusal",
    "Reservation",
    "Spend",
    "SpendStore",
    "SpendStoreError",
    "SqlLedger",
    "SqlSpendStore",
    "SqliteDatabase",
    "SqliteSpendStore",
    "StoreUnavailable",
    "TenantCounts",
    "TenantOverride",
    "UsageRecord",
    "UsageRow",
    "caps_exceeded",
    "caps_for_budget",
    "database_password",
    "describe",
    "open_ledger",
    "open_spend_store",
    "tenant_key",
    "worst_case_cost_nusd",
]


def open_spend_store(cfg: LedgerConfig, *, environ: Mapping[str, str] = os.environ,
                     clock: Callable[[], float] = time.time) -> SqlSpendStore:
    """The store ``ledger:`` names: PostgreSQL at ``url`` (password from ``password_env``), else SQLite at ``path``.

    Raises ``StoreUnavailable`` (one line) when the database cannot be reached or opened, within
    ``connect_timeout_s``; ``SpendStoreError`` when the password variable is unset or psycopg is missing.
    """
    if cfg.url is None:
        return SqliteSpendStore(cfg.path, ttl_s=cfg.reservation_ttl_s, busy_timeout_s=cfg.connect_timeout_s,
                                clock=clock)
    return PostgresSpendStore(cfg.url, password=database_password(cfg, environ), ttl_s=cfg.reservation_ttl_s,
                              connect_timeout_s=cfg.connect_timeout_s, statement_timeout_s=cfg.connect_timeout_s,
                              clock=clock)


def open_ledger(cfg: LedgerConfig, environ: Mapping[str, str] = os.environ, *,
                clock: Callable[[], float] = time.time) -> SqlLedger:
    """The ledger ``ledger:`` names: PostgreSQL at ``url`` (password from ``password_env``), else SQLite at ``path``.

    Raises ``StoreUnavailable`` (one line) when the database cannot be reached or opened within
    ``connect_timeout_s``; ``SpendStoreError`` when the password variable is unset or psycopg is missing.
    """
    if cfg.url is None:
        return Ledger(cfg.path, clock=clock)
    return PostgresLedger(cfg.url, password=database_password(cfg, environ), connect_timeout_s=cfg.connect_timeout_s,
                          statement_timeout_s=cfg.connect_timeout_s, clock=clock)


def describe(cfg: LedgerConfig) -> str:
    """Where the ledger lives, for messages (no password)."""
    return str(os.path.expanduser(cfg.path)) if cfg.url is None else redact_url(cfg.url)


def database_password(cfg: LedgerConfig, environ: Mapping[str, str]) -> str | None:
    """The PostgreSQL password from the variable ``password_env`` names (None: none configured).
    ``SpendStoreError`` when that variable is not set."""
    if cfg.password_env is None:
        return None
    password = environ.get(cfg.password_env)
    if password is None:
        raise SpendStoreError(f"ledger.password_env names {cfg.password_env}, which is not set")
    return password
