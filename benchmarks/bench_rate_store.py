"""Per-admission cost of tenant limits shared through the spend store's database (docs/tenants.md, "Limits across
gateway processes"), SQLite and PostgreSQL, against the real code: ``TenantBook.enter_blocking`` over
``SharedLimits`` over ``SqliteSpendStore`` / ``PostgresSpendStore`` (one transaction: lock the tenant, read its
slots in flight and both windows, decide with ``lmfleet.tenants.admit``, hold a slot and count the request).

    .venv/bin/python benchmarks/bench_rate_store.py [N]   # sqlite and postgres (embedded), 1 process then 2

Runs, per backend:
  * 1 process x N admissions of a tenant with max_concurrency + requests_per_minute (limits never reached), each
    followed by its release written inline (the gateway writes releases on a background thread; timed apart);
  * 2 processes x N admissions, requests_per_minute = N (the window is an hour, so no run crosses a boundary):
    exactly N must be admitted;
  * the spend store's reserve+release, for comparison.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time

from lmfleet.config.tenants import TenantConfig, TenantLimits, default_priority_classes
from lmfleet.store import Cap, PostgresSpendStore, SqliteSpendStore
from lmfleet.tenants import TenantBook, TenantDirectory
from lmfleet.tenants.shared import SharedLimits

WINDOW_S = 3600.0
CLASSES = default_priority_classes()


def _open(backend: str, where: str):
    return SqliteSpendStore(where) if backend == "sqlite" else PostgresSpendStore(where)


def _book(store, name: str, limits: dict) -> tuple[TenantBook, object]:
    cfg = TenantConfig(name=name, api_keys_env="K", limits=TenantLimits(**limits))
    d = TenantDirectory.build([cfg], CLASSES, environ={"K": f"sk-{name}"})
    return TenantBook(d, CLASSES, shared=SharedLimits(store, slot_ttl_s=660), window_s=WINDOW_S), d.resolve(f"sk-{name}")


def _pct(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"p50 {xs[len(xs) // 2] * 1e3:.3f} ms, p99 {xs[int(len(xs) * 0.99)] * 1e3:.3f} ms"


def _worker(backend, where, name, limits, n, release, barrier, out):
    store = _open(backend, where)
    book, tenant = _book(store, name, limits)
    barrier.wait()
    adm, rel, admitted = [], [], 0
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        _, ticket = book.enter_blocking(tenant, CLASSES[0], estimate_ms=0, threshold_ms=1000, provider_ok=False)
        adm.append(time.perf_counter() - t)
        if ticket is not None:
            admitted += 1
            if release:
                t = time.perf_counter()
                store.release_tenant(ticket.slot)
                rel.append(time.perf_counter() - t)
    out.put((admitted, adm, rel, time.perf_counter() - t0))
    store.close()


def run(backend, where, procs, n, limits, release):
    name = f"t{os.getpid()}{time.monotonic_ns() % 10**6}"
    _open(backend, where).close()  # schema first
    barrier, out = mp.Barrier(procs), mp.Queue()
    ps = [mp.Process(target=_worker, args=(backend, where, name, limits, n, release, barrier, out))
          for _ in range(procs)]
    for p in ps:
        p.start()
    res = [out.get() for _ in ps]
    for p in ps:
        p.join()
    admitted = sum(r[0] for r in res)
    wall = max(r[3] for r in res)
    line = (f"{backend:8s} {procs} proc x {n} {limits}: admitted {admitted}; admission {_pct([x for r in res for x in r[1]])};"
            f" {procs * n / wall:.0f} admissions/s")
    if release:
        line += f"; release {_pct([x for r in res for x in r[2]])}"
    print(line, flush=True)


def spend_store(backend, where, n):
    store = _open(backend, where)
    caps = [Cap("tenant:x", 3600, 10**9)]
    lat = []
    for i in range(n):
        t = time.perf_counter()
        store.release(store.reserve(str(i), 1, caps))
        lat.append(time.perf_counter() - t)
    print(f"{backend:8s} spend store reserve+release 1 proc x {n}: {_pct(lat)}", flush=True)
    store.close()


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    tmp = tempfile.mkdtemp()
    targets = [("sqlite", f"{tmp}/ledger.sqlite")]
    server = None
    try:
        from lmfleet.testing.pg_server import PgServer
        server = PgServer.start()
        targets.append(("postgres", server.url))
    except Exception as e:  # noqa: BLE001 -- the bench runs without PostgreSQL too
        print("postgres skipped:", e)
    try:
        for backend, where in targets:
            run(backend, where, 1, n, {"max_concurrency": 10**6, "requests_per_minute": 10**9}, release=True)
            run(backend, where, 2, n, {"requests_per_minute": n}, release=False)
            spend_store(backend, where, n)
    finally:
        if server is not None:
            server.destroy()
    print(f"load average after: {os.getloadavg()}")
