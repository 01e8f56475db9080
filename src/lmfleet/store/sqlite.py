"""SQLite: one node, any number of gateway processes sharing one file (``ledger.path``, the embedded default).

WAL journal (readers never block the writer), ``BEGIN IMMEDIATE`` for every transaction that locks keys (it takes
the file's single write lock before reading what is spent, so check-then-hold is atomic across processes), and a
busy timeout: a lock held longer than ``busy_timeout_s`` fails the call closed instead of waiting forever. One
connection per database object, shared by its threads under a lock; an asyncio caller runs these quick,
synchronous calls through ``asyncio.to_thread``.
"""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from lmfleet.store.records import StoreUnavailable
from lmfleet.store.schema import Query, migrate

__all__ = ["SqliteDatabase", "connect_wal"]

T = TypeVar("T")


def connect_wal(path: Path, timeout_s: float) -> sqlite3.Connection:
    """A connection to ``path`` in WAL mode (autocommit, usable from any thread under the caller's lock).

    Switching a new file to WAL takes an exclusive lock, and when several processes or threads open the same new
    file at once SQLite answers some of them "database is locked" at once, without waiting for the busy timeout
    (two connections that both hold the shared lock and both want the exclusive one: SQLite refuses one rather
    than deadlock). So the switch is retried with a short random backoff until ``timeout_s``: gateway workers that
    start together on a fresh ledger all open.
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


class SqliteDatabase:
    """The SQLite file at ``path`` (created with its folder if missing; migrated to the current schema on open).

    Every failure is ``StoreUnavailable``, one line, naming the file.
    """

    dialect = "sqlite"
    bucket_sql = "CAST(ts / ? AS INTEGER)"
    """SQL that turns ``ts`` into a bucket number of ``?`` seconds."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 5.0) -> None:
        self.path = Path(path).expanduser()
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = connect_wal(self.path, busy_timeout_s)
        except (sqlite3.Error, OSError) as e:
            raise self.unavailable(e) from e
        with self.transaction(("schema",)) as q:
            migrate(q, "sqlite")

    def unavailable(self, e: BaseException) -> StoreUnavailable:
        return StoreUnavailable(f"ledger database {self.path}: {e}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def transaction(self, keys: Sequence[str] = ()) -> Iterator[Query]:
        """One transaction; with ``keys``, the file's write lock taken up front (``BEGIN IMMEDIATE``)."""
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
                raise self.unavailable(e) from e

    def statement(self, sql: str, params: Sequence[Any], read: Callable[[Any], T], *, retry_stale: bool = False) -> T:
        """One statement on its own (autocommit), ``read(cursor)`` its result."""
        with self._lock:
            try:
                return read(self._db.execute(sql, params))
            except sqlite3.Error as e:
                raise self.unavailable(e) from e
