"""Per-request cost of a shared rate window (requests/minute) in the ledger's database, vs the spend store's
reserve+release. Sliding-window record = two fixed-window rows per key; admission = one transaction:
lock the key, read both rows, decide with lmfleet.tenants.RateWindow, upsert the current row.

    .venv/bin/python benchmarks/bench_rate_store.py    # sqlite and postgres (embedded), 1 process then 2 processes
"""
from __future__ import annotations

import multiprocessing as mp
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))
from lmfleet.tenants import RateWindow  # noqa: E402

WINDOW = 3600.0  # a long window so a run never crosses a boundary (the exactly-N check)
DDL = ["CREATE TABLE IF NOT EXISTS rate_keys (key TEXT PRIMARY KEY)",
       "CREATE TABLE IF NOT EXISTS rate_windows (key TEXT NOT NULL, window_start BIGINT NOT NULL, "
       "n DOUBLE PRECISION NOT NULL, PRIMARY KEY (key, window_start))"]


def _decide(rows, limit, now):
    start = (now // WINDOW) * WINDOW
    cur = next((n for ws, n in rows if ws == start), 0.0)
    prev = next((n for ws, n in rows if ws == start - WINDOW), 0.0)
    w = RateWindow(limit, WINDOW, start, cur, prev)
    return w.allows(now), int(start)


def admit_sqlite(db, key, limit):
    now = time.time()
    start = int((now // WINDOW) * WINDOW)
    db.execute("BEGIN IMMEDIATE")
    rows = db.execute("SELECT window_start, n FROM rate_windows WHERE key=? AND window_start IN (?,?)",
                      (key, start, start - int(WINDOW))).fetchall()
    ok, start = _decide(rows, limit, now)
    if ok:
        db.execute("INSERT INTO rate_windows (key, window_start, n) VALUES (?,?,1) ON CONFLICT (key, window_start) "
                   "DO UPDATE SET n = rate_windows.n + 1", (key, start))
    db.execute("COMMIT")
    return ok


def admit_pg(conn, key, limit):
    now = time.time()
    start = int((now // WINDOW) * WINDOW)
    with conn.transaction():
        conn.execute("SELECT key FROM rate_keys WHERE key=%s FOR UPDATE", (key,))
        rows = conn.execute("SELECT window_start, n FROM rate_windows WHERE key=%s AND window_start IN (%s,%s)",
                            (key, start, start - int(WINDOW))).fetchall()
        ok, start = _decide(rows, limit, now)
        if ok:
            conn.execute("INSERT INTO rate_windows (key, window_start, n) VALUES (%s,%s,1) ON CONFLICT "
                         "(key, window_start) DO UPDATE SET n = rate_windows.n + 1", (key, start))
    return ok


def connect(backend, where):
    if backend == "sqlite":
        db = sqlite3.connect(where, isolation_level=None, timeout=10)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        return db, admit_sqlite
    import psycopg
    return psycopg.connect(where, autocommit=True), admit_pg


def setup(backend, where, key):
    db, _ = connect(backend, where)
    for s in DDL:
        db.execute(s)
    db.execute("INSERT INTO rate_keys (key) VALUES (%s) ON CONFLICT DO NOTHING" if backend == "postgres"
               else "INSERT OR IGNORE INTO rate_keys (key) VALUES (?)", (key,))
    db.close()


def worker(backend, where, key, limit, n, barrier, out):
    db, admit = connect(backend, where)
    barrier.wait()
    lat, admitted = [], 0
    for _ in range(n):
        t = time.perf_counter()
        admitted += admit(db, key, limit)
        lat.append(time.perf_counter() - t)
    out.put((admitted, lat))


def run(backend, where, procs, n, limit):
    key = f"tenant:{uuid.uuid4().hex[:8]}:rpm"
    setup(backend, where, key)
    barrier, out = mp.Barrier(procs), mp.Queue()
    ps = [mp.Process(target=worker, args=(backend, where, key, limit, n, barrier, out)) for _ in range(procs)]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    res = [out.get() for _ in ps]
    for p in ps:
        p.join()
    wall = time.perf_counter() - t0
    lat = sorted(x for _, l in res for x in l)
    admitted = sum(a for a, _ in res)
    p50, p99 = lat[len(lat) // 2] * 1e3, lat[int(len(lat) * 0.99)] * 1e3
    print(f"{backend:8s} rate window  {procs} proc x {n}: admitted {admitted} (limit {limit}), "
          f"p50 {p50:.3f} ms, p99 {p99:.3f} ms, {procs * n / wall:.0f} admissions/s")


def spend_store(backend, where, n):
    from lmfleet.overflow.store import Cap, PostgresSpendStore, SqliteSpendStore
    store = SqliteSpendStore(where) if backend == "sqlite" else PostgresSpendStore(where)
    caps = [Cap("tenant:x:inflight", 3600, 10**9)]
    lat = []
    for i in range(n):
        t = time.perf_counter()
        r = store.reserve(str(i), 1, caps)
        store.release(r)
        lat.append(time.perf_counter() - t)
    lat.sort()
    print(f"{backend:8s} spend store reserve+release 1 proc x {n}: p50 {lat[n // 2] * 1e3:.3f} ms, "
          f"p99 {lat[int(n * 0.99)] * 1e3:.3f} ms")
    store.close()


if __name__ == "__main__":
    tmp = tempfile.mkdtemp()
    targets = [("sqlite", f"{tmp}/ledger.sqlite")]
    server = None
    try:
        from tests.support.pg_server import PgServer
        server = PgServer.start()
        targets.append(("postgres", server.url))
    except Exception as e:  # noqa: BLE001
        print("postgres skipped:", e)
    try:
        for backend, where in targets:
            run(backend, where, 1, 3000, 10**9)
            run(backend, where, 2, 2000, 2500)
            spend_store(backend, where if backend == "postgres" else f"{tmp}/spend.sqlite", 2000)
    finally:
        if server is not None:
            server.destroy()
