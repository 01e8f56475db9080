"""The ledger of every request: who served it, for which tenant, how many tokens, how long, what it cost.

    _sql.py       the reads and writes (rows, spend windows, summaries by backend or tenant), over SQL
    sqlite.py     ``Ledger``: one SQLite file (``ledger.path``), the embedded default
    postgres.py   ``PostgresLedger``: PostgreSQL (``ledger.url``), shared by several gateway nodes

``open_ledger(cfg)`` opens the one ``ledger:`` names. Both keep the ``requests`` table that the spend store
(``overflow.store``) also appends to when it settles a budget reservation.

Costs are stored as integer nano-dollars (``cost_nusd``), so every total is an exact integer sum of its
rows: the per-request costs add up to the reported totals with no float drift. Timestamps are epoch
seconds (``time.time()``), so windows survive restarts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

from lmfleet.config.models import LedgerConfig
from lmfleet.overflow.ledger._sql import DEFAULT_TENANT, Grouping, SqlLedger, UsageRow
from lmfleet.overflow.ledger.postgres import PostgresLedger
from lmfleet.overflow.ledger.sqlite import Ledger
from lmfleet.overflow.money import NUSD_PER_USD, usd_to_nusd
from lmfleet.overflow.store import database_password
from lmfleet.overflow.store.postgres import redact_url
from lmfleet.provenance import local_label, provider_label

__all__ = ["DEFAULT_TENANT", "NUSD_PER_USD", "Grouping", "Ledger", "PostgresLedger", "SqlLedger", "UsageRow",
           "describe", "open_ledger", "served_by_local", "served_by_provider", "usd_to_nusd"]

# the ledger's old names for the provenance labels (lmfleet.provenance holds the rule)
served_by_local = local_label
served_by_provider = provider_label


def open_ledger(cfg: LedgerConfig, environ: Mapping[str, str] = os.environ, *,
                clock: Callable[[], float] = time.time) -> SqlLedger:
    """The ledger ``ledger:`` names: PostgreSQL at ``url`` (password from ``password_env``), else SQLite at ``path``.

    Raises ``StoreUnavailable`` (one line) when PostgreSQL cannot be reached within ``connect_timeout_s``;
    ``SpendStoreError`` when the password variable is unset or psycopg is missing; ``OSError`` or
    ``sqlite3.Error`` when the SQLite file cannot be opened.
    """
    if cfg.url is None:
        return Ledger(cfg.path, clock=clock)
    return PostgresLedger(cfg.url, password=database_password(cfg, environ), connect_timeout_s=cfg.connect_timeout_s,
                          statement_timeout_s=cfg.connect_timeout_s, clock=clock)


def describe(cfg: LedgerConfig) -> str:
    """Where the ledger lives, for messages (no password)."""
    return str(os.path.expanduser(cfg.path)) if cfg.url is None else redact_url(cfg.url)
