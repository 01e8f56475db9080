"""PostgreSQL spend store: several gateway nodes share one budget and one ledger (``ledger.url``).

Atomicity: every reservation locks one ``budget_keys`` row per cap key (``SELECT ... FOR UPDATE``, in
key order), then reads what is spent and holds its amount, in one READ COMMITTED transaction; the next
reserver of the same key waits on the row lock, and its next statement's snapshot has the committed
holds. What is spent is read in one statement, so a settle committing meanwhile (hold deleted and
cost added together, no key lock) is seen whole or not at all.

Failure: connects with ``connect_timeout_s``; statements and lock waits are bounded by
``statement_timeout_s`` (server-side), so a dead or stuck server fails a reservation closed
(``StoreUnavailable``) instead of hanging it. A broken connection is dropped; the next call reconnects.
Schema: created and migrated at start, once, under an advisory lock (several nodes may start at once).
``PgDatabase`` (the pool, transactions, migrations) is shared with the ledger (``overflow.ledger.postgres``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from lmfleet.overflow.store._overrides import MIGRATION as TENANT_OVERRIDES
from lmfleet.overflow.store._rate import MIGRATION as TENANT_COUNTERS
from lmfleet.overflow.store._sql import Query, SqlSpendStore
from lmfleet.overflow.store.base import SpendStoreError, StoreUnavailable

__all__ = ["MIGRATIONS", "PgDatabase", "PostgresSpendStore", "redact_url"]

T = TypeVar("T")

_MIGRATION_LOCK = 0x6C6D666C  # pg_advisory_xact_lock id for schema changes ("lmfl")

MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE IF NOT EXISTS requests (
    id            BIGSERIAL PRIMARY KEY,
    ts            DOUBLE PRECISION NOT NULL,
    model         TEXT    NOT NULL,
    served_by     TEXT    NOT NULL,
    route_reason  TEXT    NOT NULL,
    input_tokens  BIGINT  NOT NULL,
    output_tokens BIGINT  NOT NULL,
    latency_ms    DOUBLE PRECISION,
    ttft_ms       DOUBLE PRECISION,
    status        TEXT    NOT NULL,
    cost_nusd     BIGINT  NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
CREATE TABLE IF NOT EXISTS budget_keys (
    key TEXT PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS reservations (
    id          TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    request_id  TEXT    NOT NULL,
    amount_nusd BIGINT  NOT NULL,
    created_at  DOUBLE PRECISION NOT NULL,
    expires_at  DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (id, key)
);
CREATE INDEX IF NOT EXISTS reservations_key ON reservations (key, expires_at);
CREATE TABLE IF NOT EXISTS spend_buckets (
    key        TEXT    NOT NULL,
    bucket_end BIGINT  NOT NULL,
    nusd       BIGINT  NOT NULL,
    PRIMARY KEY (key, bucket_end)
);
""",
    2: "ALTER TABLE requests ADD COLUMN IF NOT EXISTS tenant TEXT",
    3: TENANT_COUNTERS.format(real="DOUBLE PRECISION"),
    4: TENANT_OVERRIDES.format(int="BIGINT", real="DOUBLE PRECISION"),
}


def redact_url(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = (parts.username or "") + ":***"
    return urlunsplit(parts._replace(netloc=f"{user}@{netloc[-1]}"))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class PgDatabase:
    """Connections to one PostgreSQL database, shared by the spend store and the ledger (``ledger.url``).

    A small pool (at most ``pool_size`` connections at once); a broken connection is dropped, and with it the
    idle ones (the server went away), so the next call reconnects. Every failure is ``StoreUnavailable``, one line.
    ``migrate()`` brings the schema (``MIGRATIONS``) up to date under an advisory lock.
    """

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
    def transaction(self) -> Iterator[Query]:
        """One transaction; ``q(sql, params)`` takes ``?`` placeholders. Database errors: ``StoreUnavailable``."""
        with self._connection() as (conn, _):
            try:
                with conn.transaction():
                    cur = conn.cursor()

                    def q(sql: str, params: Sequence[Any] = ()) -> Any:
                        cur.execute(sql.replace("?", "%s"), params or None)
                        return cur

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
            q("CREATE TABLE IF NOT EXISTS lmfleet_schema (version INTEGER NOT NULL)")
            current = q("SELECT COALESCE(MAX(version), 0) FROM lmfleet_schema").fetchone()[0]
            for version in sorted(v for v in MIGRATIONS if v > current):
                q(MIGRATIONS[version])
                q("INSERT INTO lmfleet_schema (version) VALUES (?)", (version,))


class PostgresSpendStore(SqlSpendStore):
    def __init__(self, url: str, *, password: str | None = None, ttl_s: float = 900.0, bucket_s: int = 60,
                 retain_s: float = 8 * 86400.0, connect_timeout_s: float = 5.0, statement_timeout_s: float = 5.0,
                 pool_size: int = 4, clock: Callable[[], float] = time.time) -> None:
        super().__init__(ttl_s=ttl_s, bucket_s=bucket_s, retain_s=retain_s, clock=clock)
        self.url = url
        self._db = PgDatabase(url, password=password, connect_timeout_s=connect_timeout_s,
                              statement_timeout_s=statement_timeout_s, pool_size=pool_size)
        self._db.migrate()

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "PostgresSpendStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self, keys: Sequence[str]) -> Iterator[Query]:
        with self._db.transaction() as q:
            if keys:
                self._lock_keys(q, keys)
            yield q

    @staticmethod
    def _lock_keys(q: Query, keys: Sequence[str]) -> None:
        lock = "SELECT key FROM budget_keys WHERE key = ANY(?) ORDER BY key FOR UPDATE"
        if len(q(lock, (list(keys),)).fetchall()) < len(keys):
            # a key's first use: create its lock row (a concurrent creator waits on the unique index), then lock
            q("INSERT INTO budget_keys (key) SELECT unnest(?::text[]) ON CONFLICT DO NOTHING", (list(keys),))
            q(lock, (list(keys),))
