"""Opening the ledger: schema migration (the tenant column) of old SQLite files and PostgreSQL databases,
an unreachable or misconfigured PostgreSQL (fast, one line), the gateway's start-up checks, reconnecting,
and /admin/usage of a gateway whose ledger is PostgreSQL."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import time

import httpx
import pytest

from lmfleet.config.models import FleetConfig, LedgerConfig
from lmfleet.gateway.front.access import GatewayConfigError
from lmfleet.gateway.build import check_ledger, preflight
from lmfleet.store import (
    MIGRATIONS,
    Ledger,
    PostgresLedger,
    PostgresSpendStore,
    SpendStoreError,
    SqliteSpendStore,
    StoreUnavailable,
    UsageRecord,
    open_ledger,
)
from lmfleet.testing.pg_server import PgUnavailable
from lmfleet.testing.pg_shared import fresh_database

pytestmark = pytest.mark.timeout(120)

# the requests table as lmfleet wrote it before tenants (ledger and store alike)
OLD_REQUESTS = """
CREATE TABLE requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, model TEXT NOT NULL, served_by TEXT NOT NULL,
    route_reason TEXT NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, latency_ms REAL,
    ttft_ms REAL, status TEXT NOT NULL, cost_nusd INTEGER NOT NULL);
CREATE INDEX requests_ts ON requests (ts);
INSERT INTO requests (ts, model, served_by, route_reason, input_tokens, output_tokens, status, cost_nusd)
    VALUES (100.0, 'm', 'provider/acme', 'overflow', 1, 2, 'ok', 5000);
"""
# what the spend store's first schema version added beside it
OLD_STORE = """
CREATE TABLE lmfleet_schema (version INTEGER NOT NULL);
INSERT INTO lmfleet_schema (version) VALUES (1);
CREATE TABLE reservations (id TEXT NOT NULL, key TEXT NOT NULL, request_id TEXT NOT NULL,
    amount_nusd INTEGER NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL, PRIMARY KEY (id, key));
CREATE TABLE spend_buckets (key TEXT NOT NULL, bucket_end INTEGER NOT NULL, nusd INTEGER NOT NULL,
    PRIMARY KEY (key, bucket_end));
"""
# the same in PostgreSQL, with the first schema version's other tables
OLD_REQUESTS_PG = """
CREATE TABLE requests (
    id BIGSERIAL PRIMARY KEY, ts DOUBLE PRECISION NOT NULL, model TEXT NOT NULL, served_by TEXT NOT NULL,
    route_reason TEXT NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,
    latency_ms DOUBLE PRECISION, ttft_ms DOUBLE PRECISION, status TEXT NOT NULL, cost_nusd BIGINT NOT NULL);
CREATE INDEX requests_ts ON requests (ts);
CREATE TABLE budget_keys (key TEXT PRIMARY KEY);
CREATE TABLE reservations (id TEXT NOT NULL, key TEXT NOT NULL, request_id TEXT NOT NULL, amount_nusd BIGINT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (id, key));
CREATE TABLE spend_buckets (key TEXT NOT NULL, bucket_end BIGINT NOT NULL, nusd BIGINT NOT NULL,
    PRIMARY KEY (key, bucket_end));
