"""The gateway's event-loop watchdog (lmfleet.gateway.observe.loopwatch): the pure stall decision, and a real loop blocked
by a synchronous sleep."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from lmfleet.gateway.observe.loopwatch import LoopWatch, StallStep, stall_step

S = 0.5  # stall threshold, seconds


@pytest.mark.parametrize(
    ("beat", "now", "in_stall", "since", "expected"),
    [
        (10.0, 10.1, False, 0.0, StallStep(warn=False, recovered_ms=None, in_stall=False)),  # healthy
        (10.0, 10.5, False, 0.0, StallStep(warn=False, recovered_ms=None, in_stall=False)),  # exactly the threshold
        (10.0, 10.6, False, 0.0, StallStep(warn=True, recovered_ms=None, in_stall=True)),  # a stall begins: warn
        (10.0, 12.0, True, 10.0, StallStep(warn=False, recovered_ms=None, in_stall=True)),  # still stalled: no repeat
        (12.1, 12.2, True, 10.0, StallStep(warn=False, recovered_ms=2100.0, in_stall=False)),  # back: how long
        (12.1, 13.0, True, 10.0, StallStep(warn=False, recovered_ms=None, in_stall=True)),  # back, then stalled again
        (9.0, 9.1, True, 10.0, StallStep(warn=False, recovered_ms=0.0, in_stall=False)),  # clock oddity: not negative
    ],
)
def test_stall_step(beat, now, in_stall, since, expected):
    got = stall_step(beat, now, S, in_stall, since)
    assert got.warn == expected.warn and got.in_stall == expected.in_stall
    assert got.recovered_ms == pytest.approx(expected.recovered_ms) if expected.recovered_ms is not None \
        else got.recovered_ms is None


def _blocking_call_in_the_loop():
    time.sleep(0.6)


def test_a_blocked_loop_is_reported_with_the_blocking_frame(caplog):
    lags: list[float] = []

    async def main():
        watch = LoopWatch(stall_ms=200, period_s=0.02, observe=lags.append)
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0.1)
        _blocking_call_in_the_loop()
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return watch

    with caplog.at_level(logging.WARNING, logger="lmfleet.gateway"):
        watch = asyncio.run(main())
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "gateway event loop blocked" in text and "_blocking_call_in_the_loop" in text and "time.sleep" in text
    assert "gateway event loop ran again after" in text
    assert watch.stalls == 1 and 550 <= watch.longest_ms <= 2000
    assert max(lags) >= 0.5  # the histogram saw the late wake-up too
    assert watch._stop.is_set()  # cancelled: the thread ends


def test_no_thread_without_a_threshold():
    async def main():
        watch = LoopWatch(stall_ms=0, period_s=0.01)
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return watch

    assert asyncio.run(main())._thread is None


def test_garbage_collection_inside_a_window_is_summed():
    w = LoopWatch(stall_ms=100)
    w._gc_spans = [(1.0, 1.2), (2.0, 2.5), (3.0, 3.1)]
    assert w.gc_ms_between(0.0, 10.0) == pytest.approx(800)
    assert w.gc_ms_between(1.1, 2.2) == pytest.approx(300)  # clipped at both ends
    assert w.gc_ms_between(4.0, 5.0) == 0


def test_the_thread_ends_when_its_loop_is_gone_without_a_cancel(caplog):
    """A gateway whose loop is closed under it (a test's loop) leaves no watchdog warning or running thread."""
    loop = asyncio.new_event_loop()
    watch = LoopWatch(stall_ms=50, period_s=0.01)
    task = loop.create_task(watch.run())
    loop.run_until_complete(asyncio.sleep(0.05))
    del task
    loop.close()  # run() is never resumed, its finally never runs
    with caplog.at_level(logging.WARNING, logger="lmfleet.gateway"):
        watch._thread.join(timeout=2)
    assert not watch._thread.is_alive()
    assert "blocked" not in caplog.text
