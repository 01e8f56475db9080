"""LoadTracker: in-flight count, busy-time drain rate, windowed TTFT, base TTFT, engine stats."""

import pytest

from lmfleet.overflow.signals import LoadTracker, QueueSignals


def _run(tracker, requests, until):
    """requests: (start, ttft, finish, output_tokens, ok); events up to ``until`` are replayed in time order."""
    events = []
    for i, (start, ttft, finish, out, ok) in enumerate(requests):
        events += [(start, 0, i), (start + ttft, 1, i), (finish, 2, i)]
    tickets = {}
    for t, kind, i in sorted(e for e in events if e[0] <= until):
        _, _, _, out, ok = requests[i]
        if kind == 0:
            tickets[i] = tracker.on_start(10, now=t)
        elif kind == 1:
            tracker.on_first_token(tickets[i], now=t)
        else:
            tracker.on_finish(tickets[i], out, ok=ok, now=t)


@pytest.mark.parametrize(
    "requests, now, in_flight, drain, tps",
    [
        # nothing measured yet
        ([], 0.0, 0, None, None),
        # fewer than min_completions (3) -> unknown rate
        ([(0, 0.1, 1, 10, True), (0, 0.1, 2, 10, True)], 2.0, 0, None, None),
        # 4 completions over 4 busy seconds
        ([(0, 0.1, 1, 10, True), (0, 0.1, 2, 10, True), (0, 0.1, 3, 10, True), (0, 0.1, 4, 10, True)], 4.0, 0, 1.0, 10.0),
        # an idle gap (4..10) does not dilute the rate: 6 completions over 6 busy seconds
        ([(0, 0.1, 2, 5, True), (0, 0.1, 4, 5, True), (10, 0.1, 11, 5, True),
          (10, 0.1, 12, 5, True), (10, 0.1, 13, 5, True), (10, 0.1, 14, 5, True)], 14.0, 0, 6 / 8, 30 / 8),
        # failures free slots but are not drained work
        ([(0, 0.1, 1, 10, True), (0, 0.1, 2, 10, True), (0, 0.1, 3, 10, True), (0, 0.1, 4, 99, False)], 4.0, 0, 0.75, 7.5),
        # still running requests count in flight; busy until now
        ([(0, 0.1, 1, 10, True), (0, 0.1, 2, 10, True), (0, 0.1, 3, 10, True), (0, 0.1, 99, 10, True)], 6.0, 1, 0.5, 5.0),
        # completions older than the 30 s window drop out
        ([(0, 0.1, 1, 10, True), (0, 0.1, 2, 10, True), (0, 0.1, 3, 10, True)], 40.0, 0, None, None),
    ],
)
def test_drain_rate(requests, now, in_flight, drain, tps):
    tr = LoadTracker(capacity=4, window_s=30.0)
    _run(tr, requests, until=now)
    s = tr.snapshot(now=now)
    assert s.in_flight == in_flight
    assert s.drain_rps == (pytest.approx(drain) if drain is not None else None)
    assert s.output_tps == (pytest.approx(tps) if tps is not None else None)


@pytest.mark.parametrize(
    "requests, now, completions, busy",
    [
        ([], 0.0, 0, 0.0),
        # two completions, under min_completions: no rate, but their count and the busy time are reported
        ([(0, 0.1, 1, 10, True), (0, 0.1, 2, 10, True)], 2.0, 2, 2.0),
        # one request still running since 0: busy until now, nothing completed
        ([(0, 0.1, 99, 10, True)], 12.0, 0, 12.0),
        # an idle gap (4..10) is not busy
        ([(0, 0.1, 2, 5, True), (0, 0.1, 4, 5, True), (10, 0.1, 11, 5, True)], 12.0, 3, 5.0),
        # only the window's last 30 s count
        ([(0, 0.1, 99, 10, True)], 40.0, 0, 30.0),
    ],
)
def test_busy_seconds_and_completions_are_reported_before_a_rate_is(requests, now, completions, busy):
    tr = LoadTracker(capacity=4, window_s=30.0)
    _run(tr, requests, until=now)
    s = tr.snapshot(now=now)
    assert (s.completions_in_window, s.busy_s) == (completions, pytest.approx(busy))


