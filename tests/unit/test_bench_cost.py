"""Cost: price flags, provider matching, ledger parsing, $/1M output tokens."""

import json

import httpx
import pytest

from lmfleet.bench.cost import (Price, cost_table, costs_from_prices, parse_price, parse_usage,
                                per_million_output, price_for)
from lmfleet.bench.sweep import parse_values, plan_for, set_overflow, sweep_row
from lmfleet.bench.loadgen import LoadPlan
from lmfleet.bench.workload import BenchInputError


@pytest.mark.parametrize("text, key, price", [
    ("local=0.05:0.10", "local", Price(0.05, 0.10)),
    ("provider/x=0.5:1.5", "provider/x", Price(0.5, 1.5)),
    ("*=0:2", "*", Price(0.0, 2.0)),
])
def test_parse_price(text, key, price):
    assert parse_price(text) == (key, price)


@pytest.mark.parametrize("text", ["local", "local=1", "=1:2", "local=a:b", "local=1:2:3", "local=-1:2"])
def test_parse_price_errors(text):
    with pytest.raises(BenchInputError, match="--price"):
        parse_price(text)


PRICES = {"local": Price(0.05, 0.10), "provider/x": Price(0.5, 1.5), "*": Price(1, 1)}


@pytest.mark.parametrize("provider, expected", [
    ("local/smollm2", Price(0.05, 0.10)),
    ("provider/x", Price(0.5, 1.5)),
    ("provider/y", Price(1, 1)),
    ("127.0.0.1:8000", Price(1, 1)),
])
def test_price_for(provider, expected):
    assert price_for(provider, PRICES) == expected


def test_price_for_without_default():
    assert price_for("provider/y", {"local": Price(1, 1)}) is None


def test_costs_and_per_million():
    costs = costs_from_prices({"local/a": (1_000_000, 2_000_000), "other": (1, 1)}, {"local": Price(0.05, 0.10)})
    assert costs == {"local/a": pytest.approx(0.25), "other": None}
    assert per_million_output(0.25, 2_000_000) == pytest.approx(0.125)
    assert per_million_output(None, 5) is None and per_million_output(1.0, 0) is None


@pytest.mark.parametrize("data, expected", [
    ({"by_provider": {"local/a": {"cost_usd": 1.0, "input_tokens": 2, "output_tokens": 3}}},
     {"local/a": {"cost_usd": 1.0, "input_tokens": 2, "output_tokens": 3}}),
    ({"rows": [{"provider": "p/x", "cost_usd": 1, "output_tokens": 5}, {"provider": "p/x", "cost": 2}]},
     {"p/x": {"cost_usd": 3.0, "input_tokens": 0, "output_tokens": 5}}),
    ([{"provider": "l", "cost_usd": 0.5, "prompt_tokens": 1, "completion_tokens": 2}],
     {"l": {"cost_usd": 0.5, "input_tokens": 1, "output_tokens": 2}}),
    ({"since": 1.0, "until": None, "total": {"served_by": "total", "cost_usd": 9},  # lmfleet's gateway
      "rows": [{"served_by": "local/smollm2", "requests": 3, "input_tokens": 30, "output_tokens": 60,
                "cost_usd": 0.002, "usd_per_1m_output": 33.3}]},
     {"local/smollm2": {"cost_usd": 0.002, "input_tokens": 30, "output_tokens": 60}}),
    ({"something": "else"}, None),
    ([], None),
])
def test_parse_usage(data, expected):
    assert parse_usage(data) == expected


def test_cost_table_prefers_ledger_then_prices():
    tokens = {"local/a": (0, 1_000_000), "provider/x": (0, 1_000_000), "provider/z": (0, 10)}
    table = cost_table(tokens, {"provider": Price(0, 2.0)},
                       ledger={"local/a": {"cost_usd": 0.1, "input_tokens": 0, "output_tokens": 1_000_000}})
    rows = table["providers"]
    assert rows["local/a"] == {"cost_usd": 0.1, "source": "ledger", "usd_per_1m_output": pytest.approx(0.1)}
    assert rows["provider/x"]["source"] == "price" and rows["provider/x"]["usd_per_1m_output"] == pytest.approx(2.0)
    assert table["overall"]["complete"] is True
    assert table["overall"]["usd_per_1m_output"] == pytest.approx((0.1 + 2.0 + 2e-5) / 2.00001)


