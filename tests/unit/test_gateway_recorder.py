"""The Recorder's ledger writer: transient failures are retried in order, nothing else blocks the queue."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time

import pytest

from lmfleet.gateway.observe.metrics import GatewayMetrics
from lmfleet.gateway.observe.recorder import Recorder
from lmfleet.store import StoreUnavailable


class FakeLedger:
    """Rows in the order written; fails the first ``fail`` attempts with ``error``."""

    def __init__(self, fail: int = 0, error: BaseException | None = None):
        self.rows: list[int] = []
        self.attempts = 0
        self.fail, self.error = fail, error

    def write(self, row: int):
        def do():
            self.attempts += 1
            if self.fail > 0:
                self.fail -= 1
                raise self.error  # type: ignore[misc]
            self.rows.append(row)
        return do


def recorder(ledger) -> Recorder:
    r = Recorder(GatewayMetrics(), ledger, {"m"})  # type: ignore[arg-type]
    r.retry_first_s, r.retry_max_s, r.close_deadline_s = 0.01, 0.02, 0.5
    return r


@pytest.mark.parametrize("fail, error, rows", [
    (0, None, [0, 1, 2]),
    (3, sqlite3.OperationalError("database is locked"), [0, 1, 2]),    # retried until it lands, in order
    (2, OSError(28, "No space left on device"), [0, 1, 2]),
    (2, StoreUnavailable("postgres is down"), [0, 1, 2]),
    (1, sqlite3.IntegrityError("constraint failed"), [1, 2]),           # would fail again: dropped, queue moves on
    (1, ValueError("a bug"), [1, 2]),
])
async def test_writes_land_in_order_through_transient_failures(fail, error, rows):
    ledger = FakeLedger(fail, error)
    r = recorder(ledger)
    r.start()
    for i in range(3):
        r.submit(ledger.write(i))
    await asyncio.wait_for(r.flush(), 5)
    assert ledger.rows == rows
    assert r.failing_since is None and r.pending == 0
    await r.close()


async def test_an_outage_is_logged_once_and_its_end_once(caplog):
    ledger = FakeLedger(20, sqlite3.OperationalError("database is locked"))
    r = recorder(ledger)
    r.start()
    with caplog.at_level(logging.WARNING, logger="lmfleet.gateway"):
        for i in range(5):
            r.submit(ledger.write(i))
        await asyncio.wait_for(r.flush(), 5)
    texts = [rec.getMessage() for rec in caplog.records]
    assert sum("retrying" in t for t in texts) == 1 and sum("resumed" in t for t in texts) == 1, texts
    assert ledger.rows == [0, 1, 2, 3, 4] and ledger.attempts == 25
    await r.close()


async def test_close_gives_up_after_its_deadline_and_says_how_many_rows(caplog):
    ledger = FakeLedger(10**9, sqlite3.OperationalError("unable to open database file"))
    r = recorder(ledger)
    r.start()
    for i in range(4):
        r.submit(ledger.write(i))
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="lmfleet.gateway"):
        await r.close()
    assert time.monotonic() - t0 < 3
    assert any("4 rows could not be written" in rec.getMessage() for rec in caplog.records), caplog.text


async def test_rows_beyond_the_bound_are_dropped_and_counted():
    ledger = FakeLedger(10**9, sqlite3.OperationalError("database is locked"))
    r = recorder(ledger)
    r.max_pending = 3
    for i in range(5):  # writer not started: everything waits
        r.submit(ledger.write(i))
    assert r.pending == 3 and r.dropped == 2


async def test_status_shows_the_backlog_while_writes_fail_and_clears_when_they_land():
    ledger = FakeLedger(10**9, sqlite3.OperationalError("database is locked"))
    r = recorder(ledger)
    r.retry_first_s = r.retry_max_s = 0.01
    r.start()
    for i in range(3):
        r.submit(ledger.write(i))
    deadline = time.monotonic() + 5
    while r.failing_since is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    st = r.status()
    assert st is not None and st["up"] is False and st["pending_rows"] == 3 and st["failing_for_s"] >= 0
    sample = r.metrics.registry.get_sample_value
    assert sample("lmfleet_ledger_write_failing") == 1 and sample("lmfleet_ledger_pending_rows") == 3
    ledger.fail = 0  # the database is back
    await asyncio.wait_for(r.flush(), 5)
    assert r.status() == {"up": True, "pending_rows": 0, "dropped_rows": 0, "failing_for_s": None}
    assert sample("lmfleet_ledger_write_failing") == 0 and sample("lmfleet_ledger_pending_rows") == 0
    assert ledger.rows == [0, 1, 2]
    await r.close()


async def test_a_write_that_cannot_succeed_is_counted_as_dropped():
    ledger = FakeLedger(1, sqlite3.IntegrityError("constraint failed"))
    r = recorder(ledger)
    r.start()
    r.submit(ledger.write(0))
    await asyncio.wait_for(r.flush(), 5)
    assert r.status()["dropped_rows"] == 1 and r.metrics.registry.get_sample_value("lmfleet_ledger_rows_dropped") == 1
    await r.close()


def test_no_ledger_no_status():
    assert Recorder(GatewayMetrics(), None, {"m"}).status() is None


@pytest.mark.parametrize("served_by, status, ttft_s, predicted_ms, observed", [
    ("local/m", 200, 1.5, 1000.0, 0.5),            # waited longer than predicted: positive
    ("local/m", 200, 0.2, 700.0, -0.5),            # shorter: negative
    ("local/m", 200, 1.0, None, None),             # no estimate (e.g. policy local_first with none made)
    ("local/m", 200, None, 100.0, None),           # no first token
    ("local/m", 499, 0.3, 100.0, None),            # cancelled: its wait did not end in an answer
    ("provider/acme", 200, 0.4, 100.0, None),      # a provider's TTFT says nothing of the local queue
])
def test_estimate_error_histogram(served_by, status, ttft_s, predicted_ms, observed):
    from lmfleet.gateway.observe.recorder import Outcome

    r = Recorder(GatewayMetrics(), None, {"m"})
    r.record("m", Outcome(served_by, "local_ok", 10, 5, ttft_s, status, predicted_ms), 2.0, 0.0)
    reg = r.metrics.registry
    count = reg.get_sample_value("lmfleet_queue_estimate_error_seconds_count", {"model": "m"})
    if observed is None:
        assert not count
        return
    # a histogram with negative buckets has no _sum (OpenMetrics): the sign shows in the buckets
    at_or_below_zero = reg.get_sample_value("lmfleet_queue_estimate_error_seconds_bucket", {"model": "m", "le": "0.0"})
    assert count == 1 and at_or_below_zero == (1 if observed <= 0 else 0)


@pytest.mark.parametrize("served_by, ttft_s, predicted_ms, expected", [
    ("local/m", 1.5, 1000.0, (1000.0, 1500.0)),    # streamed and kept local: both
    ("local/m", None, 1000.0, (1000.0, None)),     # not streamed, or ended before its first token: no realised wait
    ("local/m", 0.3, None, (None, None)),          # no estimate made
    ("provider/acme", 0.4, 100.0, (None, None)),   # a provider's TTFT is not a local wait
])
def test_ledger_waits(served_by, ttft_s, predicted_ms, expected):
    from lmfleet.gateway.observe.recorder import Outcome, waits

    assert waits(Outcome(served_by, "local_ok", 10, 5, ttft_s, 200, predicted_ms)) == expected
