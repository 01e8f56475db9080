"""PostgreSQL: several gateway nodes share one budget, one ledger and the tenants' counters (``ledger.url``).

Atomicity: a transaction that locks keys takes one ``budget_keys`` row per key (``SELECT ... FOR UPDATE``, in key
order, so two transactions never deadlock), then reads and writes in READ COMMITTED; the next locker of the same
key waits on the row lock, and its next statement's snapshot has the committed writes.

Failure: connects with ``connect_timeout_s``; statements and lock waits are bounded by ``statement_timeout_s``
(server-side), so a dead or stuck server fails a call closed (``StoreUnavailable``) instead of hanging it. A broken
connection is dropped; the next call reconnects. Schema: created and migrated on open, once, under an advisory
lock (several nodes may start at once).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from lmfleet.config.redact import redact_url
from lmfleet.store.records import SpendStoreError, StoreUnavailable
from lmfleet.store.schema import Query, migrate

__all__ = ["PgDatabase", "redact_url"]

T = TypeVar("T")

_MIGRATION_LOCK = 0x6C6D666C  # pg_advisory_xact_lock id for schema changes ("lmfl")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class PgDatabase:
    """Connections to one PostgreSQL database, shared by the spend store and the ledger (``ledger.url``).

    A small pool (at most ``pool_size`` connections at once); a broken connection is dropped, and with it the
    idle ones (the server went away), so the next call reconnects. Every failure is ``StoreUnavailable``, one line.
    The schema is brought up to date on open (``lmfleet.store.schema.MIGRATIONS``), under an advisory lock.
    """

    dialect = "postgresql"
    bucket_sql = "FLOOR(ts / ?)"
    """SQL that turns ``ts`` into a bucket number of ``?`` seconds."""

    def __init__(self, url: str, *, password: str | None = None, connect_timeout_s: float = 5.0,
                 statement_timeout_s: float = 5.0, pool_size: int = 4) -> None:
        try:
            import psycopg
        except ImportError as e:  # an optional dependency: only multi-node fleets need it
            raise SpendStoreError("a PostgreSQL ledger (ledger.url) needs psycopg: pip install 'lmfleet[postgres]' (or 'psycopg[binary]')") from e
        if pool_size < 1:
            raise ValueError(f"{pool_size=} must be >= 1")
        self._psycopg = psycopg
        self.url = url
        self._connect_kwargs: dict[str, Any] = {
            "autocommit": True,
            # libpq counts whole seconds, and at least 2
            "connect_timeout": max(2, math.ceil(connect_timeout_s)),
            "options": f"-c statement_timeout={int(statement_timeout_s * 1000)}"
                       f" -c lock_timeout={int(statement_timeout_s * 1000)}",
            "application_name": "lmfleet",
        }
        if password is not None:
            self._connect_kwargs["password"] = password
        self._idle: list[Any] = []
        self._idle_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._closed = False
        self.migrate()

    def close(self) -> None:
        with self._idle_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def unavailable(self, e: BaseException) -> StoreUnavailable:
        return StoreUnavailable(f"ledger database {redact_url(self.url)}: {_one_line(e)}")

    @contextmanager
    def _connection(self) -> Iterator[tuple[Any, bool]]:
        """A connection and whether it was pooled (idle since an earlier call: the server may have dropped it)."""
        if self._closed:
            raise StoreUnavailable(f"ledger database {redact_url(self.url)}: store is closed")
        with self._slots:
            with self._idle_lock:
                conn = self._idle.pop() if self._idle else None
            pooled = conn is not None
            if conn is None:
                try:
                    conn = self._psycopg.connect(self.url, **self._connect_kwargs)
                except self._psycopg.Error as e:
                    raise self.unavailable(e) from e
            try:
                yield conn, pooled
            finally:
                if conn.closed or conn.broken or self._closed:
                    conn.close()
                    if conn.broken:  # the server went away: its other idle connections are dead too
                        with self._idle_lock:
                            stale, self._idle = self._idle, []
                        for c in stale:
                            c.close()
                else:
                    with self._idle_lock:
                        self._idle.append(conn)

    @contextmanager
    def transaction(self, keys: Sequence[str] = ()) -> Iterator[Query]:
        """One transaction holding every key's lock (sorted ``keys``); ``q(sql, params)`` takes ``?`` placeholders.
        Database errors: ``StoreUnavailable``."""
        with self._connection() as (conn, _):
            try:
                with conn.transaction():
                    cur = conn.cursor()

                    def q(sql: str, params: Sequence[Any] = ()) -> Any:
                        cur.execute(sql.replace("?", "%s"), params or None)
                        return cur

                    if keys:
                        _lock_keys(q, keys)
                    yield q
            except self._psycopg.Error as e:
                raise self.unavailable(e) from e

    def statement(self, sql: str, params: Sequence[Any], read: Callable[[Any], T], *, retry_stale: bool) -> T:
        """One statement on its own (autocommit: one round trip), ``read(cursor)`` its result.

        ``retry_stale``: if the pooled connection it got is found dead (the server restarted or dropped it while
        idle), run it once more on a new one. Only for reads: a write whose connection broke may have landed.
        """
        with self._connection() as (conn, pooled):
            try:
                return read(conn.execute(sql.replace("?", "%s"), params or None))
            except self._psycopg.Error as e:
                if not (retry_stale and pooled and conn.broken):
                    raise self.unavailable(e) from e
        # the pooled connection was dead, and the idle ones were dropped with it: once more, on a new one
        return self.statement(sql, params, read, retry_stale=False)

    def migrate(self) -> None:
        """Create or upgrade the tables (once per version, whichever node or process comes first)."""
        with self.transaction() as q:
            q("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            migrate(q, "postgresql")


def _lock_keys(q: Query, keys: Sequence[str]) -> None:
    lock = "SELECT key FROM budget_keys WHERE key = ANY(?) ORDER BY key FOR UPDATE"
    if len(q(lock, (list(keys),)).fetchall()) < len(keys):
        # a key's first use: create its lock row (a concurrent creator waits on the unique index), then lock
        q("INSERT INTO budget_keys (key) SELECT unnest(?::text[]) ON CONFLICT DO NOTHING", (list(keys),))
        q(lock, (list(keys),))
