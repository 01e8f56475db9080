"""A budget store (ledger database) that fails: the provider route closes (local, or 429 with on_exhausted: reject),
the outage is visible (/ready degraded, metrics, one log line), and the route reopens once the store answers.
At start, an unreachable store is one line and exit 1."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

from lmfleet.config import parse_config
from lmfleet.config.models import ProviderPrice
from lmfleet.gateway.routing.budget import BudgetGuard
from lmfleet.gateway.observe.metrics import GatewayMetrics
from lmfleet.store import GLOBAL, Cap, Refusal, Reservation, StoreUnavailable
from lmfleet.testing.gateway_fakes import chat_json, make_gateway

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}
ADMIN = {"authorization": "Bearer adm"}
PRICE = ProviderPrice(input_per_1m=1.0, output_per_1m=2.0)
CAP = Cap(GLOBAL, 3600.0, 10**9)


# --- BudgetGuard: the store's health --------------------------------------------------------------------


class FlakyStore:
    """A SpendStore whose database is down while ``down`` is set (reserve raises, as the real stores do)."""

    def __init__(self) -> None:
        self.down = False
        self.pending_writes = 0
        self.reserved: list[str] = []
        self.released: list[str] = []

    def reserve(self, request_id, amount_nusd, caps):
        if self.down:
            raise StoreUnavailable("ledger database db: connection refused")
        self.reserved.append(request_id)
        return Reservation(f"r{len(self.reserved)}", request_id, amount_nusd, (GLOBAL,), time.time() + 60)

    def release(self, reservation, record=None):
        self.released.append(reservation.request_id)
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _guard(store, clock=None, metrics=None):
    return BudgetGuard(store, [CAP], lambda write: write(), metrics=metrics or GatewayMetrics(),
                       probe_every_s=2.0, clock=clock or Clock())


def _sample(metrics: GatewayMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


async def test_failures_mark_the_store_down_once_and_a_reservation_brings_it_back(caplog):
    store, metrics = FlakyStore(), GatewayMetrics()
    guard = _guard(store, metrics=metrics)
    assert not guard.is_down and _sample(metrics, "lmfleet_budget_store_up") == 1
    store.down = True
    with caplog.at_level(logging.INFO, logger="lmfleet.gateway"):
        for i in range(3):
            assert await guard.reserve(f"q{i}", 10, 8, PRICE, None) is None
        assert guard.is_down and guard.failures == 3 and "connection refused" in guard.last_error
        assert _sample(metrics, "lmfleet_budget_store_failures_total") == 3
        assert _sample(metrics, "lmfleet_budget_store_up") == 0
        store.down = False
        assert isinstance(await guard.reserve("q3", 10, 8, PRICE, None), Reservation)
    assert not guard.is_down and guard.down_since is None and guard.last_error is None
    assert _sample(metrics, "lmfleet_budget_store_up") == 1
    lines = [r.getMessage() for r in caplog.records]
    assert sum("budget store unavailable" in m for m in lines) == 1  # once per outage, not per request
    assert sum("is back after" in m for m in lines) == 1
    assert guard.status() == {"up": True, "down_since": None, "error": None, "failures": 3, "pending_writes": 0}


async def test_a_refusal_is_an_answer_not_an_outage():
    class Refusing(FlakyStore):
        def reserve(self, request_id, amount_nusd, caps):
            return Refusal(CAP, CAP.cap_nusd, amount_nusd, 30.0)

    guard = _guard(Refusing())
    assert await guard.reserve("q", 10, 8, PRICE, None) is None
    assert not guard.is_down and guard.refused == 1


@pytest.mark.parametrize("pending, back", [(0, True), (2, False)])
async def test_a_probe_holds_nothing_and_needs_deferred_writes_landed(pending, back):
    store = FlakyStore()
    guard = _guard(store)
    store.down = True
    await guard.reserve("q", 10, 8, PRICE, None)
    store.down, store.pending_writes = False, pending
    assert await guard.probe() is back
    assert guard.is_down is not back
    assert store.reserved == ["lmfleet-probe"] and store.released == ["lmfleet-probe"]  # an empty hold, released
    if not back:
        assert "2 ledger write(s)" in guard.last_error


async def test_probes_run_in_the_background_at_most_every_probe_every_s():
    store, clock = FlakyStore(), Clock()
    guard = _guard(store, clock)
    guard.probe_if_due()  # up: nothing to probe
    assert guard._probe is None
    store.down = True
    await guard.reserve("q", 10, 8, PRICE, None)
    guard.probe_if_due()  # the failure was just now
    assert guard._probe is None
    clock.t += 2.0
    guard.probe_if_due()
    first = guard._probe
    assert first is not None
    guard.probe_if_due()  # one at a time
    assert guard._probe is first
    await first
    assert guard.is_down and guard.failures == 2
    guard.probe_if_due()  # the failed probe restarted the interval
    assert guard._probe is first
    store.down = False
    clock.t += 2.0
    guard.probe_if_due()
    await guard._probe
    assert not guard.is_down


# --- the gateway, with its SQLite store locked by another writer -----------------------------------------


async def _client(app):
    app.state.gateway.start()
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


async def _wait_up(guard, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while guard.is_down and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not guard.is_down


@pytest.mark.parametrize("on_exhausted", ["reject", "queue"])
async def test_store_down_closes_the_provider_route_visibly_and_reopens(tmp_path, on_exhausted, caplog):
    provider_calls = []

    def provider(req):
        provider_calls.append(1)
        return httpx.Response(200, json=chat_json(json.loads(req.content)["model"], "Remote."))

    def local(req):
        return httpx.Response(200, json=chat_json(json.loads(req.content)["model"]))

    path = tmp_path / "ledger.sqlite"
    app = make_gateway(tmp_path, local, {"p": provider}, extra={
        "budget": {"hourly_usd": 1.0, "on_exhausted": on_exhausted},
        "ledger": {"path": str(path), "connect_timeout_s": 2}})
    gw = app.state.gateway
    guard = gw.router.guard
    c = await _client(app)
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        await c.post("/admin/overflow", json={"mode": "force_on"}, headers=ADMIN)
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.headers["x-lmfleet-served-by"] == "provider/p"
        await gw.recorder.flush()

        blocker.execute("BEGIN IMMEDIATE")  # another process stuck in a write: the store cannot hold anything
        guard.probe_every_s = 3600.0
        with caplog.at_level(logging.ERROR, logger="lmfleet.gateway"):
            r = await c.post("/v1/chat/completions", json=CHAT)  # the reservation fails closed: served locally
            assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/m"
            assert guard.is_down and "locked" in guard.last_error

            r = await c.post("/v1/chat/completions", json=CHAT)  # the route is closed now: no reservation tried
            if on_exhausted == "reject":
                assert r.status_code == 429 and r.headers["retry-after"] == "10"
                err = r.json()["error"]
                assert err["code"] == "budget_exhausted" and "budget store" in err["message"]
            else:
                assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/m"
                assert r.headers["x-lmfleet-route-reason"] == "budget_store_down"
        assert provider_calls == [1] and guard.failures == 1
        assert sum("budget store unavailable" in m.getMessage() for m in caplog.records) == 1

        bare = await c.get("/ready")
        assert (bare.status_code, bare.json()) == (200, {"ready": True})  # local traffic goes on
        detail = (await c.get("/ready", headers=ADMIN)).json()
        assert detail["ready"] is True and detail["degraded"] is True
        store = detail["budget_store"]
        assert store["up"] is False and "locked" in store["error"] and store["message"].startswith("paid providers")
        text = (await c.get("/metrics", headers=ADMIN)).text
        assert "lmfleet_budget_store_up 0.0" in text and "lmfleet_budget_store_failures_total 1.0" in text

        blocker.execute("ROLLBACK")
        guard.probe_every_s = 0.0
        await c.get("/ready")  # a load balancer's health check is enough to notice the store is back
        assert await _wait_up(guard)
        detail = (await c.get("/ready", headers=ADMIN)).json()
        assert detail["degraded"] is False and detail["budget_store"]["up"] is True
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.headers["x-lmfleet-served-by"] == "provider/p"
        assert "lmfleet_budget_store_up 1.0" in (await c.get("/metrics", headers=ADMIN)).text
    finally:
        if blocker.in_transaction:
            blocker.execute("ROLLBACK")
        blocker.close()
        await gw.close()
    rows = gw.recorder.ledger.rows()
    assert [r["served_by"] for r in rows].count("provider/p") == 2  # nothing recorded was lost


async def test_without_caps_there_is_no_budget_store_entry(tmp_path):
    app = make_gateway(tmp_path, lambda req: httpx.Response(200, json=chat_json("m")))
    c = await _client(app)
    try:
        assert app.state.gateway.router.guard is None
        assert "budget_store" not in (await c.get("/ready", headers=ADMIN)).json()
    finally:
        await app.state.gateway.close()


# --- at start: one line, exit 1 ---------------------------------------------------------------------------


def _unusable_path(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the ledger's folder should be")
    return str(blocker / "ledger.sqlite")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_check_ledger_raises_one_line(tmp_path):
    from lmfleet.gateway.build import check_ledger

    models = [{"name": "m", "source": "builtin:tiny-random"}]
    fleet = parse_config({"models": models, "ledger": {"path": _unusable_path(tmp_path)}})
    with pytest.raises(StoreUnavailable, match="ledger database .*not-a-dir") as err:
        check_ledger(fleet)
    assert "\n" not in str(err.value)
    # PostgreSQL (ledger.url) that refuses connections: StoreUnavailable too, not a config error
    fleet = parse_config({"models": models, "budget": {"hourly_usd": 1.0},
                          "ledger": {"path": str(tmp_path / "l.sqlite"),
                                     "url": f"postgresql://lmfleet@127.0.0.1:{_closed_port()}/lmfleet"}})
    pytest.importorskip("psycopg")
    t = time.monotonic()
    with pytest.raises(StoreUnavailable, match="refused|failed"):
        check_ledger(fleet)
    assert time.monotonic() - t < 10
    check_ledger(parse_config({"models": models, "budget": {"hourly_usd": 1.0},
                               "ledger": {"path": str(tmp_path / "ok.sqlite")}}))  # a usable one: no error


def test_build_gateway_lets_an_unreachable_store_through_as_store_unavailable(tmp_path):
    with pytest.raises(StoreUnavailable, match="not-a-dir"):
        make_gateway(tmp_path, lambda req: httpx.Response(500),
                     extra={"ledger": {"path": _unusable_path(tmp_path)}, "budget": {"hourly_usd": 1.0}})


def test_run_gateway_maps_an_unreachable_store_to_exit_1(tmp_path):
    from lmfleet.serve.gateway_proc import run_gateway

    fleet = parse_config({"models": [{"name": "m", "source": "builtin:tiny-random"}],
                          "ledger": {"path": _unusable_path(tmp_path)}})
    lines: list[str] = []
    code = run_gateway(fleet, config_path=None, host="127.0.0.1", port=_closed_port(), address=None, serve_url=None,
                       workers=1, progress=lines.append)
    assert code == 1
    assert len(lines) == 1 and lines[0].startswith("lmfleet: error: ledger database") and "not-a-dir" in lines[0]


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_cli_with_an_unreachable_ledger_exits_1_with_one_line(tmp_path, command):
    """Through the real CLI, before Ray is joined or anything deployed (lmfleet serve's own reaper and
    teardown run in the child process: nothing of this test process is touched)."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"models: [{{name: m, source: 'builtin:tiny-random'}}]\n"
                     f"ledger: {{path: '{_unusable_path(tmp_path)}'}}\n")
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-m", "lmfleet.cli.main", command, "-c", str(fleet),
                        "--port", str(_closed_port())], env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out
    errors = [line for line in out.splitlines() if line.startswith("lmfleet: error:")]
    assert len(errors) == 1 and "ledger database" in errors[0] and "not-a-dir" in errors[0], out


