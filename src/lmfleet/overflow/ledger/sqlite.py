"""The ledger in one SQLite file (``ledger.path``): one node, the embedded default.

WAL journal, one connection guarded by a lock: safe for one process whose asyncio gateway calls these
(quick, synchronous) methods through ``asyncio.to_thread``; other processes (``lmfleet usage``, a second
gateway worker's spend store) share the file. Reopening the file after a restart sees every earlier row.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmfleet.overflow.ledger._sql import SqlLedger
from lmfleet.overflow.store.sqlite import add_tenant_column, connect_wal

__all__ = ["Ledger"]

_SCHEMA = """
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
    cost_nusd     INTEGER NOT NULL,
    tenant        TEXT
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
"""


class Ledger(SqlLedger):
    """The SQLite ledger at ``path`` (created with its folder if missing; an older file gains ``tenant``)."""

    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock=clock)
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = connect_wal(self.path, 10.0)
        with self._lock:
            self._db.executescript(_SCHEMA)
            add_tenant_column(self._db.execute)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "Ledger":
        return self

    def _fetch(self, sql: str, params: Sequence[Any] = ()) -> tuple[list[str], list[tuple[Any, ...]]]:
        with self._lock:
            cur = self._db.execute(sql, params)
            return [d[0] for d in cur.description], cur.fetchall()

    def _insert(self, sql: str, params: Sequence[Any]) -> int:
        with self._lock:
            return int(self._db.execute(sql, params).lastrowid or 0)
