"""Trace replay: the Azure format, the window, the pace, the token factor and the context cap (no I/O but the
fixture: tests/unit/data/azure_trace/, an excerpt of the Azure LLM inference trace 2023, CC-BY 4.0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmfleet.bench.replay import (AZURE_ATTRIBUTION, Recorded, ReplaySpec, cap_tokens, parse_azure, parse_replay,
                                  read_trace_file, replay, time_factor, window)
from lmfleet.bench.workload import BenchInputError

EXCERPT = Path(__file__).parent / "data" / "azure_trace" / "AzureLLMInferenceTrace_code_excerpt.csv"


@pytest.fixture(scope="module")
def excerpt() -> list[Recorded]:
    return read_trace_file(EXCERPT)


def test_the_azure_format(excerpt):
    assert len(excerpt) == 20
    assert excerpt[0] == Recorded(0.0, 4808, 10)
    assert excerpt[1].arrival_s == pytest.approx(0.052)  # 04.0319600 - 03.9799600
    assert excerpt[-1] == Recorded(pytest.approx(30.482726), 6587, 18)
    assert [r.arrival_s for r in excerpt] == sorted(r.arrival_s for r in excerpt)


@pytest.mark.parametrize("text,message", [
    ("a,b\n1,2\n", "expected TIMESTAMP, ContextTokens, GeneratedTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,x,3\n", "t.csv:2:"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,3\n", "t.csv:2:"),
])
def test_bad_traces_say_where(text, message):
    with pytest.raises(BenchInputError, match=message):
        parse_azure(text, "t.csv")


def test_rows_out_of_order_are_sorted():
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:02,5,6\n2023-11-16 18:00:00.5,3,4\n"
    assert parse_azure(text) == [Recorded(0.0, 3, 4), Recorded(1.5, 5, 6)]


def test_a_missing_file_says_where_the_trace_lives(tmp_path):
    with pytest.raises(BenchInputError, match="shared/traces"):
        read_trace_file(tmp_path / "nope.csv")


TRACE = [Recorded(t, 100 + i, 10 + i) for i, t in enumerate([0.0, 1.0, 2.0, 5.0, 9.0, 10.0])]


@pytest.mark.parametrize("start,duration,requests,arrivals,length", [
    (0.0, None, None, [0.0, 1.0, 2.0, 5.0, 9.0, 10.0], 10.0),  # the whole trace: its span
    (1.0, 4.0, None, [0.0, 1.0], 4.0),  # [1, 5): 5.0 is out
    (2.0, None, 3, [0.0, 3.0, 7.0], 7.0),  # a count: the span of what was taken
    (5.0, 100.0, None, [0.0, 4.0, 5.0], 100.0),  # a duration past the end: still its length
    (0.0, 10.0, 2, [0.0, 1.0], 10.0),
])
def test_window(start, duration, requests, arrivals, length):
    picked, got_length = window(TRACE, start, duration, requests)
    assert [r.arrival_s for r in picked] == arrivals and got_length == length
    assert picked[0].prompt_tokens == next(r.prompt_tokens for r in TRACE if r.arrival_s >= start)


def test_an_empty_window_is_an_error():
    with pytest.raises(BenchInputError, match="holds no request .* ends at 10 s"):
        window(TRACE, 11.0)


@pytest.mark.parametrize("n,length,target,factor", [
    (10, 10.0, 1.0, 1.0),  # already 1 req/s
    (10, 10.0, 0.5, 2.0),  # half the rate: twice as slow
    (100, 10.0, 2.0, 5.0),  # 10 req/s recorded, 2 wanted: stretched 5x
    (3, 30.0, 1.0, 0.1),  # compressed
])
def test_time_factor(n, length, target, factor):
    assert time_factor(n, length, target) == pytest.approx(factor)
    assert n / (length * time_factor(n, length, target)) == pytest.approx(target)


@pytest.mark.parametrize("n,length,target", [(0, 10.0, 1.0), (5, 0.0, 1.0), (5, 10.0, 0.0)])
def test_time_factor_refuses_what_cannot_be_paced(n, length, target):
    with pytest.raises(BenchInputError):
        time_factor(n, length, target)


@pytest.mark.parametrize("prompt,output,factor,context,expected", [
    (1000, 20, 1.0, None, (1000, 20)),
    (1000, 20, 0.25, None, (250, 5)),
    (3, 1, 0.1, None, (1, 1)),  # floors: at least one token each
    (5000, 20, 1.0, 4096, (4076, 20)),  # the prompt is cut, the output kept
    (7433, 14, 0.5, 4096, (3716, 7)),  # scaled below the cap: untouched
    (100, 9000, 1.0, 4096, (1, 4095)),  # an output beyond the context: output to context - 1, prompt to 1
    (4096, 0, 1.0, 4096, (4095, 1)),
])
def test_cap_tokens(prompt, output, factor, context, expected):
    p, o = cap_tokens(prompt, output, factor, context)
    assert (p, o) == expected and p >= 1 and o >= 1
    assert context is None or p + o <= context


def test_cap_tokens_needs_room_for_two_tokens():
    with pytest.raises(BenchInputError, match="max_model_len=1"):
        cap_tokens(1, 1, 1.0, 1)


def test_replay_paces_the_window_to_a_multiple_of_capacity_and_keeps_its_shape(excerpt):
    spec = ReplaySpec(EXCERPT, start_s=0.0, duration_s=40.0, load=1.3, tokens=0.5)
    r = replay(spec, excerpt, capacity_rps=0.2, max_model_len=4096)
    assert len(r.requests) == 20 and r.length_s == 40.0
    assert r.mean_rps == pytest.approx(1.3 * 0.2)
    assert r.time_factor == pytest.approx(20 / (40 * 0.26))
    for got, rec in zip(r.requests, excerpt):  # one factor for every gap: the bursts stay bursts
        assert got.arrival_s == pytest.approx(rec.arrival_s * r.time_factor)
    assert [q.index for q in r.requests] == list(range(20)) and {q.kind for q in r.requests} == {"trace"}
    assert r.requests[3].prompt_tokens == 3716 and r.capped == 0  # 7433 x 0.5 rounds to 3716
    assert r.attribution == AZURE_ATTRIBUTION and "CC-BY 4.0" in r.describe()
    head = r.header()
    assert "requests" not in head and head["trace"] == EXCERPT.name
    assert head["load"] == 1.3 and head["token_factor"] == 0.5 and head["max_model_len"] == 4096


def test_replay_counts_what_the_context_cut(excerpt):
    r = replay(ReplaySpec(EXCERPT, requests=5), excerpt, max_model_len=4096)
    assert [q.prompt_tokens for q in r.requests] == [4086, 3180, 110, 4082, 34]
    assert r.capped == 2 and r.time_factor == 1.0 and "as recorded" in r.describe()


@pytest.mark.parametrize("spec,factor", [
    (ReplaySpec(Path("t.csv"), rate_rps=2.0), 10 / (9.0 * 2.0)),  # whole trace: 10 over its 9 s span
    (ReplaySpec(Path("t.csv"), speed=4.0), 0.25),
    (ReplaySpec(Path("t.csv")), 1.0),
])
def test_replay_pace_by_rate_or_speed(spec, factor):
    trace = [Recorded(float(t), 10, 10) for t in range(10)]
    assert replay(spec, trace).time_factor == pytest.approx(factor)


def test_load_needs_a_capacity():
    with pytest.raises(BenchInputError, match="measured capacity"):
        replay(ReplaySpec(Path("t.csv"), load=1.2), TRACE)


def test_only_the_azure_file_carries_the_attribution():
    assert replay(ReplaySpec(Path("mine.csv")), TRACE).attribution == ""


@pytest.mark.parametrize("text,expected", [
    ("azure:t.csv", ReplaySpec(Path("t.csv"))),
    ("azure:../shared/traces/A.csv:start=600:duration=300:load=1.3:tokens=0.25",
     ReplaySpec(Path("../shared/traces/A.csv"), start_s=600, duration_s=300, load=1.3, tokens=0.25)),
    ("azure:/x/my traffic.csv:requests=200:rate=0.5", ReplaySpec(Path("/x/my traffic.csv"), requests=200,
                                                                rate_rps=0.5)),
    ("azure:C:/t.csv:speed=2", ReplaySpec(Path("C:/t.csv"), speed=2.0)),  # a ':' in the path
])
def test_parse_replay(text, expected):
    assert parse_replay(text) == expected


def test_parse_replay_default_path():
    default = Path("/d/A.csv")
    assert parse_replay("azure", default) == ReplaySpec(default)
    assert parse_replay("azure:requests=9", default) == ReplaySpec(default, requests=9)
    assert parse_replay("azure:t.csv:requests=9", default) == ReplaySpec(Path("t.csv"), requests=9)


@pytest.mark.parametrize("text,message", [
    ("t.csv", r"expected azure\[:PATH\]"),
    ("sharegpt:t.csv", r"expected azure\[:PATH\]"),
    ("azure:", "no file path"),
    ("azure:start=5", "no file path"),
    ("azure:t.csv:start=x", "'x' is not a number"),
    ("azure:t.csv:requests=1.5", "'1.5' is not a whole number"),
    ("azure:t.csv:duration=10:requests=5", "not both"),
    ("azure:t.csv:load=1:rate=2", "one of load=, rate=, speed="),
    ("azure:t.csv:tokens=0", "tokens=0.0 must be > 0"),
    ("azure:t.csv:start=-1", "start=-1 must be >= 0"),
    ("azure:t.csv:load=1:bogus=1", "'bogus=1': expected one of"),
])
def test_parse_replay_errors(text, message):
    with pytest.raises(BenchInputError, match=message):
        parse_replay(text)
