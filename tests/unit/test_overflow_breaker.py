"""CircuitBreaker state machine, 429 blocking, backoff and Retry-After parsing."""

import random

import pytest

from lmfleet.config.models import BreakerConfig
from lmfleet.overflow.breaker import BreakerState, CircuitBreaker, backoff_s, parse_retry_after

C, O, H = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def play(breaker, script):
    """script: (t, action[, arg]); actions: ok, fail, limit, acquire. Returns (t, action, state, allows)."""
    trace = []
    ticket = None  # the last admission: "ok" / "cancel" report on it
    for t, action, *arg in script:
        result = None
        if action == "ok":
            breaker.on_success(now=t, ticket=ticket)
        elif action == "cancel":
            breaker.release(ticket)
        elif action == "fail":
            breaker.on_failure(now=t)
        elif action == "limit":
            breaker.on_rate_limited(arg[0] if arg else None, now=t)
        elif action == "acquire":
            ticket = breaker.acquire(now=t)
            result = ticket is not None
        trace.append((result, breaker.state(now=t), breaker.allows(now=t)))
    return trace


@pytest.mark.parametrize(
    "script, expected_last",
    [
        # 3 consecutive failures open it (consecutive_failures=3)
        ([(0, "fail"), (1, "fail"), (2, "fail")], (None, O, False)),
        # a success resets the streak (2 failures of 3 outcomes, under min_requests=4)
        ([(0, "fail"), (1, "fail"), (2, "ok")], (None, C, True)),
        # ... but the 4th outcome brings the error rate to 3/4 >= 0.5
        ([(0, "fail"), (1, "fail"), (2, "ok"), (3, "fail")], (None, O, False)),
        # error rate: 4 outcomes, 2 failures = 0.5 >= 0.5 with min_requests=4 -> open
        ([(0, "fail"), (1, "ok"), (2, "fail"), (3, "ok")], (None, C, True)),
        ([(0, "ok"), (1, "fail"), (2, "ok"), (3, "fail")], (None, O, False)),
        # still open before the cooldown (10 s), half-open at it
        ([(0, "fail"), (0, "fail"), (0, "fail"), (9.9, "acquire")], (False, O, False)),
        ([(0, "fail"), (0, "fail"), (0, "fail"), (10, "acquire")], (True, H, False)),
        # one probe only; the second caller is refused
        ([(0, "fail"), (0, "fail"), (0, "fail"), (10, "acquire"), (10.1, "acquire")], (False, H, False)),
        # probe succeeds -> closed
        ([(0, "fail"), (0, "fail"), (0, "fail"), (10, "acquire"), (11, "ok")], (None, C, True)),
        # probe fails -> open for another cooldown
        ([(0, "fail"), (0, "fail"), (0, "fail"), (10, "acquire"), (11, "fail"), (20.9, "acquire")], (False, O, False)),
        ([(0, "fail"), (0, "fail"), (0, "fail"), (10, "acquire"), (11, "fail"), (21, "acquire")], (True, H, False)),
        # a probe that never reports is given up after another cooldown
        ([(0, "fail"), (0, "fail"), (0, "fail"), (10, "acquire"), (20, "acquire")], (True, H, False)),
        # a request admitted while closed that succeeds during half-open (a long stream) does not close it
        ([(0, "acquire"), (0, "fail"), (0, "fail"), (0, "fail"), (10, "acquire"), (10, "acquire"), (11, "ok")],
         (None, H, False)),
        ([(0, "acquire"), (1, "fail"), (1, "fail"), (1, "fail"), (11, "acquire"), (12, "cancel"), (12, "ok")],
         (None, H, True)),  # a cancelled probe is neutral and frees the probe slot; nothing closes it
        # ... only the probe's own success does
        ([(0, "acquire"), (1, "fail"), (1, "fail"), (1, "fail"), (11, "acquire"), (12, "ok")], (None, C, True)),
        # a probe given up after a cooldown: its late success proves nothing, the new probe's does
        ([(0, "fail"), (0, "fail"), (0, "fail"), (10, "acquire"), (20, "acquire"), (21, "ok")], (None, C, True)),
        # a straggler success while open does not close it
        ([(0, "fail"), (0, "fail"), (0, "fail"), (5, "ok")], (None, O, False)),
        # 429 blocks for Retry-After without touching health
        ([(0, "limit", 2.0), (1.9, "acquire")], (False, C, False)),
        ([(0, "limit", 2.0), (2.0, "acquire")], (True, C, True)),
        ([(0, "limit")], (None, C, False)),  # default 1 s block
        ([(0, "limit"), (1.0, "acquire")], (True, C, True)),
        # 429s never open the breaker
        ([(0, "limit", 0), (0, "limit", 0), (0, "limit", 0), (0, "limit", 0), (0, "acquire")], (True, C, True)),
    ],
)
def test_breaker_script(script, expected_last):
    b = CircuitBreaker(consecutive_failures=3, error_rate=0.5, window=4, cooldown_s=10.0, min_requests=4)
    assert play(b, script)[-1] == expected_last


