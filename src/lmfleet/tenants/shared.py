"""Tenant limits shared by every gateway process and node: the counters live in the spend store's database.

    shared = SharedLimits(store, slot_ttl_s=660, workers=fleet.gateway.workers)
    book = TenantBook(directory, classes, shared=shared)

The store (``lmfleet.store.SqlSpendStore``: SQLite on one node, PostgreSQL for several) holds each
limited tenant's slots in flight and rate windows, and admits in one locked transaction
(:meth:`CounterStore.admit_tenant`); the decision itself stays :func:`lmfleet.tenants.admit`'s. Releases and
tokens are written by one background thread, so the event loop never waits on the database for them.

Failure: when the store cannot be used (``StoreUnavailable``), admission **fails open** to this process's own
counts with every limit divided by ``workers`` (at least 1), for ``retry_s`` before the store is tried again:
an outage of the ledger's database does not stop local serving, and a tenant still gets about its limit on one
node. (Spend caps keep failing closed: they are the spend store's ``reserve``.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from lmfleet.store import StoreUnavailable, TenantCounts

__all__ = ["CounterStore", "SharedLimits", "StoreUnavailable", "TenantCounts"]

T = TypeVar("T")
_log = logging.getLogger(__name__)


class CounterStore(Protocol):
    """What :class:`SharedLimits` needs of a store (``SqlSpendStore`` has it: ``lmfleet/store/tenants.py``)."""

    def admit_tenant(self, key: str, decide: Callable[[TenantCounts], tuple[bool, T]], *, now: float,
                     window_s: float, slot_ttl_s: float | None, count_request: bool) -> tuple[T, str | None]: ...

    def release_tenant(self, slot: str) -> None: ...

    def add_tenant_tokens(self, key: str, n: float, *, now: float, window_s: float) -> None: ...


class SharedLimits:
    """A :class:`CounterStore`, the fail-open switch and the background writer of one gateway process."""

    def __init__(self, store: CounterStore, *, slot_ttl_s: float, workers: int = 1, retry_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if slot_ttl_s <= 0 or workers < 1 or retry_s < 0:
            raise ValueError(f"{slot_ttl_s=} must be > 0, {workers=} >= 1, {retry_s=} >= 0")
        self.store = store
        self.slot_ttl_s = slot_ttl_s
        """How long a slot counts at most (a gateway that died leaks it no longer): the longest request."""
        self.workers = workers
        """Gateway processes per node: while the store is down each admits ``limit / workers``."""
        self.retry_s = retry_s
        self._clock = clock
        self._down_until = float("-inf")
        self._failed = False
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmfleet-tenant-writes")
        self._lock = threading.Lock()

    @property
    def is_down(self) -> bool:
        """The store failed less than ``retry_s`` ago: admissions use this process's share."""
        return self._clock() < self._down_until

    def admit(self, key: str, decide: Callable[[TenantCounts], tuple[bool, T]], *, now: float, window_s: float,
              holds_slot: bool, count_request: bool) -> tuple[T, str | None] | None:
        """The store's admission (blocking I/O: call it off the event loop); None when the store is down."""
        if self.is_down:
            return None
        try:
            got = self.store.admit_tenant(key, decide, now=now, window_s=window_s, count_request=count_request,
                                          slot_ttl_s=self.slot_ttl_s if holds_slot else None)
        except StoreUnavailable as e:
            with self._lock:
                if not self._failed:
                    self._failed = True
                    _log.error("tenant limits: the shared store cannot be used, each gateway process admits "
                               "limit/%d for %.0f s: %s", self.workers, self.retry_s, e)
                self._down_until = self._clock() + self.retry_s
            return None
        if self._failed:
            self._failed = False
            _log.warning("tenant limits: the shared store is back; limits hold across processes again")
        return got

    def release(self, slot: str) -> None:
        self._background(self.store.release_tenant, slot)

    def add_tokens(self, key: str, n: int, *, now: float, window_s: float) -> None:
        self._background(lambda: self.store.add_tenant_tokens(key, n, now=now, window_s=window_s))

    def drain(self) -> None:
        """Wait until every release and token count handed over so far is written (tests, shutdown)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def _background(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._writer.submit(fn, *args).add_done_callback(_log_failure)
        except RuntimeError:  # shut down: write inline (the store defers a failed write itself)
            fn(*args)


def _log_failure(f: Future[Any]) -> None:
    e = f.exception()
    if e is not None:
        _log.error("tenant limits: a background write failed: %r", e)