def test_cost_table_incomplete_without_prices():
    table = cost_table({"a": (1, 1)}, {}, None)
    assert table["providers"]["a"]["source"] == "none"
    assert table["overall"] == {"cost_usd": None, "usd_per_1m_output": None, "complete": False}


# ---------------------------------------------------------------- sweep helpers

@pytest.mark.parametrize("text, param, message", [
    ("", "rate", "at least one value"),
    ("1,x", "rate", "comma-separated numbers"),
    ("0,1", "rate", "must be > 0"),
    ("1.5", "users", "whole numbers"),
    ("0", "overflow", "must be > 0"),
    ("1", "temperature", "--over 'temperature'"),
])
def test_parse_values_errors(text, param, message):
    with pytest.raises(BenchInputError, match=message):
        parse_values(text, param)


def test_plan_for():
    base = LoadPlan(users=4, duration=10)
    assert plan_for(base, "rate", 3.0).rate == 3.0 and plan_for(base, "rate", 3.0).users is None
    assert plan_for(base, "users", 16.0).users == 16
    assert plan_for(base, "overflow", 250.0) == base


def test_set_overflow_posts_model_and_threshold():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["url"], seen["auth"], seen["body"] = str(request.url), request.headers["authorization"], request.content
        return httpx.Response(200, json={"ok": True})

    set_overflow("http://gw:8000/", "smollm2", 250.0, "k3y", transport=httpx.MockTransport(handler))
    assert seen["url"] == "http://gw:8000/admin/overflow" and seen["auth"] == "Bearer k3y"
    assert json.loads(seen["body"]) == {"model": "smollm2", "threshold_ms": 250.0}


@pytest.mark.parametrize("status, key, message", [
    (404, "k", "answered 404"),
    (200, None, "LMFLEET_ADMIN_KEY"),
])
def test_set_overflow_errors(status, key, message):
    transport = httpx.MockTransport(lambda r: httpx.Response(status, text="nope"))
    with pytest.raises(BenchInputError, match=message):
        set_overflow("http://gw", "m", 1.0, key, transport=transport)


def test_sweep_row_external_share():
    dist = {"p50": 1.0, "p99": 2.0}
    summary = {"requests": 4, "completed": 4, "error_rate": 0.0, "request_throughput": 1.0, "output_throughput": 9.0,
               "e2el_ms": dist, "ttft_ms": dist, "tpot_ms": dist, "usd_per_1m_output": 0.3}
    report = {"overall": summary, "providers": {"local/a": {"completed": 3}, "provider/x": {"completed": 1}}}
    row = sweep_row("rate", 2.0, report)
    assert row["rate"] == 2.0 and row["external_share"] == 0.25 and row["e2el_p99_ms"] == 2.0


@pytest.mark.parametrize("answers,served,want,fetches", [
    # the ledger already has every backend that answered: one read
    ([{"local/m": {}, "provider/p": {}}], {"local/m", "provider/p"}, {"local/m", "provider/p"}, 1),
    # the last stream's row lands after the client asked: read again until it is there
    ([{"local/m": {}}, {"local/m": {}}, {"local/m": {}, "provider/p": {}}], {"local/m", "provider/p"},
     {"local/m", "provider/p"}, 3),
    # no ledger at all: no waiting
    ([None], {"local/m"}, None, 1),
    # a backend the ledger never shows: what it has once the wait is over
    ([{"local/m": {}}] * 100, {"local/m", "provider/p"}, {"local/m"}, 26),
])
def test_usage_waits_until_the_ledger_shows_every_backend_that_answered(answers, served, want, fetches):
    from lmfleet.bench.cost import usage_covering
    now, calls = [0.0], []

    def fetch():
        calls.append(now[0])
        return answers[min(len(calls), len(answers)) - 1]

    def sleep(s):
        now[0] += s

    got = usage_covering(fetch, served, wait_s=5.0, sleep=sleep, clock=lambda: now[0])
    assert (None if got is None else set(got)) == want and len(calls) == fetches
