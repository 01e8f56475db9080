"""The ledger in PostgreSQL (``ledger.url``): several gateway nodes, one ledger, one budget.

The ``requests`` table is the spend store's (``overflow/store/postgres.py``: same schema, same migrations,
same connection settings), so a budget settlement's row and a plain ``record`` land in one place and every
node's ``lmfleet usage`` sees all of them. Each call is one statement (autocommit: one round trip) on a
connection from a small pool. A read whose pooled connection turned out dead (the server restarted) is retried
once on a new one; a write is not (it may have landed): it raises ``StoreUnavailable`` and the gateway's ledger
writer retries it. A server that cannot be reached within ``connect_timeout_s`` raises ``StoreUnavailable``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from lmfleet.overflow.ledger._sql import SqlLedger
from lmfleet.overflow.store.postgres import PgDatabase

__all__ = ["PostgresLedger"]


class PostgresLedger(SqlLedger):
    """The ledger in the PostgreSQL database at ``url`` (tables created or upgraded on open)."""

    _BUCKET = "FLOOR(ts / ?)"

    def __init__(self, url: str, *, password: str | None = None, connect_timeout_s: float = 5.0,
                 statement_timeout_s: float = 5.0, pool_size: int = 2,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock=clock)
        self.url = url
        self._db = PgDatabase(url, password=password, connect_timeout_s=connect_timeout_s,
                              statement_timeout_s=statement_timeout_s, pool_size=pool_size)
        self._db.migrate()

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "PostgresLedger":
        return self

    def _fetch(self, sql: str, params: Sequence[Any] = ()) -> tuple[list[str], list[tuple[Any, ...]]]:
        return self._db.statement(sql, params, lambda cur: ([d.name for d in cur.description], cur.fetchall()),
                                  retry_stale=True)

    def _insert(self, sql: str, params: Sequence[Any]) -> int:
        # not retried: the caller (the gateway's ledger writer) retries StoreUnavailable in order
        return self._db.statement(sql + " RETURNING id", params, lambda cur: int(cur.fetchone()[0]),
                                  retry_stale=False)