@pytest.mark.parametrize(
    "starts_ttfts, capacity, ttft, base",
    [
        ([], 2, None, None),
        # all found a free slot: both medians equal
        ([(0.0, 0.2), (10.0, 0.4), (20.0, 0.3)], 4, 0.3, 0.3),
        # 4 concurrent with capacity 2: the last two queued, only the first two are base samples
        ([(0.0, 0.2), (0.0, 0.2), (0.0, 5.0), (0.0, 6.0)], 2, 2.6, 0.2),
    ],
)
def test_ttft_and_base_ttft(starts_ttfts, capacity, ttft, base):
    tr = LoadTracker(capacity=capacity)
    tickets = [(tr.on_start(now=s), s + x) for s, x in starts_ttfts]
    for tk, t in tickets:
        tr.on_first_token(tk, now=t)
    s = tr.snapshot(now=25.0)
    assert s.ttft_s == (pytest.approx(ttft) if ttft is not None else None)
    assert s.base_ttft_s == (pytest.approx(base) if base is not None else None)


@pytest.mark.parametrize("now,ttft,base,stale", [
    (20.0, 0.25, 0.25, False),
    (50.0, None, 0.25, False),   # the recent TTFT has left its 30 s window; the prefill line lasts 600 s
    (100.0, None, 0.25, True),   # idle, newest sample over 60 s old: stale (the estimator caps it)
    (700.0, None, None, False),  # gone too: the estimator's cold default stands in
])
def test_base_ttft_outlives_the_window_but_not_prefill_ttl(now, ttft, base, stale):
    tr = LoadTracker(capacity=1, window_s=30.0)
    tk = tr.on_start(now=0.0)
    tr.on_first_token(tk, now=0.25)
    tr.on_finish(tk, 5, now=1.0)
    s = tr.snapshot(now=now)
    assert s.ttft_s == ttft
    assert s.base_ttft_s == base
    assert s.prefill_stale is stale


@pytest.mark.parametrize("base,slope,stale,measured", [
    (0.4, 0.001, False, True),    # a base TTFT and a slope from this engine's requests
    (0.4, None, False, False),    # no slope yet: the prompt's length is not in the estimate
    (None, None, False, False),   # nothing measured: the cold estimate
    (0.4, 0.001, True, False),    # stale: the estimate is capped by the cold one
])
def test_line_measured(base, slope, stale, measured):
    s = QueueSignals(now=0.0, in_flight=0, drain_rps=None, output_tps=None, ttft_s=None, base_ttft_s=base,
                     completions_in_window=0, prefill_s_per_token=slope, base_prefill_tokens=300.0,
                     prefill_stale=stale)
    assert s.line_measured is measured


def test_a_slow_base_ttft_from_a_burst_does_not_hold_an_idle_engine_above_the_threshold():
    from lmfleet.overflow.estimator import estimate_wait_ms

    tr = LoadTracker(capacity=8)
    for i in range(8):  # a burst: every request found a free slot, and took 5.4 s to its first token
        tk = tr.on_start(now=0.0)
        tr.on_first_token(tk, now=5.4)
        tr.on_finish(tk, 10, now=6.0 + i)
    assert estimate_wait_ms(tr.snapshot(now=20.0), 8) == pytest.approx(5400)  # everything overflows, so ...
    # ... until, idle for over 60 s after its newest sample, the line is stale and capped at the cold default
    assert estimate_wait_ms(tr.snapshot(now=70.0), 8) == pytest.approx(1000)
    held = tr.on_start(now=70.0)  # one request in flight: it will measure the engine, the line is not stale
    assert estimate_wait_ms(tr.snapshot(now=70.0), 8) == pytest.approx(5400)
    tr.on_finish(held, 1, now=71.0)


def test_explicit_ttft_overrides_clock():
    tr = LoadTracker(capacity=1)
    tk = tr.on_start(now=0.0)
    assert tr.on_first_token(tk, now=9.0, ttft_s=0.5) == 0.5
    assert tr.snapshot(now=9.0).ttft_s == 0.5


