"""Ledgers written by an earlier release (lmfleet 7963f4a) upgrade in place: ``lmfleet usage`` reads their rows, the
schema reaches the current version, and new rows, reservations and tenant state are written beside the old ones.

The fixtures under ``data/ledgers`` are SQL dumps of databases that 7963f4a's own code wrote (with a fixed clock):

    ledger-7963f4a-v4.sqlite.sql          store and ledger together (schema version 4: every table, rows in each)
    ledger-7963f4a-v1.sqlite.sql          the first schema version (no ``tenant`` column, no tenant tables)
    ledger-7963f4a-ledger-only.sqlite.sql a file only the ledger opened (no ``lmfleet_schema``)
    ledger-7963f4a.postgres.sql           store and ledger together in PostgreSQL (``pg_dump --inserts``)
    ledger-ba42f8c-v6.sqlite.sql          schema version 6 (``usage_source``, ``upstream_model``; no estimate columns)
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmfleet.cli.main import app
from lmfleet.store import (
    GLOBAL,
    MIGRATIONS,
    TABLES,
    Cap,
    Ledger,
    PostgresLedger,
    PostgresSpendStore,
    Reservation,
    SqliteSpendStore,
    SqlLedger,
    SqlSpendStore,
    UsageRecord,
)
from lmfleet.store.schema import BUDGET_KEYS, REQUESTS, TYPES, CreateTables, create_table_sql
from lmfleet.testing.pg_server import PgUnavailable
from lmfleet.testing.pg_shared import fresh_database, shared_pg_server

pytestmark = pytest.mark.timeout(120)

DATA = Path(__file__).parent / "data" / "ledgers"
T0 = 1_764_000_000.0  # the clock the fixtures were written with
HOUR = 3600.0
NEW = UsageRecord("smollm2", "provider/acme", "overflow", 100, 10, "ok", 500.0, 100.0, "gamma")

# per fixture: (served_by -> requests) that lmfleet usage reports for the old rows, total nano-dollars
OLD_ROWS = {
    "v4": ({"provider/acme": 1, "local/smollm2": 2, "provider/beta": 1}, 433_000),
    "v1": ({"provider/acme": 1, "local/smollm2": 1}, 90_000),
    "ledger-only": ({"provider/acme": 1}, 20_000),
    "v6": ({"provider/acme": 1, "local/smollm2": 2}, 433_000),
}
FIXTURE = {name: f"ledger-7963f4a-{name}.sqlite.sql" for name in OLD_ROWS} | {"v6": "ledger-ba42f8c-v6.sqlite.sql"}
V4_TENANT_ROWS = {"acme": 1, "beta": 1, "default": 2}


@pytest.fixture(scope="session")
def pg_server():
    pytest.importorskip("psycopg", reason="the PostgreSQL client is missing: pip install -e '.[test]'")
    try:
        return shared_pg_server()
    except PgUnavailable as e:
        pytest.skip(f"PostgreSQL server cannot be started here: {e}")


def _usage(ledger_args: list[str], *extra: str) -> dict:
    res = CliRunner().invoke(app, ["usage", *ledger_args, "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _fleet_file(tmp_path: Path, url: str) -> str:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"models:\n  - name: tiny\n    source: builtin:tiny-random\nledger:\n  url: {url}\n")
    return str(fleet)


def _check_old_rows(out: dict, name: str) -> None:
    by_backend, nusd = OLD_ROWS[name]
    assert {r["served_by"]: r["requests"] for r in out["rows"]} == by_backend
    assert out["total"]["requests"] == sum(by_backend.values())
    assert round(out["total"]["cost_usd"] * 1e9) == nusd


def _write_new_rows(store: SqlSpendStore, led: SqlLedger, name: str) -> None:
    res = store.reserve("new-1", 200_000, [Cap(GLOBAL, HOUR, 10**12)])
    assert isinstance(res, Reservation)
    assert store.settle(res, 150_000, NEW)
    led.record(model="smollm2", served_by="local/smollm2", route_reason="local_ok", input_tokens=1, output_tokens=2,
               status="ok", cost_usd=0.0, tenant="gamma", ttft_ms=900.0, predicted_wait_ms=600.0,
               realised_wait_ms=900.0)
    taken, slot = store.admit_tenant("gamma", lambda c: (True, c.in_flight), now=T0 + 10, window_s=60.0,
                                     slot_ttl_s=600.0, count_request=True)
    assert slot is not None
    override = store.put_tenant_override("gamma", "{}")
    if name == "v4":
        # the old rows are live state, not only history: the held reservation counts, the old slot and window
        # count, and the override versions continue from the old ones
        assert store.spent(HOUR).held_nusd == 300_000
        assert store.tenant_counts("acme", now=T0 + 10, window_s=60.0).requests[0] == 1
        assert store.tenant_counts("acme", now=T0 + 10, window_s=60.0).in_flight == 1
        assert override.version == 2
        assert [r.name for r in store.tenant_overrides()] == ["acme", "gamma"]
    else:
        assert taken == 0 and override.version == 1


def _check_after(out: dict, name: str) -> None:
    by_backend, nusd = OLD_ROWS[name]
    assert out["total"]["requests"] == sum(by_backend.values()) + 2
    assert round(out["total"]["cost_usd"] * 1e9) == nusd + 150_000


@pytest.mark.parametrize("name", sorted(OLD_ROWS))
def test_an_old_sqlite_ledger_upgrades_in_place(tmp_path, name):
    path = tmp_path / "ledger.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript((DATA / FIXTURE[name]).read_text())

    # lmfleet usage first, as a user upgrading would run it: it opens (and upgrades) the file and reads the old rows
    _check_old_rows(_usage(["--ledger", str(path)], "--since", "2025-01-01"), name)
    if name == "v4":
        tenants = _usage(["--ledger", str(path)], "--since", "2025-01-01", "--by", "tenant")
        assert {r["tenant"]: r["requests"] for r in tenants["rows"]} == V4_TENANT_ROWS

    with SqliteSpendStore(path, clock=lambda: T0 + 10) as store, Ledger(path, clock=lambda: T0 + 11) as led:
        _write_new_rows(store, led, name)
    _check_after(_usage(["--ledger", str(path)], "--since", "2025-01-01"), name)
    # the old rows have no estimate; the new local row has one
    (est,) = _usage(["--ledger", str(path)], "--since", "2025-01-01", "--estimate")["models"]
    assert (est["model"], est["requests"], est["p90_abs_error_ms"]) == ("smollm2", 1, 300.0)

    with sqlite3.connect(path) as db:
        assert db.execute("SELECT MAX(version) FROM lmfleet_schema").fetchone() == (MIGRATIONS[-1][0],)
        for table in (t for t in TABLES if "sqlite" in t.dialects):
            have = [r[1] for r in db.execute(f"PRAGMA table_info({table.name})")]
            assert sorted(have) == sorted(c.name for c in table.columns), table.name


def test_an_old_postgres_ledger_upgrades_in_place(tmp_path, pg_server):
    import psycopg  # the optional client: skipped above when missing

    url = fresh_database(pg_server)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute((DATA / "ledger-7963f4a.postgres.sql").read_text())
    fleet = _fleet_file(tmp_path, url)
    _check_old_rows(_usage(["-c", fleet], "--since", "2025-01-01"), "v4")
    tenants = _usage(["-c", fleet], "--since", "2025-01-01", "--by", "tenant")
    assert {r["tenant"]: r["requests"] for r in tenants["rows"]} == V4_TENANT_ROWS

    with PostgresSpendStore(url, clock=lambda: T0 + 10) as store, PostgresLedger(url, clock=lambda: T0 + 11) as led:
        _write_new_rows(store, led, "v4")
    _check_after(_usage(["-c", fleet], "--since", "2025-01-01"), "v4")
    (est,) = _usage(["-c", fleet], "--since", "2025-01-01", "--estimate")["models"]
    assert (est["model"], est["requests"], est["bias_ms"]) == ("smollm2", 1, 300.0)

    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT MAX(version) FROM lmfleet_schema").fetchone() == (MIGRATIONS[-1][0],)
        for table in TABLES:
            have = [r[0] for r in conn.execute("SELECT column_name FROM information_schema.columns"
                                               " WHERE table_schema = 'public' AND table_name = %s", (table.name,))]
            assert sorted(have) == sorted(c.name for c in table.columns), table.name


# --- the declarations --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect, first", [
    ("sqlite", "CREATE TABLE IF NOT EXISTS requests (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL,"),
    ("postgresql", "CREATE TABLE IF NOT EXISTS requests (id BIGSERIAL PRIMARY KEY, ts DOUBLE PRECISION NOT NULL,"),
])
def test_one_declaration_makes_both_dialects(dialect, first):
    table, index = create_table_sql(REQUESTS, dialect)
    assert table.startswith(first) and table.endswith(
        "cost_nusd " + TYPES[dialect]["int"] + " NOT NULL, tenant TEXT, usage_source TEXT, upstream_model TEXT,"
        f" predicted_wait_ms {TYPES[dialect]['real']}, realised_wait_ms {TYPES[dialect]['real']}, admission TEXT)")
    assert index == "CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts)"


def test_budget_keys_are_postgresql_only_and_every_table_has_a_migration():
    assert create_table_sql(BUDGET_KEYS, "sqlite") == []
    created = {t.name for _, step in MIGRATIONS if isinstance(step, CreateTables) for t in step.tables}
    assert created == {t.name for t in TABLES}
    assert [v for v, _ in MIGRATIONS] == list(range(1, len(MIGRATIONS) + 1))
