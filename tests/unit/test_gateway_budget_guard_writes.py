"""BudgetGuard: a settle or release that lands after the store failed brings the provider route back without
waiting for a probe; a write that was only deferred (still in memory) does not. Against a real SQLite store
whose write lock another connection holds (what a stuck writer does)."""

from __future__ import annotations

import sqlite3

import pytest

from lmfleet.config.models import ProviderPrice
from lmfleet.gateway.routing.budget import BudgetGuard
from lmfleet.gateway.observe.metrics import GatewayMetrics
from lmfleet.store import GLOBAL, Cap, Reservation, Spend, SqliteSpendStore, StoreUnavailable, UsageRecord

pytestmark = pytest.mark.timeout(60)

PRICE = ProviderPrice(input_per_1m=1.0, output_per_1m=2.0)
CAP = Cap(GLOBAL, 3600.0, 10**9)
ROW = UsageRecord("m", "provider/p", "overflow", 10, 8, "ok", tenant="acme")


@pytest.fixture
def store(tmp_path):
    with SqliteSpendStore(tmp_path / "ledger.sqlite", busy_timeout_s=0.1) as s:
        yield s


def _lock(path) -> sqlite3.Connection:
    """Another process's connection holding the file's write lock."""
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    return other


@pytest.mark.parametrize("finish", ["settle", "release"])
async def test_a_write_that_lands_reopens_the_route(store, finish):
    metrics = GatewayMetrics()
    guard = BudgetGuard(store, [CAP], lambda write: write(), metrics=metrics, probe_every_s=3600.0)
    held = await guard.reserve("in-flight", 10, 8, PRICE, None)
    assert isinstance(held, Reservation)
    other = _lock(store.path)
    assert await guard.reserve("q", 10, 8, PRICE, None) is None  # "database is locked": fail closed
    assert guard.is_down and "locked" in guard.last_error

    # the in-flight request ends while the lock is still held: its write is deferred, the store is still down
    if finish == "settle":
        store.settle(held, 1234, ROW)  # what the recorder does
    else:
        guard.release(held)
    assert store.pending_writes == 1 and guard.is_down

    other.execute("ROLLBACK")  # the stuck writer lets go
    other.close()
    assert guard.is_down  # nothing has tried the database since
    store.record(UsageRecord("m", "local/m", "local_ok", 1, 1, "ok"), 0)  # a later row lands, the deferred one first
    assert store.pending_writes == 0
    assert not guard.is_down and guard.last_error is None  # back without a probe
    assert metrics.registry.get_sample_value("lmfleet_budget_store_up") == 1
    assert store.spent(3600.0) == Spend(settled_nusd=1234 if finish == "settle" else 0, held_nusd=0)


async def test_a_write_landing_before_the_failure_does_not_count(store):
    guard = BudgetGuard(store, [CAP], lambda write: write(), probe_every_s=3600.0)
    store.record(UsageRecord("m", "local/m", "local_ok", 1, 1, "ok"), 0)
    other = _lock(store.path)
    try:
        assert await guard.reserve("q", 10, 8, PRICE, None) is None
        assert guard.is_down and guard.status()["up"] is False
    finally:
        other.close()


async def test_a_store_without_the_counter_still_needs_a_probe():
    class Bare:  # a SpendStore without writes_landed (fakes, other implementations)
        down = True

        def reserve(self, request_id, amount_nusd, caps):
            if self.down:
                raise StoreUnavailable("db: down")
            return Reservation("r", request_id, amount_nusd, (GLOBAL,), 1e12)

        def release(self, reservation, record=None):
            return True

    store = Bare()
    guard = BudgetGuard(store, [CAP], lambda write: write(), probe_every_s=3600.0)
    assert await guard.reserve("q", 10, 8, PRICE, None) is None
    store.down = False
    assert guard.is_down
    assert await guard.probe() and not guard.is_down