"""
ROW = UsageRecord("m", "local/m", "local_ok", 3, 4, "ok", tenant="acme", usage_source="estimated",
                  upstream_model="m-2026")


def _columns(path) -> list[str]:
    with sqlite3.connect(path) as db:
        return [r[1] for r in db.execute("PRAGMA table_info(requests)")]


def _old_file(path, *, store: bool) -> None:
    with sqlite3.connect(path) as db:
        db.executescript(OLD_REQUESTS + (OLD_STORE if store else ""))


# --- migration -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("store_first", [False, True], ids=["ledger-first", "store-first"])
@pytest.mark.parametrize("old_store", [False, True], ids=["ledger-only-file", "ledger-and-store-file"])
def test_old_sqlite_file_gains_the_tenant_column(tmp_path, store_first, old_store):
    path = tmp_path / "ledger.sqlite"
    _old_file(path, store=old_store)
    assert "tenant" not in _columns(path)
    openers = [lambda: Ledger(path), lambda: SqliteSpendStore(path)]
    for open_ in reversed(openers) if store_first else openers:  # the gateway opens both; either may come first
        open_().close()
    assert _columns(path)[-6:] == ["tenant", "usage_source", "upstream_model", "predicted_wait_ms", "realised_wait_ms",
                                   "admission"]
    with SqliteSpendStore(path) as store:
        store.record(ROW, 7)
    with Ledger(path) as led:
        assert [(r["served_by"], r["tenant"], round(r["cost_usd"] * 1e9)) for r in led.rows()] == [
            ("provider/acme", None, 5000), ("local/m", "acme", 7)]
        assert {r.name: r.requests for r in led.summary(by="tenant")} == {"default": 1, "acme": 1}
        # rows from before the columns say nothing; new ones say where their counts came from
        assert [(r["usage_source"], r["upstream_model"]) for r in led.rows()] == [(None, None),
                                                                                  ("estimated", "m-2026")]
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT MAX(version) FROM lmfleet_schema").fetchone() == (MIGRATIONS[-1][0],)


def test_old_postgres_database_gains_the_tenant_column(pg_server):
    import psycopg

    url = fresh_database(pg_server)
    with psycopg.connect(url, autocommit=True) as conn:  # a database the first schema version made
        conn.execute("CREATE TABLE lmfleet_schema (version INTEGER NOT NULL)")
        conn.execute(OLD_REQUESTS_PG)
        conn.execute("INSERT INTO lmfleet_schema (version) VALUES (1)")
        conn.execute("INSERT INTO requests (ts, model, served_by, route_reason, input_tokens, output_tokens, status,"
                     " cost_nusd) VALUES (100, 'm', 'provider/acme', 'overflow', 1, 2, 'ok', 5000)")
    with PostgresLedger(url) as led, PostgresSpendStore(url) as store:
        store.record(ROW, 7)
        assert [(r["served_by"], r["tenant"], round(r["cost_usd"] * 1e9)) for r in led.rows()] == [
            ("provider/acme", None, 5000), ("local/m", "acme", 7)]
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT MAX(version) FROM lmfleet_schema").fetchone() == (MIGRATIONS[-1][0],)


# --- reaching PostgreSQL ---------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_postgres_fails_fast_in_one_line():
    port = _closed_port()
    t = time.monotonic()
    with pytest.raises(StoreUnavailable) as err:
        open_ledger(LedgerConfig(url=f"postgresql://lmfleet@127.0.0.1:{port}/lmfleet", connect_timeout_s=2))
    assert time.monotonic() - t < 5
    assert "\n" not in str(err.value) and f"127.0.0.1:{port}/lmfleet" in str(err.value)


def test_silent_postgres_is_bounded_by_the_connect_timeout():
    with socket.socket() as silent:  # accepts TCP, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        t = time.monotonic()
        with pytest.raises(StoreUnavailable):
            open_ledger(LedgerConfig(url=f"postgresql://lmfleet@127.0.0.1:{silent.getsockname()[1]}/x",
                                     connect_timeout_s=2))
        assert time.monotonic() - t < 8


def test_password_comes_from_the_named_env_var():
    cfg = LedgerConfig(url=f"postgresql://lmfleet@127.0.0.1:{_closed_port()}/x", password_env="LMFLEET_DB_PASSWORD")
    with pytest.raises(SpendStoreError, match="LMFLEET_DB_PASSWORD"):
        open_ledger(cfg, environ={})


def _drop_connections(url: str) -> int:
    """What a server restart does to a pool: every lmfleet connection to the database is closed by the server."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as admin:
        return len(admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                 " WHERE datname = current_database() AND application_name = 'lmfleet'").fetchall())


def test_a_dropped_connection_is_replaced(pg_server):
    url = fresh_database(pg_server)
    record = dict(model="m", served_by="local/m", route_reason="x", input_tokens=1, output_tokens=1, status="ok",
                  cost_usd=0.1)
    with open_ledger(LedgerConfig(url=url)) as led:
        led.record(**record)
        assert _drop_connections(url) == 1
        assert led.totals().requests == 1  # a read: retried on a new connection, no error
        assert _drop_connections(url) == 1
        with pytest.raises(StoreUnavailable, match="terminat"):  # a write: not retried here (it may have landed)
            led.record(**record)
        led.record(**record)  # the caller's retry gets a new connection
        assert led.totals().requests == 2


# --- the gateway's start-up checks ------------------------------------------------------------------------


def _fleet(ledger: dict, budget: dict | None = None) -> FleetConfig:
    return FleetConfig.model_validate({"models": [{"name": "tiny", "source": "builtin:tiny-random"}],
                                       "ledger": ledger, "budget": budget or {}})


