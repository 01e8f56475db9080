"""Spend store: worst-case cost, cap arithmetic, reserve/settle/release/expiry, exactness under 200 concurrent
reservers (threads and processes), failing closed, and config -- against SQLite and a real PostgreSQL."""

from __future__ import annotations

import multiprocessing
import socket
import sqlite3
import threading
import time

import pytest
import yaml
from pydantic import ValidationError

from lmfleet.config import ConfigError, load_config
from lmfleet.config.models import BudgetConfig, LedgerConfig, ProviderPrice
from lmfleet.store import sqlite as store_sqlite
from lmfleet.store import (
    GLOBAL,
    Cap,
    Ledger,
    PostgresSpendStore,
    Refusal,
    Reservation,
    SpendStore,
    SpendStoreError,
    SqliteSpendStore,
    StoreUnavailable,
    UsageRecord,
    caps_exceeded,
    caps_for_budget,
    open_ledger,
    open_spend_store,
    worst_case_cost_nusd,
)
from lmfleet.testing.pg_server import PgServer, PgUnavailable
from lmfleet.testing.pg_shared import fresh_database, shared_pg_server

# a store test that waits on a lock or a server must fail, not hang the whole run (CI has 90 minutes)
pytestmark = pytest.mark.timeout(180)

HOUR, DAY = 3600.0, 86400.0
T0 = 1_800_000_000.0  # a fixed epoch for fake clocks (a multiple of 60)
ROW = UsageRecord(model="m", served_by="provider/acme", route_reason="overflow", input_tokens=10, output_tokens=5,
                  status="ok")

# --- pure: worst-case cost -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, max_tokens, in_1m, out_1m, max_model_len, expected",
    [
        (1000, 100, 0.15, 0.6, None, 1000 * 150 + 100 * 600),  # exact decimal prices, no float noise
        (1000, None, 0.15, 0.6, 4096, 1000 * 150 + 3096 * 600),  # no max_tokens: the rest of the context
        (1000, 8000, 0.15, 0.6, 4096, 1000 * 150 + 3096 * 600),  # the context caps max_tokens
        (5000, None, 1.0, 2.0, 4096, 5000 * 1000),  # prompt over the context: no output bound left
        (3, 7, 0.0375, 0.0, None, 113),  # 112.5 nusd rounds *up*: the worst case is never under
        (0, 0, 5.0, 15.0, None, 0),
        (1, 1, 0.0, 0.0, None, 0),  # a free provider
    ],
)
def test_worst_case_cost(prompt, max_tokens, in_1m, out_1m, max_model_len, expected):
    price = ProviderPrice(input_per_1m=in_1m, output_per_1m=out_1m)
    assert worst_case_cost_nusd(prompt, max_tokens, price, max_model_len=max_model_len) == expected


@pytest.mark.parametrize("prompt, max_tokens, max_model_len, match", [
    (10, None, None, "unbounded"),
    (-1, 5, None, "negative"),
    (1, -5, None, "negative"),
])
def test_worst_case_cost_refuses(prompt, max_tokens, max_model_len, match):
    with pytest.raises(ValueError, match=match):
        worst_case_cost_nusd(prompt, max_tokens, ProviderPrice(), max_model_len=max_model_len)


# --- pure: caps --------------------------------------------------------------------------------------

H = Cap(GLOBAL, HOUR, 1000)
D = Cap(GLOBAL, DAY, 1500)


@pytest.mark.parametrize(
    "amount, spent, expected",
    [
        (100, {H: 900, D: 900}, []),  # exactly at the cap is allowed
        (101, {H: 900, D: 900}, [H]),
        (100, {H: 0, D: 1450}, [D]),
        (2000, {H: 0, D: 0}, [H, D]),
        (0, {H: 1000, D: 1500}, []),
    ],
)
def test_caps_exceeded(amount, spent, expected):
    assert caps_exceeded(amount, [H, D], spent) == expected


