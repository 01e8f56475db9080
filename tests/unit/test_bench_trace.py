"""The overflow benchmark's trace and fake provider latency: seeds, load shape, distribution."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest

from lmfleet.bench.trace import (
    ProviderLatency,
    TraceRequest,
    TraceSpec,
    bursty_trace,
    peak_rate_rps,
    provider_timings,
)

SPEC = TraceSpec(capacity_rps=2.0, duration_s=600.0)


def test_a_seed_gives_the_same_trace_and_another_seed_another():
    assert bursty_trace(SPEC, 1) == bursty_trace(SPEC, 1)
    assert bursty_trace(SPEC, 1) != bursty_trace(SPEC, 2)


@pytest.mark.parametrize("seed", range(5))
def test_mean_load_and_bursts(seed):
    trace = bursty_trace(SPEC, seed)
    mean_rps = len(trace) / SPEC.duration_s
    assert mean_rps == pytest.approx(SPEC.mean_load * SPEC.capacity_rps, rel=0.15)
    assert peak_rate_rps(trace, SPEC.burst_s / 2) >= 3.0 * SPEC.capacity_rps
    arrivals = [r.arrival_s for r in trace]
    assert arrivals == sorted(arrivals) and 0 <= arrivals[0] and arrivals[-1] < SPEC.duration_s
    assert [r.index for r in trace] == list(range(len(trace)))


def test_bursts_come_at_the_start_of_each_period():
    trace = bursty_trace(SPEC, 0)
    in_burst = sum(1 for r in trace if r.arrival_s % SPEC.burst_every_s < SPEC.burst_s)
    expected_share = SPEC.burst_load * SPEC.burst_s / (SPEC.mean_load * SPEC.burst_every_s)  # 35 / 42
    assert in_burst / len(trace) == pytest.approx(expected_share, abs=0.06)


def test_gamma_gaps_are_burstier_than_poisson():
    calm = TraceSpec(capacity_rps=5.0, duration_s=2000.0, burst_load=0.7, mean_load=0.7, burstiness=0.5)
    gaps = np.diff([r.arrival_s for r in bursty_trace(calm, 3)])
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / 0.5 ** 0.5, rel=0.1)  # a gamma of shape k has CV 1/sqrt(k)


def test_the_mix_of_chats_and_long_prompts():
    trace = bursty_trace(SPEC, 4)
    longs = [r for r in trace if r.kind == "long"]
    assert len(longs) / len(trace) == pytest.approx(SPEC.long_share, abs=0.05)
    assert all(1000 <= r.prompt_tokens <= 3000 and 16 <= r.output_tokens <= 64 for r in longs)
    assert all(20 <= r.prompt_tokens <= 200 and 16 <= r.output_tokens <= 128 for r in trace if r.kind == "chat")


@pytest.mark.parametrize("kwargs, words", [
    ({"capacity_rps": 0}, "capacity_rps=0"),
    ({"burstiness": 1.5}, "burstiness=1.5"),
    ({"burst_load": 6.0}, "lengthen the period"),
    ({"burst_s": 60.0}, "shorter than burst_every_s"),
    ({"chat_prompt": (10, 5)}, "chat_prompt=(10, 5)"),
])
def test_spec_checks(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        TraceSpec(**{"capacity_rps": 1.0, **kwargs})


def test_calm_load_averages_the_period_to_the_mean():
    s = TraceSpec(capacity_rps=1.0)
    period = s.burst_load * s.burst_s + s.calm_load * (s.burst_every_s - s.burst_s)
    assert period / s.burst_every_s == pytest.approx(s.mean_load)
    assert s.load_at(0.0) == s.burst_load and s.load_at(s.burst_s + 1) == s.calm_load


def test_peak_rate():
    trace = [TraceRequest(i, t, 1, 1, "chat") for i, t in enumerate([0.0, 0.1, 0.2, 5.0])]
    assert peak_rate_rps(trace, 1.0) == 3.0
    assert peak_rate_rps([], 1.0) == 0.0


def test_provider_ttft_median_and_p99():
    model = ProviderLatency()
    timings = provider_timings(model, [1] * 40_000, seed=0)
    ttfts = [t.ttft_s for t in timings]
    assert statistics.median(ttfts) == pytest.approx(0.4, rel=0.03)
    assert float(np.percentile(ttfts, 99)) == pytest.approx(1.5, rel=0.08)


def test_provider_timings_are_seeded_and_add_per_token_time():
    model = ProviderLatency()
    assert provider_timings(model, [10, 20], 5) == provider_timings(model, [10, 20], 5)
    assert provider_timings(model, [10, 20], 5) != provider_timings(model, [10, 20], 6)
    t = model.sample(random.Random(1), 41)
    assert t.e2e_s - t.ttft_s == pytest.approx(40 * 0.025)
    with pytest.raises(ValueError, match="ttft_median_s"):
        ProviderLatency(ttft_median_s=2.0, ttft_p99_s=1.0)