def test_preflight_accepts_a_postgres_ledger():
    preflight(_fleet({"url": "postgresql://lmfleet@db.internal:5432/lmfleet"}), environ={})


@pytest.mark.parametrize("budget", [None, {"hourly_usd": 1.0}], ids=["no-caps", "caps"])
def test_check_ledger_opens_postgres(pg_server, budget):
    import psycopg

    url = fresh_database(pg_server)
    check_ledger(_fleet({"url": url}, budget), environ={})
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT count(*) FROM requests").fetchone() == (0,)


def test_check_ledger_unreachable_postgres_is_one_line_within_seconds():
    port = _closed_port()
    t = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}"):
        check_ledger(_fleet({"url": f"postgresql://lmfleet@127.0.0.1:{port}/lmfleet", "connect_timeout_s": 2}),
                     environ={})
    assert time.monotonic() - t < 5


def test_check_ledger_names_a_missing_password_variable():
    fleet = _fleet({"url": "postgresql://lmfleet@127.0.0.1:1/lmfleet", "password_env": "LMFLEET_DB_PASSWORD"})
    with pytest.raises(GatewayConfigError, match="ledger: ledger.password_env names LMFLEET_DB_PASSWORD"):
        check_ledger(fleet, environ={})


def test_check_ledger_sqlite_that_cannot_be_opened(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreUnavailable, match="ledger database"):
        check_ledger(_fleet({"path": str(tmp_path / "file" / "ledger.sqlite")}), environ={})


# --- /admin/usage on a PostgreSQL ledger -------------------------------------------------------------------


async def test_admin_usage_reads_the_postgres_ledger_by_backend_and_tenant(tmp_path, pg_server):
    import json

    from lmfleet.testing.gateway_fakes import chat_json, make_gateway

    url = fresh_database(pg_server)
    app = make_gateway(tmp_path, lambda r: httpx.Response(200, json=chat_json(json.loads(r.content)["model"])),
                       extra={"ledger": {"url": url}})
    gw = app.state.gateway
    gw.start()
    try:
        c = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
        admin = {"authorization": "Bearer adm"}
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for _ in range(2):
            assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
        assert isinstance(gw.recorder.ledger, PostgresLedger)
        # another node's rows, tagged with tenants, in the same database
        with open_ledger(LedgerConfig(url=url)) as other:
            for tenant, cost in [("acme", 0.25), ("acme", 0.5), ("beta", 0.125)]:
                other.record(model="m", served_by="provider/p", route_reason="overflow", input_tokens=1,
                             output_tokens=2, status="ok", cost_usd=cost, tenant=tenant)

        usage = (await c.get("/admin/usage", headers=admin)).json()
        assert usage["by"] == "served_by"
        assert {r["served_by"]: r["requests"] for r in usage["rows"]} == {"provider/p": 3, "local/m": 2}

        usage = (await c.get("/admin/usage", params={"by": "tenant"}, headers=admin)).json()
        assert [(r["tenant"], r["requests"], r["cost_usd"]) for r in usage["rows"]][:2] == [
            ("acme", 2, 0.75), ("beta", 1, 0.125)]
        assert {r["tenant"]: r["requests"] for r in usage["rows"]}["default"] == 2  # untagged rows
        assert usage["total"] == {**usage["total"], "tenant": "total", "requests": 5}

        r = await c.get("/admin/usage", params={"by": "model"}, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == "by"
        assert (await c.get("/admin/usage", params={"by": "tenant"})).status_code in (401, 403)
    finally:
        await gw.close()


async def test_local_traffic_goes_on_while_the_postgres_ledger_is_down(tmp_path):
    import json

    from lmfleet.testing.pg_server import PgServer
    from lmfleet.testing.gateway_fakes import chat_json, make_gateway

    def ok(r: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=chat_json(json.loads(r.content)["model"]))

    try:
        server = PgServer.start()  # its own: this test stops it
    except PgUnavailable as e:
        pytest.skip(f"PostgreSQL server cannot be started here: {e}")
    try:
        app = make_gateway(tmp_path, ok, {"p": ok}, extra={"ledger": {"url": fresh_database(server),
                                                                      "connect_timeout_s": 2},
                                                           "budget": {"hourly_usd": 10.0}})
        gw = app.state.gateway
        gw.start()
        gw.recorder.close_deadline_s = 1.0
        c = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        try:
            assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
            server.stop()
            await asyncio.sleep(1.1)  # past the router's budget cache
            r = await c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/m"
        finally:
            await gw.close()
    finally:
        server.destroy()