def test_caps_for_budget_and_reasons():
    caps = caps_for_budget(BudgetConfig(hourly_usd=0.01, daily_usd=1.5))
    assert caps == [Cap(GLOBAL, HOUR, 10_000_000), Cap(GLOBAL, DAY, 1_500_000_000)]
    assert [c.reason for c in caps] == ["hourly_budget_exhausted", "daily_budget_exhausted"]
    assert Cap("tenant:acme", DAY, 5).reason == "budget_exhausted:tenant:acme/86400s"
    assert caps_for_budget(BudgetConfig()) == []
    assert not Refusal(H, 0, 1, 1.0)  # falsy, like the None it stands in for


# --- backends ----------------------------------------------------------------------------------------


def _start_pg() -> PgServer:
    pytest.importorskip("psycopg", reason="the PostgreSQL client is missing: pip install -e '.[test]'")
    try:
        return PgServer.start()
    except PgUnavailable as e:
        pytest.skip(f"PostgreSQL server cannot be started here: {e}")


@pytest.fixture(scope="session")
def pg_server():
    pytest.importorskip("psycopg", reason="the PostgreSQL client is missing: pip install -e '.[test]'")
    try:
        return shared_pg_server()  # one server for every module of the session (the ledger tests use it too)
    except PgUnavailable as e:
        pytest.skip(f"PostgreSQL server cannot be started here: {e}")



