"""Statistics of `lmfleet bench`: percentiles, TPOT, goodput, summaries, time series (pure functions)."""

import pytest

from lmfleet.bench.loadgen import RequestRecord
from lmfleet.bench.metrics import (SLO, dist_ms, group_by, is_good, measurement_window, percentile, status_label,
                                   summarize, timeseries, tpot)


def rec(start=0.0, ttft=0.1, latency=1.0, out=10, prompt=5, status=200, error="", provider="local/m", cls="a",
        itl=None, warmup=False):
    return RequestRecord(cls=cls, provider=provider, start=start, status=status, error=error, ttft=ttft,
                         latency=latency, itl=itl if itl is not None else [0.1] * max(out - 1, 0),
                         prompt_tokens=prompt, output_tokens=out, warmup=warmup)


@pytest.mark.parametrize("values, p, expected", [
    ([], 50, 0.0),
    ([1.0], 99, 1.0),
    ([1, 2, 3, 4], 50, 2.5),  # linear interpolation, as numpy / vllm bench serve
    ([1, 2, 3, 4, 5], 90, 4.6),
    ([10, 20], 99, 19.9),
    (list(range(101)), 95, 95.0),
])
def test_percentile(values, p, expected):
    assert percentile(values, p) == pytest.approx(expected)


def test_dist_ms_reports_milliseconds():
    d = dist_ms([0.1, 0.2, 0.3, 0.4])
    assert d["mean"] == pytest.approx(250.0)
    assert d["p50"] == pytest.approx(250.0)
    assert d["max"] == pytest.approx(400.0)
    assert set(d) == {"mean", "p50", "p90", "p95", "p99", "max"}


@pytest.mark.parametrize("r, expected", [
    (rec(ttft=0.1, latency=1.0, out=10), 0.1),   # (1.0 - 0.1) / 9
    (rec(ttft=0.5, latency=0.5, out=1), None),   # one token: no TPOT
    (rec(ttft=0.2, latency=0.6, out=3), 0.2),
])
def test_tpot(r, expected):
    assert tpot(r) == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize("r, slo, good", [
    (rec(ttft=0.1, latency=1.0, out=10), SLO(ttft_ms=100), True),
    (rec(ttft=0.1001, latency=1.0, out=10), SLO(ttft_ms=100), False),
    (rec(ttft=0.1, latency=1.0, out=10), SLO(tpot_ms=99), False),
    (rec(ttft=0.1, latency=1.0, out=10), SLO(tpot_ms=100, e2el_ms=1000), True),
    (rec(ttft=0.1, latency=1.0, out=10), SLO(ttft_ms=200, e2el_ms=999), False),
    (rec(ttft=0.9, latency=0.9, out=1), SLO(tpot_ms=1), True),  # TPOT counts as 0 with one token (vLLM)
    (rec(status=500, error="boom"), SLO(ttft_ms=10_000), False),
])
def test_is_good(r, slo, good):
    assert is_good(r, slo) is good


@pytest.mark.parametrize("r, label", [
    (rec(status=429, error="slow down"), "429"),
    (rec(status=0, error="timeout"), "timeout"),
    (rec(status=0, error="ClientConnectorError: refused"), "no_response"),
    (rec(status=200, error="no token received"), "stream_error"),
])
def test_status_label(r, label):
    assert status_label(r) == label


def test_summarize_counts_tokens_of_successful_requests_only():
    records = [rec(out=10, prompt=5), rec(out=20, prompt=7, latency=2.0), rec(status=503, error="x", out=0, prompt=9)]
    s = summarize(records, duration=10.0, slo=SLO(e2el_ms=1500))
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["error_rate"] == pytest.approx(1 / 3)
    assert s["errors_by_status"] == {"503": 1}
    assert (s["input_tokens"], s["output_tokens"]) == (12, 30)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(4.2)
    assert s["request_throughput"] == pytest.approx(0.2)
    assert s["goodput_rps"] == pytest.approx(0.1)
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["e2el_ms"]["max"] == pytest.approx(2000)
    assert len([g for r in records[:2] for g in r.itl]) == 28


def test_summarize_without_slo_has_no_goodput_and_handles_empty():
    s = summarize([], duration=0.0)
    assert s["goodput_rps"] is None and s["slo_attainment"] is None
    assert s["requests"] == 0 and s["output_throughput"] == 0.0 and s["ttft_ms"]["p99"] == 0.0


@pytest.mark.parametrize("records, warmup, expected", [
    ([], 0.0, 0.0),
    ([rec(start=0.0, latency=1.0), rec(start=2.0, latency=1.5)], 0.0, 3.5),
    ([rec(start=0.5, latency=1.0, warmup=True), rec(start=2.0, latency=1.5)], 1.0, 2.5),
    ([rec(start=1.0, latency=1.0)], 0.0, 1.0),  # no warm-up: from the first request's start
])
def test_measurement_window(records, warmup, expected):
    assert measurement_window(records, warmup) == pytest.approx(expected)


def test_group_by_is_sorted_and_complete():
    records = [rec(provider="provider/x"), rec(provider="local/m"), rec(provider="provider/x")]
    groups = group_by(records, lambda r: r.provider)
    assert list(groups) == ["local/m", "provider/x"]
    assert sum(len(v) for v in groups.values()) == 3


def test_timeseries_conserves_tokens_and_in_flight_time():
    records = [rec(start=0.0, ttft=0.5, latency=2.5, out=20, provider="local/m"),
               rec(start=1.0, ttft=0.0, latency=1.0, out=10, provider="provider/x")]
    ts = timeseries(records, bin_s=1.0)
    assert sum(ts["output_tps"]) == pytest.approx(30)
    assert sum(ts["in_flight"]) == pytest.approx(3.5)
    assert sum(ts["completions"]) == 2
    assert ts["external_share"][1] == 0.0  # the bin where nothing completed
    assert ts["external_share"][2] == pytest.approx(0.5)  # both completed in [2, 3): one external
