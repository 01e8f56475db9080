"""Ledger: rows, summaries (by backend and by tenant), totals equal to the sum of rows, windows, restart,
threads -- the same tests against the SQLite file and a real PostgreSQL (one server for the session)."""

import threading

import pytest

from lmfleet.config.models import LedgerConfig
from lmfleet.provenance import provider_label
from lmfleet.store import (
    DEFAULT_TENANT,
    Ledger,
    PostgresLedger,
    open_ledger,
)
from lmfleet.testing.pg_shared import fresh_database

pytestmark = pytest.mark.timeout(120)

ROWS = [
    # ts, served_by, in, out, cost, tenant
    (100.0, "local/smollm2", 10, 20, 0.000013, "acme"),
    (200.0, "local/smollm2", 30, 40, 0.000027, None),
    (300.0, "provider/acme", 1000, 500, 0.00045, "acme"),
    (400.0, "provider/acme", 2000, 0, 0.0003, "beta"),
    (500.0, "provider/beta", 5, 1_000_000, 0.6, None),
]


@pytest.fixture(params=["sqlite", "postgres"])
def cfg(request, tmp_path) -> LedgerConfig:
    """A fresh ledger's config: a SQLite file (in a folder that does not exist yet) or a new PostgreSQL database."""
    if request.param == "sqlite":
        return LedgerConfig(path=str(tmp_path / "sub" / "ledger.sqlite"))
    return LedgerConfig(url=fresh_database(request.getfixturevalue("pg_server")), connect_timeout_s=5)


@pytest.fixture
def ledger(cfg):
    with open_ledger(cfg, clock=lambda: 1000.0) as led:
        for ts, sb, i, o, c, tenant in ROWS:
            led.record(model="smollm2", served_by=sb, route_reason="local_ok", input_tokens=i, output_tokens=o,
                       status="ok", cost_usd=c, latency_ms=12.5, ttft_ms=3.0, ts=ts, tenant=tenant)
        yield led


def test_open_ledger_picks_the_backend(cfg):
    with open_ledger(cfg) as led:
        assert isinstance(led, Ledger if cfg.url is None else PostgresLedger)


@pytest.mark.parametrize(
    "since, expected",
    [
        (0, 0.00045 + 0.0003 + 0.6),
        (399, 0.6003),
        (500, 0.0),
    ],
)
def test_spend_events_count_external_spend_after_since(ledger, since, expected):
    assert sum(usd for _, usd in ledger.spend_events(since)) == pytest.approx(expected)


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
    assert all(type(v) is int for r in rows for v in (r.requests, r.input_tokens, r.output_tokens))  # no Decimal


@pytest.mark.parametrize(
    "since, until, expected",
    [
        # rows without a tenant are the default tenant's; cost in nano-dollars
        (None, None, {"acme": (2, 463_000), DEFAULT_TENANT: (2, 600_027_000), "beta": (1, 300_000)}),
        (150, 450, {"acme": (1, 450_000), DEFAULT_TENANT: (1, 27_000), "beta": (1, 300_000)}),
        (600, None, {}),
    ],
)
def test_summary_by_tenant(ledger, since, until, expected):
    rows = ledger.summary(since, until, by="tenant")
    assert {r.name: (r.requests, round(r.cost_usd * 1e9)) for r in rows} == expected
    assert [r.cost_usd for r in rows] == sorted((r.cost_usd for r in rows), reverse=True)  # most expensive first
    total = ledger.totals(since, until, by="tenant")
    assert round(total.cost_usd * 1e9) == sum(round(r.cost_usd * 1e9) for r in rows)
    assert total.as_dict()["tenant"] == "total"
    if rows:
        assert set(rows[0].as_dict()) == {"tenant", "requests", "input_tokens", "output_tokens", "cost_usd",
                                          "usd_per_1m_output"}


def test_summary_rows_keep_their_json_shape(ledger):
    row = ledger.summary()[0].as_dict()
    assert row == {"served_by": "provider/beta", "requests": 1, "input_tokens": 5, "output_tokens": 1_000_000,
                   "cost_usd": 0.6, "usd_per_1m_output": pytest.approx(0.6)}


def test_summary_refuses_an_unknown_grouping(ledger):
    with pytest.raises(ValueError, match="by='model'"):
        ledger.summary(by="model")


def test_rows_carry_the_tenant(ledger):
    assert [r["tenant"] for r in ledger.rows()] == [t for *_, t in ROWS]
    assert [r["id"] for r in ledger.rows()] == sorted(r["id"] for r in ledger.rows())


def test_per_million_output(ledger):
    by = {r.served_by: r for r in ledger.summary()}
    assert by["provider/beta"].usd_per_1m_output == pytest.approx(0.6)
    assert by["provider/acme"].usd_per_1m_output == pytest.approx(0.00075 / 500 * 1e6)
    assert ledger.summary()[0].served_by == "provider/beta"  # most expensive first


def test_spend_events_buckets(ledger):
    ev = ledger.spend_events(since=0, bucket_s=1000)
    assert len(ev) == 1 and ev[0][0] == 500.0 and ev[0][1] == pytest.approx(0.60075)
    assert [ts for ts, _ in ledger.spend_events(since=0, bucket_s=1)] == [300.0, 400.0, 500.0]
    assert ledger.spend_events(since=350, bucket_s=1000) == [(500.0, pytest.approx(0.6003))]


def test_record_returns_the_row_id(cfg):
    with open_ledger(cfg) as led:
        ids = [led.record(model="m", served_by="local/m", route_reason="x", input_tokens=1, output_tokens=1,
                          status=200, cost_usd=0) for _ in range(3)]
        assert ids == sorted(ids) and len(set(ids)) == 3
        assert [r["id"] for r in led.rows()] == ids
        assert led.rows()[0]["status"] == "200"


def test_survives_reopen(cfg):
    with open_ledger(cfg) as a:
        a.record(model="m", served_by="local/m", route_reason="local_ok", input_tokens=1, output_tokens=2,
                 status="ok", cost_usd=0.5, tenant="acme")
    with open_ledger(cfg) as b:
        assert b.totals().requests == 1 and b.totals().cost_usd == 0.5
        assert b.rows()[0]["ts"] > 1.6e9  # wall-clock epoch by default
        assert b.rows()[0]["tenant"] == "acme"


def test_sqlite_ledger_uses_wal(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as led:
        (mode,) = led.db.statement("PRAGMA journal_mode", (), lambda cur: cur.fetchone())
        assert mode == "wal"


def test_empty_totals(cfg):
    with open_ledger(cfg) as led:
        t = led.totals()
        assert (t.requests, t.input_tokens, t.output_tokens, t.cost_usd, t.usd_per_1m_output) == (0, 0, 0, 0.0, None)
        assert led.spend_events(0) == [] and led.summary(by="tenant") == []


def test_rejects_negative(cfg):
    with open_ledger(cfg) as led, pytest.raises(ValueError):
        led.record(model="m", served_by="local/m", route_reason="x", input_tokens=-1, output_tokens=0, status="ok",
                   cost_usd=0)


def test_threads_write_concurrently(cfg):
    with open_ledger(cfg) as led:
        def work():
            for _ in range(100):
                led.record(model="m", served_by=provider_label("p"), route_reason="x", input_tokens=1,
                           output_tokens=1, status="ok", cost_usd=0.001)
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert led.totals().requests == 400
        assert led.totals().cost_usd == 0.4
