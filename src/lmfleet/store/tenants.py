"""Tenants' state in the store's database, shared by every gateway process and node: their rate and concurrency
counters, and their settings changed at run time (``PUT /admin/tenants/NAME``).

Tables (``lmfleet.store.schema``)::

    tenant_slots   (id) -> key, expires_at
                   one row per request in flight; counts while expires_at > now, so the slots of a gateway that
                   died expire after ``slot_ttl_s`` (the longest a request may live) instead of leaking
    rate_windows   (key, window_start) -> n
                   the two fixed windows of ``lmfleet.tenants.RateWindow`` per key (``KEY:requests``, ``KEY:tokens``)
    tenant_overrides  (name) -> settings, version, updated_at
                   settings: the tenant's effective settings as JSON (``TenantSettings``), NULL: back to
                   fleet.yaml; version: one counter across the table, so every gateway process (and node, with
                   PostgreSQL) notices a change by reading ``MAX(version)``, one indexed row, every few seconds.
                   The database, not a file: it is what every process and node already shares, it survives
                   restarts, and writes are transactions. No key is stored here: limits, models and classes only.

An admission is one transaction under the tenant's lock (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL: the
``budget_keys`` row ``KEY:limits``, as ``reserve`` locks its caps): read the slots in flight and both windows in
one statement, let the caller's pure ``decide`` judge them, and when it admits, hold a slot and count the
request. The store only persists and locks; the arithmetic stays in ``lmfleet.tenants`` (``RateWindow``,
``admit``). Releases and tokens are plain writes without the lock (like ``settle``); one that fails waits in
the store's outbox and is retried before the next admission or reservation.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["TenantCounters", "TenantCounts", "TenantOverride", "TenantOverrides", "window_bounds"]

T = TypeVar("T")

PURGE_EVERY_S = 60.0
WINDOWS_KEPT_S = 3600.0
"""Windows older than this are deleted (a window of up to half an hour is still read whole)."""

@dataclass(frozen=True)
class TenantCounts:
    """What one key holds now, read under its lock: the input of the caller's pure decision."""

    in_flight: int
    """Slots held and not expired, across every process."""
    requests: tuple[float, float]
    """(current, previous) fixed windows of requests."""
    tokens: tuple[float, float]
    """(current, previous) fixed windows of tokens."""
    window_start: float
    """Start of the current fixed window (``floor(now / window_s) * window_s``)."""


def window_bounds(now: float, window_s: float) -> tuple[float, float]:
    """(current, previous) fixed-window starts at ``now``, computed as ``RateWindow.at`` does."""
    k = math.floor(now / window_s)
    return k * window_s, (k - 1) * window_s


