"""SQLite spend store: one node, any number of gateway processes sharing one file (the embedded default).

WAL journal (readers never block the writer), ``BEGIN IMMEDIATE`` for every reservation (takes the
file's single write lock before reading what is spent, so check-then-hold is atomic across processes),
and a busy timeout: a lock held longer than ``busy_timeout_s`` fails the reservation closed instead of
waiting forever. One connection per store, shared by its threads under a lock.

The file is the ledger's (``LedgerConfig.path``): ``Ledger`` reads the rows this store writes.
"""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from lmfleet.overflow.store._overrides import MIGRATION as TENANT_OVERRIDES
from lmfleet.overflow.store._rate import MIGRATION as TENANT_COUNTERS
from lmfleet.overflow.store._sql import Query, SqlSpendStore
from lmfleet.overflow.store.base import StoreUnavailable

__all__ = ["SqliteSpendStore", "add_tenant_column", "connect_wal"]


def connect_wal(path: Path, timeout_s: float) -> sqlite3.Connection:
    """A connection to ``path`` in WAL mode (autocommit, usable from any thread under the caller's lock).

    Switching a new file to WAL takes an exclusive lock, and when several processes or threads open the same new
    file at once SQLite answers some of them "database is locked" at once, without waiting for the busy timeout
    (two connections that both hold the shared lock and both want the exclusive one: SQLite refuses one rather
    than deadlock; 8 of 6,400 opens in 400 rounds of 16 threads on one machine). So the switch is retried with a
    short random backoff until ``timeout_s``: gateway workers that start together on a fresh ledger all open.
    """
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e) or time.monotonic() >= deadline:
                db.close()
                raise
            time.sleep(random.uniform(0.001, 0.02))
    db.execute("PRAGMA synchronous=NORMAL")
    return db


def add_tenant_column(execute: Callable[..., sqlite3.Cursor]) -> None:
    """``requests.tenant`` on a file made before it existed (idempotent: the ledger may have added it first)."""
    if "tenant" in {row[1] for row in execute("PRAGMA table_info(requests)").fetchall()}:
        return
    try:
        execute("ALTER TABLE requests ADD COLUMN tenant TEXT")
    except sqlite3.OperationalError as e:  # another process added it between the look and the change
        if "duplicate column" not in str(e):
            raise


# version -> DDL (or a function of the transaction's execute); applied in order, each once (in lmfleet_schema)
MIGRATIONS: dict[int, str | Callable[[Query], None]] = {
    1: """
CREATE TABLE IF NOT EXISTS requests (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    ts            REAL    NOT NULL,
    model         TEXT    NOT NULL,
    served_by     TEXT    NOT NULL,
    route_reason  TEXT    NOT NULL,
    input_tokens  INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    latency_ms    REAL,
    ttft_ms       REAL,
    status        TEXT    NOT NULL,
    cost_nusd     INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
CREATE TABLE IF NOT EXISTS reservations (
    id          TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    request_id  TEXT    NOT NULL,
    amount_nusd INTEGER NOT NULL,
    created_at  REAL    NOT NULL,
    expires_at  REAL    NOT NULL,
    PRIMARY KEY (id, key)
);
CREATE INDEX IF NOT EXISTS reservations_key ON reservations (key, expires_at);
CREATE TABLE IF NOT EXISTS spend_buckets (
    key        TEXT    NOT NULL,
    bucket_end INTEGER NOT NULL,
    nusd       INTEGER NOT NULL,
    PRIMARY KEY (key, bucket_end)
);
""",
    2: add_tenant_column,
    3: TENANT_COUNTERS.format(real="REAL"),
    4: TENANT_OVERRIDES.format(int="INTEGER", real="REAL"),
}


class SqliteSpendStore(SqlSpendStore):
    def __init__(self, path: str | Path, *, ttl_s: float = 900.0, bucket_s: int = 60, retain_s: float = 8 * 86400.0,
                 busy_timeout_s: float = 5.0, clock: Callable[[], float] = time.time) -> None:
        super().__init__(ttl_s=ttl_s, bucket_s=bucket_s, retain_s=retain_s, clock=clock)
        self.path = Path(path).expanduser()
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = connect_wal(self.path, busy_timeout_s)
            self._migrate()
        except (sqlite3.Error, OSError) as e:
            raise StoreUnavailable(f"ledger database {self.path}: {e}") from e

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "SqliteSpendStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _migrate(self) -> None:
        with self._transaction(("schema",)) as q:
            q("CREATE TABLE IF NOT EXISTS lmfleet_schema (version INTEGER NOT NULL)")
            current = q("SELECT COALESCE(MAX(version), 0) FROM lmfleet_schema").fetchone()[0]
            for version in sorted(v for v in MIGRATIONS if v > current):
                step = MIGRATIONS[version]
                if callable(step):
                    step(q)
                else:
                    for stmt in filter(str.strip, step.split(";")):
                        q(stmt)
                q("INSERT INTO lmfleet_schema (version) VALUES (?)", (version,))

    @contextmanager
    def _transaction(self, keys: Sequence[str]) -> Iterator[Query]:
        # the write lock up front when a key's spend is read then held; a plain BEGIN for reads and appends
        begin = "BEGIN IMMEDIATE" if keys else "BEGIN"
        with self._lock:
            try:
                self._db.execute(begin)
                try:
                    yield self._db.execute
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except sqlite3.Error as e:
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                raise StoreUnavailable(f"ledger database {self.path}: {e}") from e
