"""What one ``GET /admin/dashboard.json`` costs the gateway's event loop, on the fake gateway of the unit tests.

Figures, medians of ``--calls`` calls each (milliseconds):

    http       the whole request in process (httpx.ASGITransport: auth middleware, route, JSON encoding),
               right after traffic, with the history the route has built by then (a few readings)
    read       read_gateway(): the tracker snapshot, the metrics' samples, breakers (one model)
    full       what the route does after reading, with a full history (600 readings: 20 minutes of a page
               polling every 2 s) for 1 and for ``--models`` models (readings synthesised from a real one):
               keep the reading, the window base, every plot point, build_dashboard(), json.dumps -- the page's
               first call
    poll       the same with ``since`` = the last kept reading: the page's every later call

    .venv/bin/python benchmarks/bench_dashboard.py

The page polls every 2 s per open tab, so the cost per second is the figure / 2000 of one core per viewer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

from lmfleet.gateway.admin.dashboard import HISTORY, Counters, DashboardHistory, build_dashboard, read_gateway
from lmfleet.gateway.admin.recent_errors import recent_errors
from lmfleet.testing.gateway_fakes import chat_json, make_gateway


def _ok(req: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=chat_json("m"))


def _median_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


async def main(calls: int, models: int) -> None:
    app = make_gateway(Path(tempfile.mkdtemp()), _ok, {"p": _ok})
    gw = app.state.gateway
    gw.start()
    admin = {"authorization": "Bearer adm"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        for _ in range(50):
            await c.post("/v1/chat/completions", json=chat)
        http = []
        for _ in range(calls):
            t0 = time.perf_counter()
            r = await c.get("/admin/dashboard.json", headers=admin)
            http.append((time.perf_counter() - t0) * 1000)
            assert r.status_code == 200
        http_bytes = len(r.content)
    budget = await gw.router.budget_status()
    read = _median_ms(lambda: read_gateway(gw, budget), calls)
    one = read_gateway(gw, budget)
    errors = recent_errors().entries()
    rows = []
    for n in (1, models):
        def at(k: int):
            return replace(one, t=one.t + 2 * k, models={
                f"m{i}": replace(one.models["m"], name=f"m{i}", in_flight_local=k % 5, counters=Counters(
                    local=10 * k, external=k, output_tokens=300 * k, ttft=one.models["m"].counters.ttft))
                for i in range(n)})
        h = DashboardHistory(min_interval_s=0)
        for k in range(HISTORY):
            h.add(at(k))
        now = at(HISTORY)

        def route(since):
            h.add(now)
            return json.dumps(build_dashboard(now, h.base(now), h.series(since), errors, series_until=h.last_t))

        full, poll = route(None), route(now.t - 1)
        rows.append((n, _median_ms(lambda: route(None), calls), len(full),
                     _median_ms(lambda: route(now.t - 1), calls), len(poll)))
    await gw.close()
    print(f"http (in process, short history): median {statistics.median(http):.2f} ms, {http_bytes} bytes")
    print(f"read_gateway (1 model):           median {read:.3f} ms")
    for n, t_full, size_full, t_poll, size_poll in rows:
        print(f"{HISTORY} readings, {n} model(s): full median {t_full:.2f} ms ({size_full / 1024:.0f} KiB), "
              f"poll median {t_poll:.2f} ms ({size_poll / 1024:.1f} KiB)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="3 calls, 2 models: checks that the benchmark runs")
    a = ap.parse_args()
    if a.smoke:
        a.calls, a.models = 3, 2
    asyncio.run(main(a.calls, a.models))