class TenantCounters:
    """Mixin of ``SqlSpendStore``: tenant admissions, releases and tokens (see the module docstring)."""

    _transaction: Callable[[Sequence[str]], AbstractContextManager[Any]]
    _write: Callable[[Sequence[str], Callable[[Any], Any]], Any]
    _flush: Callable[[], None]
    _last_rate_purge: float = float("-inf")

    def admit_tenant(self, key: str, decide: Callable[[TenantCounts], tuple[bool, T]], *, now: float,
                     window_s: float, slot_ttl_s: float | None, count_request: bool) -> tuple[T, str | None]:
        """Read ``key``'s counts and, if ``decide`` admits (its first item), take: a slot in flight (unless
        ``slot_ttl_s`` is None: no concurrency limit) and one request in the current window (``count_request``).

        Returns ``decide``'s second item and the slot's id (None: refused, or no slot held). One transaction:
        exact across processes and nodes. Raises ``StoreUnavailable`` when the database cannot be used.
        """
        current, previous = window_bounds(now, window_s)
        requests, tokens = f"{key}:requests", f"{key}:tokens"
        self._flush()
        with self._transaction((f"{key}:limits",)) as q:
            n = "(SELECT n FROM rate_windows WHERE key = ? AND window_start = ?)"
            row = q(f"SELECT (SELECT COUNT(*) FROM tenant_slots WHERE key = ? AND expires_at > ?), {n}, {n}, {n}, {n}",
                    (key, now, requests, current, requests, previous, tokens, current, tokens, previous)).fetchone()
            counts = TenantCounts(int(row[0]), (float(row[1] or 0), float(row[2] or 0)),
                                  (float(row[3] or 0), float(row[4] or 0)), current)
            take, result = decide(counts)
            if not take:
                return result, None
            slot = None
            if slot_ttl_s is not None:
                slot = uuid.uuid4().hex
                q("INSERT INTO tenant_slots (id, key, expires_at) VALUES (?,?,?)", (slot, key, now + slot_ttl_s))
            if count_request:
                _add(q, requests, current, 1)
            if now - self._last_rate_purge >= PURGE_EVERY_S:
                q("DELETE FROM tenant_slots WHERE expires_at < ?", (now,))
                q("DELETE FROM rate_windows WHERE window_start < ?", (now - WINDOWS_KEPT_S,))
                self._last_rate_purge = now
            return result, slot

    def release_tenant(self, slot: str) -> None:
        """Free one slot in flight (idempotent). A failed write is retried later; the slot expires meanwhile."""
        self._write((), lambda q: q("DELETE FROM tenant_slots WHERE id = ?", (slot,)))

    def add_tenant_tokens(self, key: str, n: float, *, now: float, window_s: float) -> None:
        """Count ``n`` tokens in ``key``'s current window (no lock: an atomic upsert)."""
        if n > 0:
            current, _ = window_bounds(now, window_s)
            self._write((), lambda q: _add(q, f"{key}:tokens", current, n))

    def tenant_counts(self, key: str, *, now: float, window_s: float) -> TenantCounts:
        """``key``'s counts now, read under its lock, taking nothing (admin pages, tests)."""
        return self.admit_tenant(key, lambda c: (False, c), now=now, window_s=window_s, slot_ttl_s=None,
                                 count_request=False)[0]


def _add(q: Callable[..., Any], key: str, window_start: float, n: float) -> None:
    q("INSERT INTO rate_windows (key, window_start, n) VALUES (?,?,?)"
      " ON CONFLICT (key, window_start) DO UPDATE SET n = rate_windows.n + excluded.n", (key, window_start, n))


_LOCK_KEY = "tenant-overrides"


@dataclass(frozen=True)
class TenantOverride:
    """One row: a tenant's settings as set through the admin API (None: reverted to fleet.yaml)."""

    name: str
    settings: str | None
    version: int
    updated_at: float


class TenantOverrides:
    """Mixin of ``SqlSpendStore``: tenant settings set at run time (see the module docstring)."""

    _transaction: Callable[[Sequence[str]], AbstractContextManager[Any]]
    _clock: Callable[[], float]

    def put_tenant_override(self, name: str, settings: str | None) -> TenantOverride:
        """Store ``name``'s settings (JSON; None: back to fleet.yaml) under the next version. Raises
        ``StoreUnavailable`` when the database cannot be used."""
        with self._transaction((_LOCK_KEY,)) as q:
            version = int(q("SELECT COALESCE(MAX(version), 0) FROM tenant_overrides").fetchone()[0]) + 1
            now = self._clock()
            q("INSERT INTO tenant_overrides (name, settings, version, updated_at) VALUES (?,?,?,?)"
              " ON CONFLICT (name) DO UPDATE SET settings = excluded.settings, version = excluded.version,"
              " updated_at = excluded.updated_at", (name, settings, version, now))
            return TenantOverride(name, settings, version, now)

    def tenant_overrides_version(self) -> int:
        """The latest version (0: none ever set): what a gateway process polls."""
        with self._transaction(()) as q:
            return int(q("SELECT COALESCE(MAX(version), 0) FROM tenant_overrides").fetchone()[0])

    def tenant_overrides(self) -> list[TenantOverride]:
        """Every row, oldest version first."""
        with self._transaction(()) as q:
            rows = q("SELECT name, settings, version, updated_at FROM tenant_overrides ORDER BY version").fetchall()
        return [TenantOverride(str(r[0]), r[1], int(r[2]), float(r[3])) for r in rows]
