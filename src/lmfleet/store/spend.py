"""Exact, shared spend caps for paid providers: reserve the worst case before dispatch, settle after.

Tables (``schema.py``): ``reservations`` (one row per cap key a request counts against; a hold counts while
``expires_at > now``), ``spend_buckets`` (settled spend per key in ``bucket_s`` buckets; ``caps.py`` has the window
rule) and the ledger's ``requests``, in one database with the tenants' tables (``tenants.py``).

Every reservation runs in one transaction that first locks its keys (SQLite: ``BEGIN IMMEDIATE``, the database's
single writer lock; PostgreSQL: ``SELECT ... FOR UPDATE`` on one ``budget_keys`` row per key, in key order so two
requests never deadlock), so
"read what is spent, then hold" is atomic across threads, processes and nodes: a cap is never exceeded.
What is spent is read in one statement (one snapshot, also under PostgreSQL's READ COMMITTED).

Settle deletes the hold, adds the real cost to the buckets and appends the ledger row in one
transaction; it takes no key lock (a reader sees the hold or the cost, never neither). An
expired hold is kept (not counted) for a day, so a late settle still finds it and settle stays
idempotent. A settle/release/record whose write fails is kept in memory and retried before this
store's next reservation; until it lands, reservations fail closed (``StoreUnavailable``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from lmfleet.overflow.admission import admission_json
from lmfleet.overflow.budget import retry_after_s
from lmfleet.store.caps import GLOBAL, Cap, Refusal, caps_exceeded
from lmfleet.store.postgres import PgDatabase
from lmfleet.store.records import Database, Reservation, Spend, StoreUnavailable, UsageRecord
from lmfleet.store.schema import INSERT_REQUEST, Query
from lmfleet.store.sqlite import SqliteDatabase
from lmfleet.store.tenants import TenantCounters, TenantOverrides

__all__ = ["PostgresSpendStore", "SqlSpendStore", "SqliteSpendStore"]

_log = logging.getLogger(__name__)

EXPIRED_KEPT_S = 86400.0
"""How long an expired hold stays (not counted) so that a late settle or release still finds it."""
PURGE_EVERY_S = 60.0


def _ledger_insert(q: Query, record: UsageRecord, cost_nusd: int, ts: float) -> None:
    q(INSERT_REQUEST, (ts, record.model, record.served_by, record.route_reason, record.input_tokens, record.output_tokens,
       record.latency_ms, record.ttft_ms, str(record.status), cost_nusd, record.tenant, record.usage_source,
       record.upstream_model, record.predicted_wait_ms, record.realised_wait_ms, admission_json(record.admission)))


class SqlSpendStore(TenantCounters, TenantOverrides):
    """``SpendStore`` over a SQL database (``SqliteDatabase`` or ``PgDatabase``). Also the tenants' shared rate and
    concurrency counters (:class:`TenantCounters`) and their settings changed at run time (:class:`TenantOverrides`).
    """

    def __init__(self, db: Database, *, ttl_s: float = 900.0, bucket_s: int = 60, retain_s: float = 8 * 86400.0,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0 or bucket_s < 1 or retain_s <= 0:
            raise ValueError(f"{ttl_s=} and {retain_s=} must be > 0, {bucket_s=} >= 1")
        self.db = db
        self.ttl_s = ttl_s
        self.bucket_s = bucket_s
        self.retain_s = retain_s
        self._clock = clock
        self._outbox: list[tuple[tuple[str, ...], Callable[[Query], object]]] = []
        self._outbox_lock = threading.Lock()
        self._last_purge = float("-inf")
        self.writes_landed = 0
        """Settles, releases and records written so far (deferred ones count when they land): a write that
        lands after a failure tells the gateway's ``BudgetGuard`` the database is back, without a probe."""

    def _transaction(self, keys: Sequence[str]) -> AbstractContextManager[Query]:
        """A transaction holding every key's lock (sorted ``keys``; none: a plain read or ledger append).

        Database errors inside it (or on begin/commit) become ``StoreUnavailable``, after a rollback.
        """
        return self.db.transaction(keys)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "SqlSpendStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- SpendStore ----------------------------------------------------------------------------------
    @property
    def pending_writes(self) -> int:
        """Settles/releases/records that failed to write and wait for the next reservation."""
        return len(self._outbox)

    def reserve(self, request_id: str, amount_nusd: int, caps: Sequence[Cap]) -> Reservation | Refusal:
        if amount_nusd < 0:
            raise ValueError(f"{amount_nusd=} must be >= 0")
        keys = tuple(sorted({c.key for c in caps})) or (GLOBAL,)
        self._flush()
        with self._transaction(keys) as q:
            now = self._clock()
            held, settled = self._read(q, keys, caps, now)
            spent = {c: held[c.key] + settled[c] for c in caps}
            over = caps_exceeded(amount_nusd, caps, spent)
            if over:
                refusals = [Refusal(c, spent[c], amount_nusd,
                                    retry_after_s(self._events(q, c.key, now - c.window_s), held_nusd=held[c.key],
                                                  amount_nusd=amount_nusd, cap_nusd=c.cap_nusd, window_s=c.window_s,
                                                  now=now))
                            for c in over]
                return max(refusals, key=lambda r: r.retry_after_s)
            res = Reservation(uuid.uuid4().hex, request_id, amount_nusd, keys, now + self.ttl_s)
            for k in keys:
                q("INSERT INTO reservations (id, key, request_id, amount_nusd, created_at, expires_at)"
                  " VALUES (?,?,?,?,?,?)", (res.id, k, request_id, amount_nusd, now, res.expires_at))
            if now - self._last_purge >= PURGE_EVERY_S:
                q("DELETE FROM reservations WHERE expires_at < ?", (now - EXPIRED_KEPT_S,))
                q("DELETE FROM spend_buckets WHERE bucket_end < ?", (now - self.retain_s,))
                self._last_purge = now
            return res

    def settle(self, reservation: Reservation, actual_nusd: int, record: UsageRecord | None = None) -> bool:
        if actual_nusd < 0:
            raise ValueError(f"{actual_nusd=} must be >= 0")
        now = self._clock()

        def apply(q: Query) -> bool:
            if q("DELETE FROM reservations WHERE id = ?", (reservation.id,)).rowcount == 0:
                return False
            if actual_nusd:
                bucket_end = (int(now) // self.bucket_s + 1) * self.bucket_s
                for k in reservation.keys:
                    q("INSERT INTO spend_buckets (key, bucket_end, nusd) VALUES (?,?,?)"
                      " ON CONFLICT (key, bucket_end) DO UPDATE SET nusd = spend_buckets.nusd + excluded.nusd",
                      (k, bucket_end, actual_nusd))
            if record is not None:
                _ledger_insert(q, record, actual_nusd, now)
            return True

        # no key lock: the hold's removal and the cost's arrival commit together, and reserve reads both in
        # one statement (one snapshot), so it sees the old hold or the new cost, never neither
        return self._write((), apply)

    def release(self, reservation: Reservation, record: UsageRecord | None = None) -> bool:
        return self.settle(reservation, 0, record)

    def record(self, record: UsageRecord, cost_nusd: int) -> None:
        if cost_nusd < 0:
            raise ValueError(f"{cost_nusd=} must be >= 0")
        now = self._clock()
        self._write((), lambda q: _ledger_insert(q, record, cost_nusd, now))

    def spent(self, window_s: float, key: str = GLOBAL) -> Spend:
        cap = Cap(key, window_s, 0)
        with self._transaction(()) as q:
            held, settled = self._read(q, (key,), [cap], self._clock())
            return Spend(settled[cap], held[key])

    # --- internals -----------------------------------------------------------------------------------
    @staticmethod
    def _read(q: Query, keys: Sequence[str], caps: Sequence[Cap], now: float) -> tuple[dict[str, int], dict[Cap, int]]:
        """Held per key and settled per cap window, in one statement: one consistent snapshot."""
        parts = ["SELECT COALESCE(SUM(amount_nusd), 0) FROM reservations WHERE key = ? AND expires_at > ?"] * len(keys)
        parts += ["SELECT COALESCE(SUM(nusd), 0) FROM spend_buckets WHERE key = ? AND bucket_end > ?"] * len(caps)
        params = [x for k in keys for x in (k, now)] + [x for c in caps for x in (c.key, now - c.window_s)]
        row = [int(v) for v in q("SELECT " + ", ".join(f"({p})" for p in parts), params).fetchone()]
        return dict(zip(keys, row)), dict(zip(caps, row[len(keys):]))

    @staticmethod
    def _events(q: Query, key: str, since: float) -> list[tuple[float, int]]:
        rows = q("SELECT bucket_end, nusd FROM spend_buckets WHERE key = ? AND bucket_end > ?", (key, since))
        return [(float(ts), int(n)) for ts, n in rows.fetchall()]

    def _write(self, keys: Sequence[str], apply: Callable[[Query], Any]) -> Any:
        """Run ``apply`` in a locked transaction; if the database is unusable, keep it for later."""
        try:
            self._flush()
            with self._transaction(keys) as q:
                result = apply(q)
            self.writes_landed += 1
            return result
        except StoreUnavailable as e:
            with self._outbox_lock:
                self._outbox.append((tuple(keys), apply))
            _log.warning("ledger write deferred (%d pending): %s", len(self._outbox), e)
            return True

    def _flush(self) -> None:
        """Apply deferred writes, oldest first; StoreUnavailable if one still fails (reserve fails closed)."""
        if not self._outbox:
            return
        with self._outbox_lock:
            while self._outbox:
                keys, apply = self._outbox[0]
                with self._transaction(keys) as q:
                    apply(q)
                self._outbox.pop(0)
                self.writes_landed += 1


class SqliteSpendStore(SqlSpendStore):
    """The store in the SQLite file at ``path`` (one node, several processes; the ledger's file)."""

    def __init__(self, path: str | Path, *, ttl_s: float = 900.0, bucket_s: int = 60, retain_s: float = 8 * 86400.0,
                 busy_timeout_s: float = 5.0, clock: Callable[[], float] = time.time) -> None:
        super().__init__(SqliteDatabase(path, busy_timeout_s=busy_timeout_s), ttl_s=ttl_s, bucket_s=bucket_s,
                         retain_s=retain_s, clock=clock)
        self.path = self.db.path


class PostgresSpendStore(SqlSpendStore):
    """The store in the PostgreSQL database at ``url`` (several nodes)."""

    def __init__(self, url: str, *, password: str | None = None, ttl_s: float = 900.0, bucket_s: int = 60,
                 retain_s: float = 8 * 86400.0, connect_timeout_s: float = 5.0, statement_timeout_s: float = 5.0,
                 pool_size: int = 4, clock: Callable[[], float] = time.time) -> None:
        super().__init__(PgDatabase(url, password=password, connect_timeout_s=connect_timeout_s,
                                    statement_timeout_s=statement_timeout_s, pool_size=pool_size),
                         ttl_s=ttl_s, bucket_s=bucket_s, retain_s=retain_s, clock=clock)
        self.url = url
