"""The wait estimate's live calibration where operators read it: /metrics, /admin/state, the dashboard's JSON and
/admin/usage?estimate=1, through the real gateway (fake backends); and the gauges from a book by hand."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from lmfleet.gateway.admin.dashboard import BudgetReading, ModelReading, Reading, build_dashboard
from lmfleet.gateway.observe.metrics import GatewayMetrics, SharedMetricsDir
from lmfleet.overflow.calibration import CalibrationBook
from lmfleet.testing.gateway_fakes import chat_json, make_gateway, sse_events, started_client, stream_response

pytestmark = pytest.mark.usefixtures("close_started_gateways")

REPO = Path(__file__).resolve().parents[2]

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}
ADMIN = {"authorization": "Bearer adm"}
GAUGES = ("lmfleet_estimate_local_miss_ratio", "lmfleet_estimate_p90_abs_error_ms",
          "lmfleet_estimate_p90_abs_error_threshold_ratio", "lmfleet_estimate_window_requests")


def ok_local(req: httpx.Request) -> httpx.Response:
    body = json.loads(req.content)
    if body.get("stream"):
        return stream_response(sse_events(body["model"], ["Par", "is"]))
    return httpx.Response(200, json=chat_json(body["model"]))


def gauges(text: str, model: str = "m") -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in GAUGES and s.labels.get("model") == model}


async def test_streamed_local_requests_reach_every_view(tmp_path):
    app = make_gateway(tmp_path, ok_local, {"p": ok_local})
    c = await started_client(app)
    assert gauges((await c.get("/metrics", headers=ADMIN)).text) == {}  # nothing kept local yet: no series
    assert (await c.get("/admin/state", headers=ADMIN)).json()["models"]["m"]["estimate_calibration"] is None
    for _ in range(3):
        assert (await c.post("/v1/chat/completions", json={**CHAT, "stream": True})).status_code == 200
    await c.post("/v1/chat/completions", json=CHAT)  # not streamed: no first token to time, not a sample
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers=ADMIN)
    await c.post("/v1/chat/completions", json={**CHAT, "stream": True})  # a provider's: not kept local

    state = (await c.get("/admin/state", headers=ADMIN)).json()["models"]["m"]["estimate_calibration"]
    assert state["requests"] == 3 and state["missed"] == 0 and state["miss_ratio"] == 0.0
    assert state["threshold_ms"] == 1000 and state["window_s"] == 600
    assert state["p90_abs_error_share_of_threshold"] == pytest.approx(state["p90_abs_error_ms"] / 1000, abs=1e-3)

    g = gauges((await c.get("/metrics", headers=ADMIN)).text)
    assert g["lmfleet_estimate_window_requests"] == 3 and g["lmfleet_estimate_local_miss_ratio"] == 0.0
    assert g["lmfleet_estimate_p90_abs_error_ms"] == pytest.approx(state["p90_abs_error_ms"], abs=0.1)

    dash = (await c.get("/admin/dashboard.json", headers=ADMIN)).json()["models"]["m"]["estimate_calibration"]
    assert dash["requests"] == 3 and dash["missed"] == 0

    (est,) = (await c.get("/admin/usage?estimate=1", headers=ADMIN)).json()["models"]
    assert est["requests"] == 3 and est["missed"] == 0 and est["missed_pct"] == 0.0


async def test_a_lowered_threshold_judges_later_requests_only(tmp_path):
    app = make_gateway(tmp_path, ok_local)
    c = await started_client(app)
    assert (await c.post("/v1/chat/completions", json={**CHAT, "stream": True})).status_code == 200
    # a threshold below any wait: the next request kept local misses it, the first one was judged at 1000 ms
    await c.post("/admin/overflow", json={"threshold_ms": 0.001}, headers=ADMIN)
    assert (await c.post("/v1/chat/completions", json={**CHAT, "stream": True})).status_code == 200
    state = (await c.get("/admin/state", headers=ADMIN)).json()["models"]["m"]["estimate_calibration"]
    assert (state["requests"], state["missed"], state["miss_ratio"], state["threshold_ms"]) == (2, 1, 0.5, 0.001)
    g = gauges((await c.get("/metrics", headers=ADMIN)).text)
    assert g["lmfleet_estimate_local_miss_ratio"] == 0.5


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_gauges_from_a_book_and_nan_once_the_window_is_empty():
    clock = Clock()
    book = CalibrationBook(60, clock=clock, threshold_of={"a": 1000.0}.get)
    book.add("a", 100, 1600)  # 1500 ms off, past the threshold
    book.add("b", 100, 300)   # no threshold known for b
    m = GatewayMetrics()
    m.set_calibration(book)
    page = m.exposition().decode()
    assert gauges(page, "a") == {"lmfleet_estimate_local_miss_ratio": 1.0, "lmfleet_estimate_p90_abs_error_ms": 1500.0,
                                 "lmfleet_estimate_p90_abs_error_threshold_ratio": 1.5,
                                 "lmfleet_estimate_window_requests": 1.0}
    b = gauges(page, "b")
    assert math.isnan(b["lmfleet_estimate_local_miss_ratio"]) and b["lmfleet_estimate_p90_abs_error_ms"] == 200.0
    clock.t = 120.0  # both windows empty again: no figure, rather than a perfect one
    m.set_calibration(book)
    a = gauges(m.exposition().decode(), "a")
    assert a["lmfleet_estimate_window_requests"] == 0
    assert all(math.isnan(a[n]) for n in GAUGES[:3])


def test_dashboard_json_carries_the_calibration():
    book = CalibrationBook(600, threshold_of=lambda m: 2000.0)
    book.add("m", 500, 900)
    m = ModelReading("m", True, False, "ok", 1, 8, 0, 0, 0, False, 0.0, 2000.0, "auto", False, None, None, None, None,
                     None, None, (), calibration=book.summary("m"))
    now = Reading(10.0, {"m": m}, (), BudgetReading(None, None, None))
    got = build_dashboard(now, None, {})["models"]["m"]["estimate_calibration"]
    assert got == {"window_s": 600, "requests": 1, "missed": 0, "miss_ratio": 0.0, "p90_abs_error_ms": 400.0,
                   "threshold_ms": 2000.0, "p90_abs_error_share_of_threshold": 0.2}
    empty = Reading(10.0, {"m": replace(m, calibration=None)}, (), BudgetReading(None, None, None))
    assert build_dashboard(empty, None, {})["models"]["m"]["estimate_calibration"] is None


# one gateway process's window: N samples of (predicted, realised) against a 1000 ms threshold
PROCESS = textwrap.dedent("""
    import sys
    from lmfleet.gateway.observe.metrics import GatewayMetrics, SharedMetricsDir
    from lmfleet.overflow.calibration import CalibrationBook
    book = CalibrationBook(threshold_of=lambda m: 1000.0)
    for pair in sys.argv[1:]:
        book.add("m", *(float(x) for x in pair.split(",")))
    GatewayMetrics().set_calibration(book)
""")


def test_several_processes_show_the_worst_window_and_every_request():
    with SharedMetricsDir() as shared:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]), **shared.env()}
        for pairs in (["100,1600"], ["100,100", "100,200", "100,100"]):  # one miss 1500 ms off; three on time
            p = subprocess.run([sys.executable, "-c", PROCESS, *pairs], env=env, capture_output=True, text=True,
                               timeout=120)
            assert p.returncode == 0, p.stderr[-2000:]
        reg = CollectorRegistry()
        MultiProcessCollector(reg, shared.path)
        g = gauges(generate_latest(reg).decode())
    assert g == {"lmfleet_estimate_local_miss_ratio": 1.0, "lmfleet_estimate_p90_abs_error_ms": 1500.0,
                 "lmfleet_estimate_p90_abs_error_threshold_ratio": 1.5, "lmfleet_estimate_window_requests": 4.0}
