"""The spend store over SQL, shared by the SQLite and PostgreSQL backends.

Tables (one database, beside the ledger's ``requests`` rows)::

    reservations   (id, key)  -> request_id, amount_nusd, created_at, expires_at
                   one row per cap key the request counts against; a hold counts while expires_at > now
    spend_buckets  (key, bucket_end) -> nusd
                   settled spend per key in ``bucket_s`` buckets (see decision.py for the window rule)
    requests       the ledger's rows, exactly as ``overflow.ledger`` (``Ledger``, ``PostgresLedger``) writes and
                   reads them; ``tenant`` (NULL: none known) since schema version 2
    tenant_slots, rate_windows   tenants' requests in flight and rate windows (schema version 3; ``_rate.py``)
    tenant_overrides             tenant settings changed through the admin API (schema version 4; ``_overrides.py``)

Every reservation runs in one transaction that first locks its keys (SQLite: ``BEGIN IMMEDIATE``, the database's single writer lock; PostgreSQL: ``SELECT
... FOR UPDATE`` on one ``budget_keys`` row per key, in key order so two requests never deadlock), so
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
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from lmfleet.overflow.store._overrides import TenantOverrides
from lmfleet.overflow.store._rate import TenantCounters
from lmfleet.overflow.store.base import Reservation, Spend, StoreUnavailable, UsageRecord
from lmfleet.overflow.store.decision import GLOBAL, Cap, Refusal, caps_exceeded, retry_after_s

__all__ = ["Query", "SqlSpendStore"]

_log = logging.getLogger(__name__)

EXPIRED_KEPT_S = 86400.0
"""How long an expired hold stays (not counted) so that a late settle or release still finds it."""
PURGE_EVERY_S = 60.0


class Query(Protocol):
    """Run one statement (``?`` placeholders) inside the current transaction; returns a DB-API cursor."""

    def __call__(self, sql: str, params: Sequence[Any] = ()) -> Any: ...


def _ledger_insert(q: Query, record: UsageRecord, cost_nusd: int, ts: float) -> None:
    q("INSERT INTO requests (ts, model, served_by, route_reason, input_tokens, output_tokens,"
      " latency_ms, ttft_ms, status, cost_nusd, tenant) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
      (ts, record.model, record.served_by, record.route_reason, record.input_tokens, record.output_tokens,
       record.latency_ms, record.ttft_ms, str(record.status), cost_nusd, record.tenant))


class SqlSpendStore(TenantCounters, TenantOverrides):
    """``SpendStore`` over a SQL database; a backend provides ``_transaction(keys)`` and the schema. Also the
    tenants' shared rate and concurrency counters (:class:`TenantCounters`) and their settings changed at run
    time (:class:`TenantOverrides`)."""

    def __init__(self, *, ttl_s: float, bucket_s: int, retain_s: float, clock: Callable[[], float]) -> None:
        if ttl_s <= 0 or bucket_s < 1 or retain_s <= 0:
            raise ValueError(f"{ttl_s=} and {retain_s=} must be > 0, {bucket_s=} >= 1")
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

    # --- backend hooks -------------------------------------------------------------------------------
    def _transaction(self, keys: Sequence[str]) -> AbstractContextManager[Query]:
        """A transaction holding every key's lock (sorted ``keys``; none: a plain read or ledger append).

        Database errors inside it (or on begin/commit) become ``StoreUnavailable``, after a rollback.
        """
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

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
                                    retry_after_s(self._events(q, c.key, now - c.window_s), held[c.key],
                                                  amount_nusd, c, now))
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

