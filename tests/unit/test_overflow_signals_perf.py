"""LoadTracker at traffic: same figures as a brute-force recount, and a per-request cost that does not grow with it."""

from __future__ import annotations

import random
import statistics
import time

import pytest

from lmfleet.overflow.signals import LoadTracker

WINDOW_S = 30.0


class Oracle:
    """Recomputes the windowed figures from the full event log (what LoadTracker did before it kept running
    totals). The prefill line has its own tests (test_overflow_signals.py)."""

    def __init__(self, capacity: int, ttft_samples: int = 256):
        self.capacity, self.ttft_samples = capacity, ttft_samples
        self.in_flight = 0
        self.spells: list[list[float]] = []  # [start, end]; end = inf while busy
        self.completions: list[tuple[float, int]] = []
        self.ttfts: list[tuple[float, float]] = []

    def start(self, t):
        if self.in_flight == 0:
            self.spells.append([t, float("inf")])
        self.in_flight += 1
        return self.in_flight

    def first(self, t, ttft):
        self.ttfts.append((t, ttft))

    def finish(self, t, tokens, ok):
        self.in_flight -= 1
        if self.in_flight == 0:
            self.spells[-1][1] = t
        if ok:
            self.completions.append((t, tokens))

    def figures(self, now):
        horizon = now - WINDOW_S
        done = [tok for t, tok in self.completions if t >= horizon]
        busy = sum(max(0.0, min(e, now) - max(s, horizon)) for s, e in self.spells if e >= horizon)
        recent = [x for t, x in self.ttfts if t >= horizon][-self.ttft_samples:]
        drain = len(done) / busy if len(done) >= 3 and busy > 0 else None
        return {
            "in_flight": self.in_flight,
            "completions_in_window": len(done),
            "drain_rps": drain,
            "output_tps": sum(done) / busy if drain is not None else None,
            "ttft_s": statistics.median(recent) if recent else None,
        }


def replay(seed: int, rate: float, duration_s: float, capacity: int, check_every: int):
    """Random arrivals with idle gaps, failures and queueing; compares tracker and oracle as it goes."""
    rng = random.Random(seed)
    tracker, oracle = LoadTracker(capacity, window_s=WINDOW_S), Oracle(capacity)
    events, t = [], 0.0
    while t < duration_s:
        t += rng.expovariate(rate) + (rng.random() < 0.01) * rng.uniform(0, 40)  # sometimes a long idle spell
        ttft, service = rng.uniform(0.01, 2.0), rng.uniform(0.1, 5.0)
        events += [(t, 0, len(events)), (t + ttft, 1, len(events)), (t + ttft + service, 2, len(events))]
    tickets, checks = {}, 0
    for i, (t, kind, rid) in enumerate(sorted(events)):
        if kind == 0:
            oracle.start(t)
            tickets[rid] = tracker.on_start(now=t)
        elif kind == 1:
            oracle.first(t, tracker.on_first_token(tickets[rid], now=t))
        else:
            ok, tokens = rng.random() > 0.1, rng.randint(0, 100)
            tracker.on_finish(tickets.pop(rid), tokens, ok=ok, now=t)
            oracle.finish(t, tokens, ok)
        if i % check_every == 0:
            s, want = tracker.snapshot(now=t), oracle.figures(t)
            for key, value in want.items():
                got = getattr(s, key)
                assert (got is None) == (value is None), (key, t, got, value)
                if value is not None:
                    assert got == pytest.approx(value, rel=1e-9, abs=1e-9), (key, t, got, value)
            checks += 1
    return checks


@pytest.mark.parametrize("seed, rate, capacity", [
    (1, 0.5, 2),    # sparse: fewer than 256 TTFTs per window, every figure exact
    (2, 4.0, 8),    # busy, with queueing
    (3, 40.0, 16),  # over 256 TTFTs per window: recent TTFT is the median of the last 256
])
def test_running_totals_match_a_full_recount(seed, rate, capacity):
    assert replay(seed, rate, duration_s=200.0, capacity=capacity, check_every=7) > 20


def _loaded_tracker(samples: int) -> tuple[LoadTracker, float]:
    """A tracker whose 30 s window holds ``samples`` finished requests (and as many TTFTs)."""
    tr = LoadTracker(capacity=64, window_s=WINDOW_S)
    step = 25.0 / samples
    for i in range(samples):
        t = i * step
        tk = tr.on_start(10, now=t)
        tr.on_first_token(tk, now=t + step / 4)
        tr.on_finish(tk, 32, now=t + step / 2)
    return tr, samples * step


def _per_request_s(tr: LoadTracker, t0: float, n: int = 1000) -> float:
    """Seconds per request for the gateway's calls: start, first token, finish, snapshot."""
    start = time.perf_counter()
    t = t0
    for _ in range(n):
        tk = tr.on_start(10, now=t)
        tr.snapshot(now=t)
        tr.on_first_token(tk, now=t + 1e-4)
        tr.on_finish(tk, 32, now=t + 2e-4)
        t += 1e-3  # 1,000 req/s: the window slides and expires as many samples as it takes in
    return (time.perf_counter() - start) / n


def test_per_request_cost_does_not_grow_with_the_window():
    small, t_small = _loaded_tracker(1_000)
    big, t_big = _loaded_tracker(30_000)
    assert big.snapshot(now=t_big).completions_in_window == 30_000
    # interleave and keep the best of several runs: a busy CI machine slows runs, it never speeds them up
    best_small = best_big = float("inf")
    for r in range(5):
        best_small = min(best_small, _per_request_s(small, t_small + r))
        best_big = min(best_big, _per_request_s(big, t_big + r))
    # a window walk would make the 30k tracker ~30x slower; running totals keep it within noise
    assert best_big < 3 * best_small, f"1k samples: {best_small * 1e6:.1f} us/request, 30k: {best_big * 1e6:.1f} us"


def test_sample_bounds_hold_at_traffic():
    tr, t = _loaded_tracker(30_000)
    assert len(tr._ttfts) == 256 and len(tr._prefill) == 64


def test_bad_ttft_samples():
    with pytest.raises(ValueError, match="ttft_samples"):
        LoadTracker(capacity=1, ttft_samples=0)
