"""The operator dashboard (issue 16): the JSON as a pure function of readings, what the gateway reads into it, who
may see it, a page that holds nothing, and the page as headless Chromium renders it against a real gateway
(fake backends, real uvicorn)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import socket
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from lmfleet.gateway.admin.dashboard import (
    Counters,
    DashboardHistory,
    ModelReading,
    ProviderReading,
    Reading,
    build_dashboard,
    group_errors,
    histogram_quantile,
    read_counters,
)
from lmfleet.gateway.admin.dashboard import BudgetReading
from lmfleet.gateway.observe.metrics import GatewayMetrics
from lmfleet.gateway.admin.recent_errors import ErrorEntry, RecentErrors
from lmfleet.overflow import BudgetStatus
from tests.unit.chromium import Browser, find_chromium
from lmfleet.testing.gateway_fakes import chat_json, make_gateway, sse_events, started_client, stream_response

pytestmark = pytest.mark.usefixtures("close_started_gateways")

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}
ADMIN = {"authorization": "Bearer adm"}
INF = math.inf


def ok_local(req: httpx.Request) -> httpx.Response:
    body = json.loads(req.content)
    if body.get("stream"):
        return stream_response(sse_events(body["model"], ["Par", "is"]))
    return httpx.Response(200, json=chat_json(body["model"]))


# ---- the pure parts ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("q,buckets,expected", [
    (0.5, [], None),
    (0.5, [(0.1, 0), (1, 0), (INF, 0)], None),
    (0.5, [(0.1, 10), (1, 10), (INF, 10)], 0.05),              # all in the first bucket, which starts at 0
    (0.99, [(0.1, 10), (1, 10), (INF, 10)], 0.099),
    (0.5, [(0.1, 0), (1, 10), (INF, 10)], 0.55),               # interpolated inside (0.1, 1]
    (0.5, [(0.1, 5), (1, 10), (INF, 10)], 0.1),                # the rank falls on a bucket's edge
    (0.9, [(0.1, 5), (1, 10), (INF, 10)], 0.82),
    (0.99, [(0.1, 5), (1, 5), (INF, 10)], 1.0),                # in the +inf bucket: the highest finite bound
    (0.5, [(0.1, 1), (0.5, 1), (1, 3), (INF, 3)], 0.625),      # from the bound of the empty bucket before
])
def test_histogram_quantile(q, buckets, expected):
    got = histogram_quantile(q, buckets)
    assert (got is None) if expected is None else got == pytest.approx(expected)


def _metrics_with(events):
    m = GatewayMetrics()
    for kind, *args in events:
        if kind == "req":
            model, served_by, status = args
            m.requests.labels(model, served_by, status).inc()
        elif kind == "err":
            model, code = args
            m.errors.labels(model, code).inc()
        elif kind == "tok":
            model, served_by, k, n = args
            m.tokens.labels(model, served_by, k, "provider").inc(n)
        elif kind == "cost":
            model, served_by, usd = args
            m.cost.labels(model, served_by).inc(usd)
        elif kind == "ttft":
            model, served_by, s = args
            m.ttft.labels(model, served_by).observe(s)
    return m


@pytest.mark.parametrize("events,model,expected", [
    ([], "m", None),
    ([("req", "m", "local/m", "200"), ("req", "m", "local/m", "200"), ("req", "m", "provider/p", "200"),
      ("req", "m", "none", "429"), ("req", "other", "local/other", "200")],
     "m", {"local": 2, "external": 1, "gateway": 1}),
    ([("err", "m", "503"), ("err", "m", "503"), ("err", "m", "404")], "m", {"errors": (("404", 1), ("503", 2))}),
    ([("tok", "m", "local/m", "output", 30), ("tok", "m", "provider/p", "output", 12),
      ("tok", "m", "local/m", "input", 99)], "m", {"output_tokens": 42}),
    ([("cost", "m", "provider/p", 0.25), ("cost", "m", "provider/q", 0.5), ("cost", "m", "local/m", 0.1)],
     "m", {"external_cost_usd": 0.75, "local_cost_usd": 0.1}),
])
def test_read_counters(events, model, expected):
    got = read_counters(_metrics_with(events)).get(model)
    if expected is None:
        assert got is None
        return
    for k, v in expected.items():
        assert getattr(got, k) == pytest.approx(v) if isinstance(v, float) else getattr(got, k) == v, k


def test_read_counters_sums_ttft_buckets_over_backends():
    c = read_counters(_metrics_with([("ttft", "m", "local/m", 0.03), ("ttft", "m", "provider/p", 0.3),
                                     ("ttft", "m", "provider/p", 20)]))["m"]
    buckets = dict(c.ttft)
    assert buckets[0.025] == 0 and buckets[0.05] == 1 and buckets[0.5] == 2 and buckets[INF] == 3
    assert [le for le, _ in c.ttft] == sorted(le for le, _ in c.ttft)


def _model(name="m", **kw) -> ModelReading:
    base = dict(name=name, ready=True, degraded=False, health="serving", running_replicas=2, capacity=8,
                in_flight_local=3, in_flight_peers=0, in_flight_external=1, external_shared=False,
                queue_estimate_ms=400.0, threshold_ms=1000.0, mode="auto", overflowing=False, drain_rps=2.0,
                local_output_tps=50.0, ttft_median_s=0.2, base_ttft_s=0.1, engine_running=None,
                engine_waiting=None, providers=("p",), counters=Counters())
    return ModelReading(**{**base, **kw})


def _ttft(*per_bucket):
    """Cumulative TTFT buckets (0.1, 1, +inf) from counts per bucket."""
    out, n = [], 0.0
    for le, k in zip((0.1, 1.0, INF), per_bucket):
        n += k
        out.append((le, n))
    return tuple(out)


def _reading(t, *models, budget=None, providers=()) -> Reading:
    return Reading(t, {m.name: m for m in models}, tuple(providers), budget or BudgetReading(None, None, None))


def _build(readings, errors=(), *, window_s=60.0, smooth_s=10.0, since=None):
    """What the route does, over ``readings`` kept in turn (the last is the current one)."""
    h = DashboardHistory(min_interval_s=0, smooth_s=smooth_s)
    for r in readings:
        h.add(r)
    now = readings[-1]
    return build_dashboard(now, h.base(now, window_s), h.series(since), errors, series_until=h.last_t)


C0 = Counters()
C1 = Counters(local=30, external=10, gateway=2, errors=(("503", 2),), output_tokens=1200, external_cost_usd=0.5,
              ttft=_ttft(20, 20, 0))


@pytest.mark.parametrize("old,new,dt,expected", [
    # 30 local + 10 external served in 60 s, 1200 tokens: share 0.75, 20 tok/s; half the TTFTs <= 0.1 s
    (C0, C1, 60.0, {"requests": 42, "local_share": 0.75, "tokens_per_s": 20.0, "ttft_p50_ms": 100.0,
                    "ttft_p99_ms": 982.0, "errors": {"503": 2}, "external_usd": 0.5}),
    # nothing happened between the readings: no share, no TTFT, zero rate, no errors
    (C1, C1, 10.0, {"requests": 0, "local_share": None, "tokens_per_s": 0.0, "ttft_p50_ms": None,
                    "ttft_p99_ms": None, "errors": {}, "external_usd": 0.0}),
    # only external traffic
    (C0, Counters(external=5, output_tokens=50), 5.0, {"local_share": 0.0, "tokens_per_s": 10.0}),
    # only the errors that are new count in the window
    (Counters(errors=(("503", 2),)), Counters(errors=(("503", 5), ("404", 1))), 1.0, {"errors": {"503": 3, "404": 1}}),
])
def test_window_figures_are_differences_between_readings(old, new, dt, expected):
    body = _build([_reading(100.0, _model(counters=old)), _reading(100.0 + dt, _model(counters=new))])
    m = body["models"]["m"]
    assert m["window_s"] == dt
    for k, v in expected.items():
        assert m[k] == pytest.approx(v) if isinstance(v, float) else m[k] == v, k


def test_one_reading_gives_live_values_and_no_window():
    m = _build([_reading(5.0, _model(counters=C1))])["models"]["m"]
    assert (m["in_flight_local"], m["in_flight_external"], m["capacity"], m["queue_estimate_ms"]) == (3, 1, 8, 400.0)
    assert m["queue_ratio"] == 0.4 and m["ttft_median_ms"] == 200.0 and m["local_output_tps"] == 50.0
    assert m["requests"] is None and m["local_share"] is None and m["tokens_per_s"] is None
    assert m["total"]["local"] == 30 and m["total"]["errors"] == {"503": 2}
    assert all(v == [] for v in m["series"].values())


def test_the_window_starts_at_the_oldest_reading_inside_it():
    readings = [_reading(t, _model(counters=Counters(local=t, output_tokens=10 * t))) for t in (0, 30, 50, 70, 100)]
    m = _build(readings, window_s=60)["models"]["m"]
    assert m["window_s"] == 50 and m["requests"] == 50 and m["tokens_per_s"] == 10.0  # from t=50 to t=100


@pytest.mark.parametrize("times,smooth_s,expected_tps", [
    # each point's rate spans at least the previous reading, and as many as fit in smooth_s
    ([0, 1, 2, 3, 4], 10, [10.0, 10.0, 10.0, 10.0]),
    ([0, 5, 10, 15], 5, [10.0, 10.0, 10.0]),
])
def test_series_has_one_point_per_reading_after_the_first(times, smooth_s, expected_tps):
    readings = [_reading(t, _model(in_flight_local=i, counters=Counters(local=t, output_tokens=10 * t)))
                for i, t in enumerate(times)]
    s = _build(readings, smooth_s=smooth_s)["models"]["m"]["series"]
    assert s["t"] == times[1:]
    assert s["in_flight_local"] == list(range(1, len(times)))
    assert s["tokens_per_s"] == expected_tps
    assert s["threshold_ms"] == [1000.0] * (len(times) - 1)
    assert {len(v) for v in s.values()} == {len(times) - 1}


def test_series_counts_other_gateways_in_the_local_load_and_survives_a_model_missing_from_a_reading():
    readings = [_reading(0, _model()), _reading(1), _reading(2, _model(in_flight_local=2, in_flight_peers=5))]
    s = _build(readings)["models"]["m"]["series"]
    assert s["t"] == [2] and s["in_flight_local"] == [7]


def test_series_since_gives_only_later_points():
    readings = [_reading(t, _model(counters=Counters(local=t, output_tokens=10 * t))) for t in range(6)]
    body = _build(readings, since=3)
    assert body["models"]["m"]["series"]["t"] == [4, 5] and body["series_until"] == 5
    assert _build(readings, since=5)["models"]["m"]["series"]["t"] == []


@pytest.mark.parametrize("budget,expected", [
    (BudgetReading(None, None, None), {"allowed": None, "spent_hour_usd": None, "hourly_usd": None}),
    (BudgetReading(1.0, 10.0, BudgetStatus(True, None, 0.0, 0.25, 3.0)),
     {"allowed": True, "spent_hour_usd": 0.25, "spent_day_usd": 3.0, "hourly_usd": 1.0, "daily_usd": 10.0}),
    (BudgetReading(1.0, None, BudgetStatus(False, "hourly_budget_exhausted", 120.0, 1.0, 1.0)),
     {"allowed": False, "reason": "hourly_budget_exhausted", "retry_after_s": 120.0}),
])
def test_budget(budget, expected):
    b = _build([_reading(0, _model(), budget=budget)])["budget"]
    for k, v in expected.items():
        assert b[k] == v, k


def test_providers_and_errors_newest_first():
    p = ProviderReading("p", "open", 12.34, 2, 8, ("m",))
    errors = [ErrorEntry(1.0, "WARNING", "first"), ErrorEntry(2.0, "ERROR", "second")]
    body = _build([_reading(0, _model(), providers=[p])], errors)
    assert body["providers"] == {"p": {"breaker": "open", "retry_after_s": 12.3, "in_flight": 2, "max_concurrency": 8,
                                       "models": ["m"]}}
    assert [e["message"] for e in body["errors"]] == ["second", "first"]
    json.dumps(body, allow_nan=False)  # what JSONResponse needs


def _e(t, msg, level="WARNING"):
    return ErrorEntry(float(t), level, msg)


@pytest.mark.parametrize("errors,limit,expected", [
    ([], 20, []),
    ([_e(1, "a"), _e(2, "a"), _e(3, "a")], 20, [("a", 3, 3.0, 1.0)]),              # a run folds into one row
    ([_e(1, "a"), _e(2, "b"), _e(3, "a")], 20, [("a", 1, 3.0, 3.0), ("b", 1, 2.0, 2.0), ("a", 1, 1.0, 1.0)]),
    ([_e(1, "a", "ERROR"), _e(2, "a")], 20, [("a", 1, 2.0, 2.0), ("a", 1, 1.0, 1.0)]),  # another level: another row
    ([_e(1, "a"), _e(2, "b"), _e(3, "c"), _e(4, "c")], 2, [("c", 2, 4.0, 3.0), ("b", 1, 2.0, 2.0)]),  # newest first
])
def test_group_errors(errors, limit, expected):
    got = group_errors(errors, limit)
    assert [(g["message"], g["count"], g["t"], g["first_t"]) for g in got] == expected


@pytest.mark.parametrize("times,maxlen,added,kept,points", [
    ([0, 1, 2], 10, [True, True, True], [0, 1, 2], [1, 2]),
    ([0, 0.5], 10, [True, False], [0], []),          # too soon: shown by the route (the current state), not kept
    ([0, 0.5, 1.2], 10, [True, False, True], [0, 1.2], [1.2]),
    ([0, 1, 2, 3], 2, [True] * 4, [2, 3], [2, 3]),    # bounded; the points stay those computed when kept
])
def test_history_keeps_readings_apart_and_bounded(times, maxlen, added, kept, points):
    h = DashboardHistory(maxlen=maxlen, min_interval_s=1.0)
    assert [h.add(_reading(t, _model())) for t in times] == added
    assert [r.t for r in h.readings()] == kept
    assert h.series().get("m", {}).get("t", []) == points and h.last_t == kept[-1]


@pytest.mark.parametrize("kept,now,window_s,base", [
    ([], 5, 60, None),
    ([5], 5, 60, None),                    # only the current reading itself
    ([0, 30, 50, 70], 100, 60, 50),        # the oldest inside the window
    ([0, 10], 100, 60, 10),                # none inside: the newest before
    ([0, 10, 99], 100.5, 60, 99),          # the current reading was not kept: from the oldest kept in the window
])
def test_window_base(kept, now, window_s, base):
    h = DashboardHistory(min_interval_s=0)
    for t in kept:
        h.add(_reading(t))
    got = h.base(_reading(now), window_s)
    assert (got.t if got else None) == base


def test_recent_errors_ring():
    ring = RecentErrors(maxlen=3, max_chars=20)
    log = logging.getLogger("lmfleet.test.recent_errors")
    log.addHandler(ring)
    log.propagate = False
    try:
        log.info("not kept")
        for i in range(5):
            log.warning("attempt %d failed", i)
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("x" * 50)
        log.warning("%d bad format %s", 1)  # a broken format string is kept as it is, and raises nothing
    finally:
        log.removeHandler(ring)
    got = ring.entries()
    assert [e.message for e in got] == ["attempt 4 failed", "x" * 20, "%d bad format %s"]
    assert [e.level for e in got] == ["WARNING", "ERROR", "WARNING"]


# ---- through the gateway -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path,headers,admin_key,api_keys,status", [
    ("/admin/dashboard.json", {}, "adm", set(), 401),
    ("/admin/dashboard.json", {"authorization": "Bearer nope"}, "adm", set(), 401),
    ("/admin/dashboard.json", {"authorization": "Bearer client"}, "adm", {"client"}, 401),  # a client key is not enough
    ("/admin/dashboard.json", ADMIN, "adm", set(), 200),
    ("/admin/dashboard.json", ADMIN, None, set(), 403),                     # admin API disabled
    ("/dashboard", {}, "adm", {"client"}, 200),                             # the page holds nothing
    ("/dashboard", {}, None, set(), 200),
    ("/dashboard", {"host": "evil.example"}, "adm", set(), 400),            # trusted Host names still apply
])
async def test_who_may_see_it(tmp_path, path, headers, admin_key, api_keys, status):
    c = await started_client(make_gateway(tmp_path, ok_local, admin_key=admin_key, api_keys=api_keys))
    r = await c.get(path, headers=headers)
    assert r.status_code == status, r.text
    if status == 200:
        assert r.headers["cache-control"] == "no-store"


async def test_page_holds_no_data_and_no_key_and_allows_only_itself(tmp_path):
    a = await started_client(make_gateway(tmp_path / "a", ok_local, {"prov-alpha": ok_local}, admin_key="admin-key-one"))
    b = await started_client(make_gateway(tmp_path / "b", ok_local, admin_key="admin-key-two"))
    await a.post("/v1/chat/completions", json=CHAT)
    pa, pb = await a.get("/dashboard"), await b.get("/dashboard")
    assert pa.content == pb.content  # the same bytes whatever the gateway's state, keys and providers
    html = pa.text
    for secret in ("admin-key-one", "admin-key-two", "prov-alpha", "sk-secret-provider-key"):
        assert secret not in html
    assert pa.headers["content-type"].startswith("text/html")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing fetched from elsewhere
    csp = pa.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'$|script-src 'sha256-[A-Za-z0-9+/=]+';", csp)
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert "sessionStorage" in html and "localStorage" not in html  # the key lives and dies with the tab


async def test_json_reflects_traffic_through_the_gateway(tmp_path):
    calls = {"n": 0}

    def flaky_provider(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] == 1:
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        return ok_local(req)

    c = await started_client(make_gateway(tmp_path, ok_local, {"p": flaky_provider}))
    first = (await c.get("/admin/dashboard.json", headers=ADMIN)).json()
    assert first["models"]["m"]["requests"] is None  # one reading: no window yet
    for _ in range(3):
        assert (await c.post("/v1/chat/completions", json={**CHAT, "stream": True})).status_code == 200
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers=ADMIN)
    for _ in range(2):
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert (await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"})).status_code == 404
    await asyncio.sleep(1.05)  # the next reading is kept, not just shown
    body = (await c.get("/admin/dashboard.json", headers=ADMIN)).json()
    m = body["models"]["m"]
    # the provider's first answer (503) sent that request back to the local engine
    assert m["total"]["local"] == 4 and m["total"]["external"] == 1
    assert m["requests"] == 5 and m["local_share"] == pytest.approx(0.8)
    assert m["mode"] == "force_on" and m["providers"] == ["p"]
    assert m["ttft_p50_ms"] is not None and m["tokens_per_s"] > 0
    assert len(m["series"]["t"]) == 1
    assert body["providers"]["p"]["breaker"] == "closed" and body["providers"]["p"]["models"] == ["m"]
    assert body["budget"]["external_usd_window"] > 0
    assert any("provider/p attempt 1 failed" in e["message"] for e in body["errors"])
    assert body["models"]["m"]["total"]["errors"] == {} and "nope" not in json.dumps(body["models"])


# ---- the page in a real browser ----------------------------------------------------------------------------

def _chromium_or_skip() -> str:
    path = find_chromium()
    if path is None:
        msg = ("chromium not found (Debian: apt-get install chromium; `make install` does it; or set "
               "LMFLEET_CHROMIUM): the dashboard's browser test cannot run")
        if os.environ.get("CI"):
            pytest.fail(msg + " -- and CI must run it")
        pytest.skip(msg)
    return path


@pytest.mark.parametrize("ci,outcome", [("1", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_no_chromium_skips_only_outside_ci(monkeypatch, ci, outcome):
    monkeypatch.setattr("tests.unit.test_gateway_dashboard.find_chromium", lambda: None)
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="chromium not found"):
        _chromium_or_skip()


async def _serve(app):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    return server, task, f"http://127.0.0.1:{port}"


async def _traffic(url: str, seconds: float, admin: dict[str, str]) -> None:
    """Local streams, then overflow to the provider, and a few mistakes, for ``seconds``."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        i = 0
        while loop.time() < end:
            i += 1
            if i % 7 == 0:
                await c.post("/admin/overflow", json={"mode": "force_on" if i % 14 else "auto"}, headers=admin)
            body = {**CHAT, "stream": i % 2 == 0} if i % 11 else {**CHAT, "model": "nope"}
            await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(3)))
            await asyncio.sleep(0.05)