@pytest.mark.parametrize(
    "script, now, expected",
    [
        ([], 0, 0.0),
        ([(0, "fail"), (0, "fail"), (0, "fail")], 4, 6.0),
        ([(0, "limit", 30.0)], 10, 20.0),
        ([(0, "fail"), (0, "fail"), (0, "fail"), (10, "acquire")], 12, 8.0),
    ],
)
def test_retry_after(script, now, expected):
    b = CircuitBreaker(consecutive_failures=3, cooldown_s=10.0)
    play(b, script)
    assert b.retry_after_s(now=now) == pytest.approx(expected)


def test_from_config_and_clock():
    t = [0.0]
    b = CircuitBreaker.from_config(BreakerConfig(consecutive_failures=1, cooldown_s=5.0), clock=lambda: t[0])
    b.on_failure()
    assert b.state() is O
    t[0] = 5.0
    ticket = b.acquire()
    assert ticket and b.state() is H
    b.on_success()  # not the probe's: proves nothing
    assert b.state() is H
    b.on_success(ticket=ticket)
    assert b.state() is C


@pytest.mark.parametrize("kwargs", [{"consecutive_failures": 0}, {"window": 0}, {"error_rate": 0}, {"error_rate": 1.5}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        CircuitBreaker(**kwargs)


class FixedRng:
    def __init__(self, x):
        self.x = x

    def random(self):
        return self.x


@pytest.mark.parametrize(
    "attempt, base, cap, u, expected",
    [
        (0, 0.5, 10.0, 0.5, 0.25),
        (1, 0.5, 10.0, 0.5, 0.5),
        (3, 0.5, 10.0, 0.999, 3.996),
        (10, 0.5, 10.0, 0.5, 5.0),  # capped at 10
        (1000, 0.5, 10.0, 1.0, 10.0),  # huge attempt does not overflow
        (2, 1.0, 10.0, 0.0, 0.0),
    ],
)
def test_backoff_full_jitter(attempt, base, cap, u, expected):
    assert backoff_s(attempt, base, cap, FixedRng(u)) == pytest.approx(expected)


def test_backoff_spread_is_full_range():
    rng = random.Random(7)
    xs = [backoff_s(4, 0.5, 10.0, rng) for _ in range(2000)]
    assert 0 <= min(xs) < 0.5 and 7.5 < max(xs) < 8.0


def test_backoff_rejects_negative_attempt():
    with pytest.raises(ValueError):
        backoff_s(-1)


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        ("", None),
        ("2", 2.0),
        (" 1.5 ", 1.5),
        ("-3", None),  # negative or NaN: ignored
        ("nan", None),
        ("inf", 300.0),  # clamped: an infinite block would park the provider for ever
        ("1e999", 300.0),
        ("301", 300.0),
        ("300", 300.0),
        ("Fri, 31 Dec 9999 23:59:59 GMT", 300.0),
        ("soon", None),
        ("Sun, 29 Nov 2026 12:00:30 GMT", 30.0),
        ("Sun, 29 Nov 2026 11:59:00 GMT", 0.0),
    ],
)
def test_parse_retry_after(value, expected):
    from datetime import datetime, timezone

    now = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc).timestamp()
    assert parse_retry_after(value, now_epoch=now) == expected


@pytest.mark.parametrize("retry_after, blocked_for", [(float("inf"), 300.0), (float("nan"), 1.0), (-5.0, 0.0),
                                                      (None, 1.0), (12.0, 12.0)])
def test_rate_limit_block_is_finite(retry_after, blocked_for):
    b = CircuitBreaker(clock=lambda: 100.0)
    b.on_rate_limited(retry_after)
    assert b.retry_after_s() == pytest.approx(blocked_for)
