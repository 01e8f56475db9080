"""RateWindow: the sliding-window counter, its retry-after and reset, and the duration format."""

from __future__ import annotations

import pytest

from lmfleet.tenants import RateWindow, format_duration

W = 60.0


def _fill(w: RateWindow, events: list[tuple[float, float]]) -> RateWindow:
    for ts, n in events:
        w = w.add(ts, n)
    return w


@pytest.mark.parametrize("events, now, used", [
    ([], 100.0, 0.0),
    ([(120.0, 1), (130.0, 2)], 150.0, 3.0),  # one fixed window
    ([(120.0, 10)], 180.0, 10.0),  # next window starts: the previous counts in full
    ([(120.0, 10)], 195.0, 7.5),  # a quarter of the way: three quarters still overlap
    ([(120.0, 10)], 210.0, 5.0),
    ([(120.0, 10), (190.0, 4)], 210.0, 9.0),  # 10 * 0.5 + 4
    ([(120.0, 10)], 240.0, 0.0),  # two windows on: forgotten
    ([(120.0, 10)], 1000.0, 0.0),
    ([(130.0, 5)], 125.0, 5.0),  # a clock that steps back keeps counting
])
def test_used(events, now, used):
    assert _fill(RateWindow(100, W), events).used(now) == pytest.approx(used)


@pytest.mark.parametrize("limit, events, now, n, allows, remaining", [
    (3, [(120.0, 1), (121.0, 1)], 122.0, 1, True, 1),
    (3, [(120.0, 1), (121.0, 1), (122.0, 1)], 123.0, 1, False, 0),
    (10, [(120.0, 10)], 210.0, 5, True, 5),
    (10, [(120.0, 10)], 209.0, 5, False, 4),
    (100, [(120.0, 60)], 130.0, 40, True, 40),
    (100, [(120.0, 60)], 130.0, 41, False, 40),
])
def test_allows_and_remaining(limit, events, now, n, allows, remaining):
    w = _fill(RateWindow(limit, W), events)
    assert w.allows(now, n) is allows and w.remaining(now) == remaining


@pytest.mark.parametrize("limit, events, now, n", [
    (3, [(120.0, 3)], 125.0, 1),  # must wait for the next window and part of it
    (10, [(120.0, 10)], 181.0, 1),  # the previous window's share decays within this one
    (10, [(120.0, 6), (185.0, 4)], 186.0, 1),
    (10, [(120.0, 6), (185.0, 4)], 186.0, 3),
    (100, [(120.0, 100)], 130.0, 100),  # the whole limit: the window must empty
    (5, [(170.0, 2), (200.0, 3)], 201.0, 2),
])
def test_retry_after_is_the_first_moment_it_fits(limit, events, now, n):
    w = _fill(RateWindow(limit, W), events)
    wait = w.retry_after_s(now, n)
    assert wait > 0 and not w.allows(now, n)
    assert w.allows(now + wait + 1e-6, n)
    assert not w.allows(now + wait - 0.01, n)


def test_retry_after_zero_when_it_fits_and_bounded_when_it_never_does():
    w = RateWindow(10, W).add(120.0, 5)
    assert w.retry_after_s(121.0, 5) == 0.0
    assert w.retry_after_s(121.0, 11) == w.reset_s(121.0)


@pytest.mark.parametrize("events, now, reset", [
    ([], 100.0, 0.0),
    ([(120.0, 1)], 130.0, 110.0),  # current window's count is gone at the end of the next one (240)
    ([(120.0, 1)], 200.0, 40.0),  # only the previous window counts: gone at 240
    ([(120.0, 1), (200.0, 1)], 200.0, 100.0),  # 300
])
def test_reset(events, now, reset):
    assert _fill(RateWindow(10, W), events).reset_s(now) == pytest.approx(reset)


def test_immutable_and_o1():
    w = RateWindow(10, W)
    w2 = w.add(120.0)
    assert w.current == 0 and w2.current == 1
    many = _fill(w, [(120.0 + i * 0.001, 1) for i in range(5000)])
    assert (many.current, many.previous) == (5000, 0)  # two numbers, whatever the traffic


@pytest.mark.parametrize("limit, window_s", [(0, 60.0), (5, 0.0), (-1, 60.0)])
def test_bad_windows(limit, window_s):
    with pytest.raises(ValueError):
        RateWindow(limit, window_s)


@pytest.mark.parametrize("seconds, text", [
    (0.0, "0ms"), (0.25, "250ms"), (0.9994, "999ms"), (1.0, "1s"), (6.5, "6.5s"), (59.999, "59.999s"),
    (60.0, "1m0s"), (90.0, "1m30s"), (7205.0, "2h0m5s"), (-1.0, "0ms"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seed", range(20))
def test_admitting_by_the_window_bounds_the_rate(seed):
    """Admit whatever fits: at most N per fixed window, at most 2 N in any sliding window, N per W over time."""
    import bisect
    import random

    rng = random.Random(seed)
    limit = rng.choice([1, 3, 10, 50])
    w, t, admitted = RateWindow(limit, W), 0.0, []
    for _ in range(2000):
        t += rng.expovariate(1 / rng.choice([0.05, 1.0, 5.0]))
        if w.allows(t):
            w = w.add(t)
            admitted.append(t)
    per_fixed: dict[int, int] = {}
    for a in admitted:
        per_fixed[int(a // W)] = per_fixed.get(int(a // W), 0) + 1
    assert max(per_fixed.values()) <= limit
    assert max(bisect.bisect_left(admitted, a + W) - i for i, a in enumerate(admitted)) <= 2 * limit
    assert len(admitted) <= limit * (t / W + 2)