@pytest.fixture(params=["sqlite", "postgres"])
def target(request, tmp_path):
    """(backend, where): a fresh SQLite file or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return "sqlite", str(tmp_path / "ledger.sqlite")
    return "postgres", fresh_database(request.getfixturevalue("pg_server"))


def _open(target, **kw):
    backend, where = target
    return SqliteSpendStore(where, **kw) if backend == "sqlite" else PostgresSpendStore(where, **kw)


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_reserve_settle_release_expire(target):
    clock = Clock()
    caps = [Cap(GLOBAL, HOUR, 1000), Cap("tenant:a", DAY, 900)]
    with _open(target, ttl_s=300, clock=clock) as store:
        assert isinstance(store, SpendStore)
        a = store.reserve("a", 400, caps)
        b = store.reserve("b", 400, caps)
        assert isinstance(a, Reservation) and isinstance(b, Reservation)
        assert a.keys == ("global", "tenant:a") and a.expires_at == T0 + 300
        refused = store.reserve("c", 400, caps)
        # both caps are over; the one that frees last is reported
        assert isinstance(refused, Refusal) and refused.cap == caps[1] and refused.spent_nusd == 800
        assert store.spent(HOUR).held_nusd == 800

        assert store.settle(a, 150, ROW) is True
        assert store.settle(a, 150, ROW) is False  # idempotent
        assert store.spent(HOUR) == store.spent(DAY, "tenant:a")
        assert (store.spent(HOUR).settled_nusd, store.spent(HOUR).held_nusd) == (150, 400)
        assert store.release(b) is True and store.release(b) is False
        assert (store.spent(HOUR).settled_nusd, store.spent(HOUR).held_nusd) == (150, 0)

        c = store.reserve("c", 850, [caps[0]])  # 150 + 850 = 1000: exactly the cap
        assert isinstance(c, Reservation)
        assert not store.reserve("d", 1, [caps[0]])
        clock.t += 301  # c's gateway died: the hold expires and stops counting
        assert store.spent(HOUR).held_nusd == 0
        d = store.reserve("d", 850, [caps[0]])
        assert isinstance(d, Reservation)
        assert store.settle(c, 0) is True  # a late settle still finds the expired hold
        clock.t += HOUR  # the settled 150 has rolled off (it sits in the bucket ending T0 + 60)
        assert store.spent(HOUR).settled_nusd == 0


def test_retry_after_from_settled_buckets(target):
    clock = Clock()
    cap = Cap(GLOBAL, HOUR, 1000)
    with _open(target, clock=clock) as store:
        store.settle(store.reserve("a", 600, [cap]), 600)  # bucket (T0, T0+60]
        clock.t += 1800
        store.settle(store.reserve("b", 400, [cap]), 400)  # bucket ending T0+1860
        refused = store.reserve("c", 100, [cap])
        assert refused.reason == "hourly_budget_exhausted"
        assert refused.retry_after_s == pytest.approx(60 + HOUR - 1800)  # the first bucket's end + 1 h - now
        clock.t = T0 + 60 + HOUR  # the first bucket has left the window
        assert isinstance(store.reserve("c", 100, [cap]), Reservation)


def test_settle_writes_the_ledger_row(target):
    backend, where = target
    with _open(target, clock=Clock()) as store:
        store.settle(store.reserve("a", 500, [H]), 321, ROW)
        store.record(UsageRecord("m", "local/m", "local_ok", 3, 4, "ok", tenant="acme"), 7)
        store.release(store.reserve("b", 500, [H]), UsageRecord("m", "provider/acme", "overflow", 3, 0, "502"))
    # the ledger reads the same rows (same file or database, same table)
    cfg = LedgerConfig(path=where) if backend == "sqlite" else LedgerConfig(url=where)
    with open_ledger(cfg) as led:
        rows = [(r["served_by"], r["status"], round(r["cost_usd"] * 1e9), r["tenant"]) for r in led.rows()]
        by_tenant = {r.name: r.requests for r in led.summary(by="tenant")}
    assert rows == [("provider/acme", "ok", 321, None), ("local/m", "ok", 7, "acme"), ("provider/acme", "502", 0, None)]
    assert by_tenant == {"default": 2, "acme": 1}


def test_schema_is_migrated_once_and_reopens(target):
    with _open(target) as store:
        store.settle(store.reserve("a", 5, [H]), 5)
    with _open(target) as store:  # a second start (or a second node) sees the same spend
        assert store.spent(HOUR).settled_nusd == 5


# --- exactness under concurrency ------------------------------------------------------------------------

AMOUNT = 1_000_003  # odd on purpose: no rounding can hide an overshoot
CAP_10 = [Cap(GLOBAL, HOUR, 10 * AMOUNT + AMOUNT - 1), Cap(GLOBAL, DAY, 100 * AMOUNT)]  # admits exactly 10


def _reserve_many(target, n_threads: int, start: threading.Barrier | None = None, shared: bool = False,
                  settle: bool = False) -> int:
    """``n_threads`` threads reserve at once (each with its own store, or one shared); how many got in.

    ``settle``: each admitted request is settled at once at its full amount, racing the others' reserves.
    """
    admitted, errors = [], []
    gate = threading.Barrier(n_threads)
    stores = [_open(target, pool_size=8) if target[0] == "postgres" else _open(target)] if shared else []

    def one(i: int) -> None:
        try:  # a thread that cannot open its store must not leave the others waiting at the gate for ever
            store = stores[0] if shared else _open(target)
        except Exception as e:
            errors.append(e)
            gate.abort()
            return
        try:
            gate.wait(timeout=120)
            res = store.reserve(f"r{i}", AMOUNT, CAP_10)
            if isinstance(res, Reservation):
                admitted.append(i)
                if settle:
                    store.settle(res, AMOUNT, ROW)
        except (StoreUnavailable, threading.BrokenBarrierError) as e:
            errors.append(e)
        finally:
            if not shared:
                store.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n_threads)]
    if start is not None:
        start.wait()
    for t in threads:
        t.start()
    deadline = time.monotonic() + 170
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise AssertionError("reserving threads still running after 170 s")
    for s in stores:
        s.close()
    if errors:
        raise AssertionError(f"{len(errors)} reservations failed: {errors[0]!r}")
    return len(admitted)


def _process_main(target, n_threads, start, out) -> None:
    try:
        out.put(_reserve_many(target, n_threads, start, shared=True))
    except BaseException as e:  # reported to the parent, which fails the test
        out.put(repr(e))


def test_200_threads_admit_exactly_10(target):
    assert _reserve_many(target, 200) == 10
    with _open(target) as store:
        assert store.spent(HOUR).held_nusd == 10 * AMOUNT


def test_settles_racing_reserves_admit_exactly_10(target):
    # a reserve that saw neither a hold nor its settled cost would let an 11th through
    assert _reserve_many(target, 200, settle=True) == 10
    with _open(target) as store:
        assert (store.spent(HOUR).settled_nusd, store.spent(HOUR).held_nusd) == (10 * AMOUNT, 0)


def test_4_processes_x_50_threads_admit_exactly_10(target):
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_process_main, args=(target, 50, start, out)) for _ in range(4)]
    for p in procs:
        p.start()
    counts = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(isinstance(c, int) for c in counts), counts
    assert sum(counts) == 10, counts
    with _open(target) as store:
        assert store.spent(HOUR).held_nusd == 10 * AMOUNT


# --- failing closed ---------------------------------------------------------------------------------


def test_sqlite_stores_and_ledgers_opening_one_new_file_at_once_all_open(tmp_path):
    # switching a new file to WAL: SQLite refuses some of several simultaneous openers at once, without the busy
    # timeout ("database is locked"; CI once lost a whole 200-thread test to it); connect_wal retries the switch
    opened, errors = [], []

    def one(path, kind: int, gate: threading.Barrier) -> None:
        try:
            gate.wait(timeout=30)
            store = (SqliteSpendStore(path) if kind else Ledger(path))
            store.close()
            opened.append(kind)
        except Exception as e:  # noqa: BLE001 - any failure to open is the finding
            errors.append(e)

    for round_ in range(60):
        path, gate = tmp_path / f"r{round_}" / "ledger.sqlite", threading.Barrier(16)
        threads = [threading.Thread(target=one, args=(path, i % 2, gate)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, f"{len(errors)} of {60 * 16} opens failed: {errors[0]!r}"
    assert len(opened) == 60 * 16


def test_the_switch_to_wal_is_retried_when_sqlite_refuses_it_at_once(tmp_path, monkeypatch):
    class Refusing:  # a connection whose first WAL switches meet another opener's shared lock
        refusals = 2

        def __init__(self, db: sqlite3.Connection) -> None:
            self.db = db

        def execute(self, sql: str, *args):
            if sql.startswith("PRAGMA journal_mode=") and Refusing.refusals:
                Refusing.refusals -= 1
                raise sqlite3.OperationalError("database is locked")
            return self.db.execute(sql, *args)

        def __getattr__(self, name: str):
            return getattr(self.db, name)

    real = sqlite3.connect
    monkeypatch.setattr(store_sqlite.sqlite3, "connect", lambda *a, **kw: Refusing(real(*a, **kw)))
    db = store_sqlite.connect_wal(tmp_path / "a.sqlite", 5.0)
    assert Refusing.refusals == 0 and db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()
    Refusing.refusals = 10**9  # refused for longer than the timeout: the error is raised, not waited on forever
    t = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        store_sqlite.connect_wal(tmp_path / "b.sqlite", 0.2)
    assert time.monotonic() - t < 2


def test_sqlite_lock_held_too_long_fails_closed(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with SqliteSpendStore(path, busy_timeout_s=0.2) as store:
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another process stuck in a write
        t = time.monotonic()
        with pytest.raises(StoreUnavailable, match="locked"):
            store.reserve("a", 1, [H])
        assert time.monotonic() - t < 2
        blocker.execute("ROLLBACK")
        assert isinstance(store.reserve("a", 1, [H]), Reservation)


def test_sqlite_disk_full_fails_closed_and_loses_nothing(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with SqliteSpendStore(path) as store:
        done = store.reserve("a", 100, [H])
        store.settle(done, 100, ROW)
        held = store.reserve("b", 100, [H])
        # ENOSPC as SQLite sees it: no page may be added to the file through this connection
        pages = store.db._db.execute("PRAGMA page_count").fetchone()[0]
        store.db._db.execute(f"PRAGMA max_page_count={pages}")
        big = UsageRecord("m" * 20000, "provider/acme", "overflow", 1, 1, "ok")
        assert store.settle(held, 90, big) is True  # accepted, deferred: the write failed
        assert store.pending_writes == 1
        with pytest.raises(StoreUnavailable, match="full"):
            store.reserve("c", 1, [H])  # fails closed while a settle is pending
        store.db._db.execute("PRAGMA max_page_count=1073741823")  # space again
        assert isinstance(store.reserve("c", 1, [H]), Reservation)  # the deferred settle lands first
        assert store.pending_writes == 0
        assert store.spent(HOUR).settled_nusd == 190
    with Ledger(path) as led:
        assert [round(r["cost_usd"] * 1e9) for r in led.rows()] == [100, 90]


def test_postgres_down_fails_closed_fast_and_loses_nothing(tmp_path):
    server = _start_pg()
    try:
        store = PostgresSpendStore(server.url, connect_timeout_s=2, statement_timeout_s=2)
        store.settle(store.reserve("a", 100, [H]), 100, ROW)
        held = store.reserve("b", 100, [H])
        server.stop()
        t = time.monotonic()
        with pytest.raises(StoreUnavailable, match="ledger database postgresql://postgres@127.0.0.1"):
            store.reserve("c", 1, [H])
        assert store.settle(held, 90, ROW) is True and store.pending_writes == 1
        with pytest.raises(StoreUnavailable):
            store.reserve("c", 1, [H])
        assert time.monotonic() - t < 10
        server.restart()
        assert isinstance(store.reserve("c", 1, [H]), Reservation)
        assert store.pending_writes == 0 and store.spent(HOUR).settled_nusd == 190
        store.close()
    finally:
        server.destroy()


def test_unreachable_postgres_at_start_is_one_line_and_bounded():
    # a port that accepts TCP but never speaks: the connect timeout must end it
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        cfg = LedgerConfig(url=f"postgresql://lmfleet@127.0.0.1:{port}/lmfleet", connect_timeout_s=2)
        t = time.monotonic()
        with pytest.raises(StoreUnavailable) as err:
            open_spend_store(cfg)
        assert time.monotonic() - t < 8
    assert "\n" not in str(err.value) and f"127.0.0.1:{port}/lmfleet" in str(err.value)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(StoreUnavailable, match="refused|failed"):
        open_spend_store(LedgerConfig(url=f"postgresql://lmfleet@127.0.0.1:{port}/lmfleet"))


def test_password_comes_from_the_named_env_var():
    cfg = LedgerConfig(url="postgresql://lmfleet@127.0.0.1:1/lmfleet", password_env="LMFLEET_DB_PASSWORD")
    with pytest.raises(SpendStoreError, match="LMFLEET_DB_PASSWORD"):
        open_spend_store(cfg, environ={})


# --- config ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, match",
    [
        ("postgresql://lmfleet@db.internal:5432/lmfleet", None),
        ("postgres://lmfleet@10.0.0.5/lmfleet", None),
        ("mysql://lmfleet@db/lmfleet", "scheme 'mysql'"),
        ("postgresql://lmfleet@db:5432/", "database name"),
        ("postgresql:///lmfleet", "host"),
        ("postgresql://lmfleet:hunter2@db/lmfleet", "password_env"),
        ("postgresql://lmfleet@db:99999/lmfleet", "not a URL"),
        ("ledger.sqlite", "scheme ''"),
    ],
)
def test_ledger_url_validation(url, match):
    if match is None:
        assert LedgerConfig(url=url).url == url
        return
    with pytest.raises(ValidationError, match=match) as err:
        LedgerConfig(url=url)
    assert err.value.errors()[0]["loc"] == ("url",)


def test_ledger_url_error_names_the_key(tmp_path):
    fleet = load_config(None).model_dump(mode="json", exclude_none=True)
    fleet["ledger"] = {"url": "mysql://x@db/y"}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    with pytest.raises(ConfigError, match=r"ledger\.url: scheme 'mysql' is not supported"):
        load_config(path)