# what the rendered page must show, read from the DOM in the browser
_DOM_CHECKS = """(() => {
  const card = document.querySelector('.model[data-model="m"]');
  const f = (n) => (card.querySelector('[data-field="' + n + '"]') || {}).textContent || '';
  const plots = {};
  card.querySelectorAll('[data-plot]').forEach((p) => {
    plots[p.dataset.plot] = [...p.querySelectorAll('polyline')].map((l) => l.getAttribute('points').split(' ').length);
  });
  return {
    fields: {in_flight_local: f('in_flight_local'), queue: f('queue'), local_share: f('local_share'), ttft: f('ttft'),
             tokens_per_s: f('tokens_per_s'), requests: f('requests'), state: f('state'), spend: f('spend')},
    plots,
    providers: document.getElementById('providers').textContent,
    errors: document.getElementById('errors').textContent,
    budget: document.getElementById('budget').textContent,
    login_hidden: document.getElementById('login').hidden,
    html: document.documentElement.outerHTML,
    url: location.href,
    local_storage: localStorage.length,
  };
})()"""


async def test_dashboard_renders_in_headless_chromium(tmp_path):
    binary = _chromium_or_skip()

    async def slow_local(req: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.02 + (hash(req.content) % 7) / 100)  # TTFTs spread over a few buckets
        return ok_local(req)

    calls = {"n": 0}

    def provider(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] % 5 == 1:
            return httpx.Response(503, json={"error": {"message": "provider overloaded"}})
        return ok_local(req)

    key = "dash-admin-7c1e9"
    app = make_gateway(tmp_path, slow_local, {"backup": provider}, admin_key=key)
    server, task, url = await _serve(app)
    seconds = float(os.environ.get("LMFLEET_DASHBOARD_SECONDS", "6"))
    try:
        async with Browser.start(binary, width=1280, height=900) as b:
            await b.navigate(f"{url}/dashboard#poll=500")
            await b.wait_for("!document.getElementById('login').hidden")
            # a wrong key: refused, asked again
            await b.eval("document.getElementById('key').value = 'wrong';"
                         "document.getElementById('login-form').requestSubmit()")
            await b.wait_for("document.getElementById('login-msg').textContent.includes('401')")
            await b.eval(f"document.getElementById('key').value = '{key}';"
                         "document.getElementById('login-form').requestSubmit()")
            await b.wait_for("document.querySelector('.model[data-model=\"m\"]') !== null")
            await _traffic(url, seconds, {"authorization": f"Bearer {key}"})
            await asyncio.sleep(1.5)  # a last poll or two after the traffic
            await b.wait_for("document.querySelectorAll('[data-plot=\"tokens\"] polyline').length > 0")
            dom = await b.eval(_DOM_CHECKS)
            png = await b.screenshot()
            problems = list(b.problems)
    finally:
        server.should_exit = True
        await task

    (tmp_path / "dashboard.png").write_bytes(png)
    if out := os.environ.get("LMFLEET_DASHBOARD_PNG"):
        Path(out).write_bytes(png)
    # the 401 of the wrong key is the one error the browser may log
    assert [p for p in problems if "401" not in p] == [], problems
    f = dom["fields"]
    assert dom["login_hidden"] and f["state"] == "ready"
    assert re.fullmatch(r"\d+ / 4", f["in_flight_local"]), f
    assert re.fullmatch(r"[\d.,]+ ms / 1,000 ms", f["queue"]), f
    assert re.fullmatch(r"\d+ %", f["local_share"]), f
    assert re.fullmatch(r"[\d.,]+ ms / [\d.,]+ ms", f["ttft"]), f
    assert re.fullmatch(r"[\d.,]+", f["tokens_per_s"]) and f["tokens_per_s"] != "0", f
    assert re.fullmatch(r"\d+ / \d+", f["requests"]), f
    assert f["spend"].startswith("$"), f
    for name in ("in_flight", "queue", "ttft", "tokens", "share"):  # every plot has a line of several points
        assert dom["plots"].get(name) and max(dom["plots"][name]) >= 3, (name, dom["plots"])
    assert "backup" in dom["providers"] and re.search("closed|open|half-open", dom["providers"])
    assert "provider/backup attempt 1 failed" in dom["errors"]
    assert "no caps" in dom["budget"]
    # the key is in no URL, no DOM, no persistent storage
    assert key not in dom["url"] and key not in dom["html"] and dom["local_storage"] == 0
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