@pytest.mark.parametrize("set_at, now, expect", [(0.0, 5.0, (3, 7)), (0.0, 10.0, (3, 7)), (0.0, 10.5, (None, None))])
def test_engine_stats_expire(set_at, now, expect):
    tr = LoadTracker(capacity=8, engine_stats_ttl_s=10.0)
    tr.set_engine_stats(3, 7, now=set_at)
    s = tr.snapshot(now=now)
    assert (s.engine_running, s.engine_waiting) == expect


def test_clock_is_used_when_now_is_omitted():
    t = [100.0]
    tr = LoadTracker(capacity=1, clock=lambda: t[0])
    tk = tr.on_start()
    t[0] = 100.5
    assert tr.on_first_token(tk) == pytest.approx(0.5)
    assert tr.snapshot().now == 100.5


@pytest.mark.parametrize("kwargs", [{"capacity": 0}, {"capacity": 1, "window_s": 0}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        LoadTracker(**kwargs)


def test_finish_without_start():
    tr = LoadTracker(capacity=1)
    tk = tr.on_start(now=0)
    tr.on_finish(tk, now=1)
    with pytest.raises(RuntimeError):
        tr.on_finish(tk, now=2)


@pytest.mark.parametrize(
    "samples, expected",
    [
        ([], None),
        # every pair closer than 256 tokens: noise, no slope
        ([(100, 0.3), (200, 0.5), (300, 0.4)], None),
        # exactly linear: 1 ms per token
        ([(100, 0.2), (1100, 1.2), (2100, 2.2), (3100, 3.2)], 0.001),
        # one sample slowed by other work (a burst) does not move the median slope
        ([(100, 0.2), (1100, 1.2), (2100, 2.2), (3100, 3.2), (150, 4.0)], 0.001),
        # a falling fit is clamped at 0 (never a negative prefill time)
        ([(100, 2.0), (1100, 1.0), (2100, 0.5)], 0.0),
        # two pairs only: fewer than PREFILL_MIN_PAIRS (3)
        ([(100, 0.2), (1100, 1.2), (150, 0.3)], None),
    ],
)
def test_prefill_slope(samples, expected):
    from lmfleet.overflow.signals import prefill_slope
    got = prefill_slope(samples)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_pending_prefill_counts_prompts_until_their_first_token_or_end():
    tr = LoadTracker(capacity=4)
    a = tr.on_start(1000, now=0.0)
    b = tr.on_start(200, now=0.1)
    assert (a.pending_ahead, b.pending_ahead) == (0, 1000)
    assert tr.snapshot(now=0.2).pending_prefill_tokens == 1200
    tr.on_first_token(a, now=0.5)
    assert tr.snapshot(now=0.5).pending_prefill_tokens == 200
    tr.on_finish(b, ok=False, now=0.6)  # cancelled before its first token
    tr.on_finish(a, 10, now=0.7)
    assert tr.snapshot(now=0.7).pending_prefill_tokens == 0


def test_prefill_line_is_learned_from_unqueued_requests():
    """TTFT = 0.1 s + 0.5 ms per token of prefill work (own prompt + prompts ahead): the tracker finds 0.5 ms, and
    the samples' median work; a queued request's TTFT (it waited for a slot) is not a sample."""
    tr = LoadTracker(capacity=2)
    t = 0.0
    for prompt in (100, 150, 2000, 120, 3000, 90, 1000, 110):
        tk = tr.on_start(prompt, now=t)
        tr.on_first_token(tk, now=t + 0.1 + 0.0005 * prompt)
        tr.on_finish(tk, 10, now=t + 1.0)
        t += 2.0
    held = [tr.on_start(50, now=t), tr.on_start(50, now=t)]
    queued = tr.on_start(50, now=t)
    tr.on_first_token(queued, now=t + 30.0)  # position 3 > capacity 2
    s = tr.snapshot(now=t + 30.0)
    assert s.prefill_s_per_token == pytest.approx(0.0005)
    assert s.base_prefill_tokens == pytest.approx(135)  # median of the 8 unqueued samples' prompts
    assert s.pending_prefill_tokens == 100  # the two held requests have no first token yet
    for tk in (*held, queued):
        tr.on_finish(tk, 1, now=t + 31.0)


def test_a_non_streamed_request_is_not_prefill_work_ahead():
    """No first token will be reported for it: counted, it would sit in the pending work until it ended."""
    tr = LoadTracker(capacity=4)
    a = tr.on_start(500, now=0.0, awaits_first_token=False)
    b = tr.on_start(100, now=0.1)
    assert b.pending_ahead == 0 and tr.snapshot(now=0.2).pending_prefill_tokens == 100
    tr.on_finish(a, 10, now=1.0)
    tr.on_finish(b, 10, now=1.1)
    assert tr.snapshot(now=1.1).pending_prefill_tokens == 0


@pytest.mark.parametrize(
    "samples, base, work, slope",
    [
        ([], None, None, None),
        # one sample, or every pair closer than 256 tokens: the median TTFT at the median work, no slope
        ([(100, 0.3)], 0.3, 100, None),
        ([(100, 0.3), (200, 0.5), (300, 0.4)], 0.4, 200, None),
        # exactly linear, 1 ms per token: the line's TTFT at the median work (1,600 tokens)
        ([(100, 0.2), (1100, 1.2), (2100, 2.2), (3100, 3.2)], 1.7, 1600, 0.001),
        # two samples slowed by other work (a burst) move neither intercept nor slope
        ([(100, 0.2), (1100, 1.2), (2100, 2.2), (3100, 3.2), (150, 4.0), (120, 3.0), (600, 0.7)], 0.7, 600, 0.001),
        # a falling fit is clamped at 0: the median TTFT
        ([(100, 2.0), (1100, 1.0), (2100, 0.5)], 1.0, 1100, 0.0),
    ],
)
def test_prefill_line(samples, base, work, slope):
    from lmfleet.overflow.signals import prefill_line
    got = prefill_line(samples)
    if base is None:
        assert got is None
        return
    assert got.base_ttft_s == pytest.approx(base, abs=1e-5)
    assert got.base_work == pytest.approx(work)
    assert got.slope == (pytest.approx(slope, abs=1e-8) if slope is not None else None)


def test_prefill_line_is_not_the_least_squares_line():
    """Noisy samples whose errors are skewed (a few slow ones): least squares would lift the line toward them, the
    least-absolute-deviations line passes through the bulk."""
    from lmfleet.overflow.signals import prefill_line
    samples = [(w, 0.1 + 0.0005 * w) for w in range(100, 3100, 250)] + [(300, 2.5), (2000, 4.0)]
    got = prefill_line(samples)
    assert got.slope == pytest.approx(0.0005, rel=0.05)
    assert got.base_ttft_s == pytest.approx(0.1 + 0.0005 * got.base_work, abs=0.02)


@pytest.mark.parametrize("newest_at, now, in_flight, stale", [
    (None, 100.0, 0, False),  # no sample: nothing to be stale (the cold default stands in anyway)
    (0.0, 60.0, 0, False),    # 60 s: not over idle_reset_s
    (0.0, 60.5, 0, True),
    (0.0, 500.0, 1, False),   # a request in flight will measure the engine
])
def test_line_is_stale(newest_at, now, in_flight, stale):
    from lmfleet.overflow.signals import line_is_stale
    assert line_is_stale(newest_at, now, in_flight) is stale


def test_prefill_line_is_refitted_at_most_once_a_second():
    tr = LoadTracker(capacity=4)
    for i, (w, y) in enumerate([(100, 0.2), (1100, 1.2), (2100, 2.2), (3100, 3.2)]):
        tk = tr.on_start(w, now=float(i))
        tr.on_first_token(tk, now=i + y)
        tr.on_finish(tk, 1, now=i + y + 0.1)
    assert tr.snapshot(now=10.0).prefill_s_per_token == pytest.approx(0.001)
    tk = tr.on_start(100, now=10.0)
    tr.on_first_token(tk, now=10.3)  # 0.1 s slower than the line
    tr.on_finish(tk, 1, now=10.4)
    assert tr.snapshot(now=10.9).base_prefill_tokens == pytest.approx(1600)  # the fit of 10.0 still stands
    assert tr.snapshot(now=11.5).base_prefill_tokens == pytest.approx(1100)  # refitted: five samples now