async def test_a_failing_ledger_write_makes_ready_degraded_and_no_row_is_lost(tmp_path):
    """The ledger (no budget caps) is locked by another writer: /ready says degraded with the backlog, /metrics
    shows it, the requests are still answered, and once the lock is gone every row lands."""
    path = tmp_path / "ledger.sqlite"
    app = make_gateway(tmp_path, lambda req: httpx.Response(200, json=chat_json("m")),
                       extra={"ledger": {"path": str(path), "connect_timeout_s": 2}})
    gw = app.state.gateway
    gw.recorder.retry_first_s = gw.recorder.retry_max_s = 0.05
    gw.recorder.ledger.db._db.execute("PRAGMA busy_timeout = 100")  # fail fast (10 s in the product)
    c = await _client(app)
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        assert (await c.get("/ready", headers=ADMIN)).json()["ledger"]["up"] is True
        blocker.execute("BEGIN IMMEDIATE")
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        deadline = time.monotonic() + 10
        while gw.recorder.failing_since is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        bare = await c.get("/ready")
        assert (bare.status_code, bare.json()) == (200, {"ready": True})
        detail = (await c.get("/ready", headers=ADMIN)).json()
        assert detail["degraded"] is True and detail["ledger"]["up"] is False, (detail, gw.recorder.failing_since)
        assert detail["ledger"]["pending_rows"] == 3 and "rows wait in memory" in detail["ledger"]["message"]
        text = (await c.get("/metrics", headers=ADMIN)).text
        assert "lmfleet_ledger_write_failing 1.0" in text and "lmfleet_ledger_pending_rows 3.0" in text
        blocker.execute("ROLLBACK")
        await asyncio.wait_for(gw.recorder.flush(), 10)
        detail = (await c.get("/ready", headers=ADMIN)).json()
        assert detail["degraded"] is False and detail["ledger"] == {
            "up": True, "pending_rows": 0, "dropped_rows": 0, "failing_for_s": None, "message": "ok"}
    finally:
        if blocker.in_transaction:
            blocker.execute("ROLLBACK")
        blocker.close()
        await gw.close()
    assert len(gw.recorder.ledger.rows()) == 3
