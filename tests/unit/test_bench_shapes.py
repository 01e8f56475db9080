"""Synthetic load shapes: seeds, rates over time, mixes."""

from __future__ import annotations

import random

import pytest

from lmfleet.bench.shapes import (OUTPUT_MIX, PREFILL_MIX, SHAPES, arrivals, onoff_trace, output_trace,
                                  prefill_trace, ramp_trace, shape_params, shape_trace)
from lmfleet.bench.trace import TraceSpec, bursty_trace
from lmfleet.bench.workload import BenchInputError

CAP = 4.0


@pytest.mark.parametrize("name", SHAPES)
def test_a_seed_gives_the_same_trace_and_another_seed_another(name):
    a, shape = shape_trace(name, CAP, 120.0, 1)
    assert a == shape_trace(name, CAP, 120.0, 1)[0] and a != shape_trace(name, CAP, 120.0, 2)[0]
    assert [r.index for r in a] == list(range(len(a)))
    times = [r.arrival_s for r in a]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 120.0
    assert shape.name == name and shape.params and name in shape.describe()


def test_gamma_is_todays_bursty_trace():
    for short, spec in ((False, TraceSpec(capacity_rps=CAP, duration_s=90.0, burst_s=8.0, burst_every_s=45.0)),
                        (True, TraceSpec(capacity_rps=CAP, duration_s=8.0, burst_s=2.0, burst_every_s=12.0,
                                         long_prompt=(200, 600)))):
        assert shape_trace("gamma", CAP, spec.duration_s, 3, short=short)[0] == bursty_trace(spec, 3)


@pytest.mark.parametrize("load,burstiness", [(0.5, 1.0), (2.0, 1.0), (1.0, 0.5)])
def test_arrivals_at_a_constant_load(load, burstiness):
    times = arrivals(lambda _t: load, CAP, 500.0, random.Random(0), burstiness)
    assert len(times) / 500.0 == pytest.approx(load * CAP, rel=0.08)


def test_no_arrivals_at_zero_load_and_errors():
    assert arrivals(lambda _t: 0.0, CAP, 10.0, random.Random(0)) == []
    with pytest.raises(BenchInputError):
        arrivals(lambda _t: 1.0, 0.0, 10.0, random.Random(0))


def test_onoff_square_bursts():
    trace = onoff_trace(CAP, 400.0, 5, on_load=2.5, off_load=0.2, on_s=10.0, period_s=40.0)
    on = sum(1 for r in trace if r.arrival_s % 40.0 < 10.0)
    off = len(trace) - on
    assert on / (10 * 10) == pytest.approx(2.5 * CAP, rel=0.1)  # 10 periods of 10 s on
    assert off / (10 * 30) == pytest.approx(0.2 * CAP, rel=0.25)
    with pytest.raises(BenchInputError, match="on_s=40"):
        onoff_trace(CAP, 100.0, 0, on_s=40.0, period_s=40.0)


def test_ramp_rises():
    trace = ramp_trace(CAP, 600.0, 2, start_load=0.3, end_load=1.8)
    thirds = [sum(1 for r in trace if k * 200 <= r.arrival_s < (k + 1) * 200) / 200 for k in range(3)]
    assert thirds[0] < thirds[1] < thirds[2]
    assert thirds[0] == pytest.approx(0.55 * CAP, rel=0.15) and thirds[2] == pytest.approx(1.55 * CAP, rel=0.1)


@pytest.mark.parametrize("gen,mix,long_share", [(prefill_trace, PREFILL_MIX, 0.7), (output_trace, OUTPUT_MIX, 0.0)])
def test_prefill_and_output_mixes(gen, mix, long_share):
    trace = gen(CAP, 300.0, 4, mean_load=0.9)
    assert len(trace) / 300.0 == pytest.approx(0.9 * CAP, rel=0.1)
    longs = [r for r in trace if r.kind == "long"]
    assert len(longs) / len(trace) == pytest.approx(long_share, abs=0.06)
    for r in trace:
        p, o = (mix.long_prompt, mix.long_output) if r.kind == "long" else (mix.chat_prompt, mix.chat_output)
        assert p[0] <= r.prompt_tokens <= p[1] and o[0] <= r.output_tokens <= o[1]


def test_prefill_is_prompt_heavy_and_output_is_answer_heavy():
    pre, out = prefill_trace(CAP, 200.0, 1), output_trace(CAP, 200.0, 1)
    ratio = lambda t: sum(r.prompt_tokens for r in t) / sum(r.output_tokens for r in t)  # noqa: E731
    assert ratio(pre) > 50 and ratio(out) < 0.5


def test_short_runs_get_short_periods_and_unknown_shapes_fail():
    assert shape_params("onoff", short=True)["period_s"] < 10 < shape_params("onoff")["period_s"]
    with pytest.raises(BenchInputError, match="expected one of"):
        shape_trace("square", CAP, 10.0, 0)
