"""Ledger: rows, summaries, totals equal to the sum of rows, windows, restart, threads."""

import threading

import pytest

from lmfleet.overflow.ledger import Ledger, served_by_local, served_by_provider

ROWS = [
    # ts, served_by, in, out, cost
    (100.0, "local/smollm2", 10, 20, 0.000013),
    (200.0, "local/smollm2", 30, 40, 0.000027),
    (300.0, "provider/acme", 1000, 500, 0.00045),
    (400.0, "provider/acme", 2000, 0, 0.0003),
    (500.0, "provider/beta", 5, 1_000_000, 0.6),
]


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "sub" / "ledger.sqlite", clock=lambda: 1000.0) as led:
        for ts, sb, i, o, c in ROWS:
            led.record(model="smollm2", served_by=sb, route_reason="local_ok", input_tokens=i, output_tokens=o,
                       status="ok", cost_usd=c, latency_ms=12.5, ttft_ms=3.0, ts=ts)
        yield led


@pytest.mark.parametrize(
    "since, external_only, expected",
    [
        (0, True, 0.00045 + 0.0003 + 0.6),
        (0, False, 0.000013 + 0.000027 + 0.00045 + 0.0003 + 0.6),
        (400, True, 0.6003),
        (501, True, 0.0),
    ],
)
def test_spend_since(ledger, since, external_only, expected):
    assert ledger.spend_since(since, external_only=external_only) == pytest.approx(expected)


@pytest.mark.parametrize(
    "since, until, expected",
    [
        (None, None, {"local/smollm2": (2, 40, 60), "provider/acme": (2, 3000, 500), "provider/beta": (1, 5, 1_000_000)}),
        (150, 450, {"local/smollm2": (1, 30, 40), "provider/acme": (2, 3000, 500)}),
        (600, None, {}),
    ],
)
def test_summary(ledger, since, until, expected):
    rows = ledger.summary(since, until)
    assert {r.served_by: (r.requests, r.input_tokens, r.output_tokens) for r in rows} == expected
    total = ledger.totals(since, until)
    # totals are exact sums of the rows (integer nano-dollars underneath)
    assert total.cost_usd == sum(round(r.cost_usd * 1e9) for r in rows) / 1e9
    assert total.requests == sum(r.requests for r in rows)
    raw = ledger.rows(since, until)
    assert sum(round(r["cost_usd"] * 1e9) for r in raw) == round(total.cost_usd * 1e9)


def test_per_million_output(ledger):
    by = {r.served_by: r for r in ledger.summary()}
    assert by["provider/beta"].usd_per_1m_output == pytest.approx(0.6)
    assert by["provider/acme"].usd_per_1m_output == pytest.approx(0.00075 / 500 * 1e6)
    assert ledger.summary()[0].served_by == "provider/beta"  # most expensive first


def test_spend_events_buckets(ledger):
    ev = ledger.spend_events(since=0, bucket_s=1000)
    assert len(ev) == 1 and ev[0][0] == 500.0 and ev[0][1] == pytest.approx(0.60075)
    assert [ts for ts, _ in ledger.spend_events(since=0, bucket_s=1)] == [300.0, 400.0, 500.0]


def test_survives_reopen(tmp_path):
    path = tmp_path / "l.sqlite"
    with Ledger(path) as a:
        a.record(model="m", served_by="local/m", route_reason="local_ok", input_tokens=1, output_tokens=2,
                 status="ok", cost_usd=0.5)
    with Ledger(path) as b:
        assert b.totals().requests == 1 and b.totals().cost_usd == 0.5
        assert b.rows()[0]["ts"] > 1.6e9  # wall-clock epoch by default
        (mode,) = b._db.execute("PRAGMA journal_mode").fetchone()
        assert mode == "wal"


def test_empty_totals(tmp_path):
    with Ledger(tmp_path / "e.sqlite") as led:
        t = led.totals()
        assert (t.requests, t.input_tokens, t.output_tokens, t.cost_usd, t.usd_per_1m_output) == (0, 0, 0, 0.0, None)


def test_rejects_negative(tmp_path):
    with Ledger(tmp_path / "n.sqlite") as led, pytest.raises(ValueError):
        led.record(model="m", served_by="local/m", route_reason="x", input_tokens=-1, output_tokens=0, status="ok",
                   cost_usd=0)


def test_threads_write_concurrently(tmp_path):
    with Ledger(tmp_path / "t.sqlite") as led:
        def work():
            for _ in range(200):
                led.record(model="m", served_by=served_by_provider("p"), route_reason="x", input_tokens=1,
                           output_tokens=1, status="ok", cost_usd=0.001)
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert led.totals().requests == 800
        assert led.totals().cost_usd == 0.8


def test_labels():
    assert (served_by_local("smollm2"), served_by_provider("acme")) == ("local/smollm2", "provider/acme")
