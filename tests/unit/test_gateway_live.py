"""A running gateway takes a new fleet version (``lmfleet apply``, :mod:`lmfleet.gateway.routing.live`): the new
settings for new requests, the old ones for requests already admitted (their price in the ledger included)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from lmfleet.config import parse_config
from lmfleet.config.models import FleetConfig
from lmfleet.gateway.routing.live import LiveFleet
from lmfleet.overflow.policies import Policy
from lmfleet.testing.gateway_fakes import chat_json, make_gateway, started_client

pytestmark = pytest.mark.usefixtures("close_started_gateways")

ADMIN = {"authorization": "Bearer adm"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def running_fleet(app: Any) -> FleetConfig:
    """The fleet make_gateway built ``app`` from (the sections LiveFleet reads)."""
    gw = app.state.gateway
    return parse_config({"models": [m.app.cfg.model_dump() for m in gw.models.values()],
                         "providers": [p.cfg.model_dump() for p in gw.providers.values()],
                         "budget": gw.router.budget.model_dump()})


def changed(fleet: FleetConfig, **edits: Any) -> FleetConfig:
    """``fleet`` with ``section__key=value`` edits applied to its first model / provider / gateway."""
    data = fleet.model_dump(mode="json")
    for path, value in edits.items():
        node: Any = data
        *parents, last = path.split("__")
        for part in parents:
            node = node[part][0] if isinstance(node[part], list) else node[part]
        node[last] = value
    return parse_config(data)


def local_never(req: httpx.Request) -> httpx.Response:
    return httpx.Response(500)


async def test_a_request_admitted_before_a_price_change_is_priced_as_admitted(tmp_path) -> None:
    release = threading.Event()

    async def held_provider(req: httpx.Request) -> httpx.Response:
        while not release.is_set():
            await asyncio.sleep(0.01)
        return httpx.Response(200, json=chat_json("p-model"))  # 7 prompt, 2 completion tokens

    app = make_gateway(tmp_path, local_never, {"p": held_provider})
    gw = app.state.gateway
    c = await started_client(app)
    assert (await c.post("/admin/overflow", json={"mode": "force_on"}, headers=ADMIN)).status_code == 200
    old = running_fleet(app)
    live = LiveFleet(old, gw.router, gw.providers, gw.clients)
    first = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
    while gw.providers["p"].in_flight == 0:
        await asyncio.sleep(0.01)
    taken = live.take(changed(old, providers__price__input_per_1m=10.0, providers__price__output_per_1m=20.0))
    assert [ch.path for ch in taken.applied] == ["providers[p].price.input_per_1m", "providers[p].price.output_per_1m"]
    assert gw.providers["p"].in_flight == 1  # the request admitted under the old settings counts against the cap
    release.set()
    assert (await first).status_code == 200
    assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    await gw.recorder.flush()
    costs = [r["cost_usd"] for r in gw.recorder.ledger.rows()]
    assert sorted(costs) == pytest.approx([(7 * 1.0 + 2 * 2.0) / 1e6, (7 * 10.0 + 2 * 20.0) / 1e6])


async def test_the_new_backend_shares_the_pool_breaker_and_budget(tmp_path) -> None:
    app = make_gateway(tmp_path, local_never, {"p": local_never})
    gw = app.state.gateway
    before = gw.providers["p"]
    live = LiveFleet(running_fleet(app), gw.router, gw.providers, gw.clients)
    live.take(changed(live.fleet, providers__timeouts__total_s=42.0, providers__max_retries=0))
    after = gw.providers["p"]
    assert after is not before and gw.models["m"].providers == [after]

    assert (after.client, after.breaker, after.budget) == (before.client, before.breaker, before.budget)
    assert after.endpoint("m", has_fallback=False).total_timeout_s == 42.0 and after.attempts(last=True) == 1
    assert before.endpoint("m", has_fallback=False).total_timeout_s != 42.0  # what requests in flight keep


async def test_threshold_and_policy_swap_and_an_operator_override_stays_unless_changed(tmp_path) -> None:
    app = make_gateway(tmp_path, local_never, {"p": local_never})
    gw = app.state.gateway
    m = gw.models["m"]
    live = LiveFleet(running_fleet(app), gw.router, gw.providers, gw.clients)
    m.threshold_ms = 333.0  # POST /admin/overflow meanwhile
    live.take(changed(live.fleet, models__overflow__policy="hedge", models__overflow__hedge_after_ms=200.0))
    assert (m.timers.policy, m.timers.hedge_after_ms, m.threshold_ms) == (Policy.HEDGE, 200.0, 333.0)
    live.take(changed(live.fleet, models__overflow__threshold_ms=1500.0))
    assert (m.threshold_ms, m.timers.policy) == (1500.0, Policy.HEDGE)
    live.take(changed(live.fleet, models__overflow__miss_floor=0.3))
    assert (m.margin.floor, m.threshold_ms) == (0.3, 1500.0)


async def test_overflow_switched_off_keeps_new_requests_local(tmp_path) -> None:
    app = make_gateway(tmp_path, lambda req: httpx.Response(200, json=chat_json("m")),
                       {"p": lambda req: httpx.Response(200, json=chat_json("p-model"))})
    gw = app.state.gateway
    c = await started_client(app)
    await c.post("/admin/overflow", json={"threshold_ms": 1}, headers=ADMIN)
    gw.models["m"].local.tracker.on_start()  # one in flight: no idle engine to try, every estimate is over 1 ms
    assert (await c.post("/v1/chat/completions", json=CHAT)).headers["x-lmfleet-served-by"] == "provider/p"
    live = LiveFleet(running_fleet(app), gw.router, gw.providers, gw.clients)
    live.take(changed(live.fleet, models__overflow__enabled=False, models__overflow__hysteresis=0.5))
    assert gw.models["m"].app.cfg.overflow.hysteresis == 0.5 and gw.models["m"].threshold_ms == 1
    assert (await c.post("/v1/chat/completions", json=CHAT)).headers["x-lmfleet-served-by"] == "local/m"


async def test_changes_a_process_cannot_take_live_are_reported_and_left(tmp_path) -> None:
    app = make_gateway(tmp_path, local_never, {"p": local_never})
    gw = app.state.gateway
    live = LiveFleet(running_fleet(app), gw.router, gw.providers, gw.clients)
    before = gw.providers["p"]
    taken = live.take(changed(live.fleet, gateway__port=9000, models__cost__gpu_hour_usd=3.0))
    assert taken.applied == [] and [c.path for c in taken.ignored] == ["gateway.port", "models[m].cost.gpu_hour_usd"]
    assert gw.providers["p"] is before
    assert live.fleet.gateway.port == 9000  # the next version is compared with this one


# ------------------------------------------------------------------------------------------------ rollouts
def serve_status(running: int, state: str = "UPDATING") -> dict[str, Any]:
    """Serve's status of app ``m`` with ``running`` replicas of its engine deployment running."""
    from types import SimpleNamespace as NS

    return {"m": NS(status=NS(value="RUNNING" if state == "HEALTHY" else "DEPLOYING"), deployments={
        "LLMServer:m": NS(status=NS(value=state), replica_states={"RUNNING": running, "STARTING": 2 - running},
                          message="")})}


async def test_while_replicas_are_replaced_the_capacity_counts_only_the_running_ones(tmp_path) -> None:
    model = {"name": "m", "source": "builtin:tiny-random", "overflow": {"threshold_ms": 1000},
             "deployment": {"replicas": 2, "max_ongoing_requests": 4, "request_timeout_s": 10}}
    app = make_gateway(tmp_path, local_never, {"p": local_never}, extra={"models": [model]})
    gw = app.state.gateway
    m = gw.models["m"]
    gw.health.app_names = {"m": "m"}
    assert m.app.capacity == 8
    gw.health.refresh_from(serve_status(running=1))
    assert (m.app.capacity, m.local.tracker.capacity) == (4, 4)
    client = await started_client(app)
    state = (await client.get("/admin/state", headers=ADMIN)).json()["models"]["m"]
    assert state["capacity"] == 4
    for _ in range(6):  # six requests in flight: over the half capacity left, under the whole
        m.local.tracker.on_start()
    during = gw.router.estimate(m)
    gw.health.refresh_from(serve_status(running=2, state="HEALTHY"))
    assert (m.app.capacity, m.local.tracker.capacity) == (8, 8)
    assert during > gw.router.estimate(m)  # the same load, counted against half the capacity: a longer wait


# (new deployment/engine keys, Serve's replicas running after the version, state, the capacity counted)
CAPACITY_CASES = [
    ({"replicas": 4}, {}, 2, "UPSCALING", 8),  # scaling up: half of the new four run, what ran before
    ({"replicas": 4}, {}, 4, "HEALTHY", 16),
    ({"replicas": 1}, {}, 1, "HEALTHY", 4),  # scaled down
    ({"replicas": 2, "max_ongoing_requests": 2}, {}, 2, "HEALTHY", 4),
    ({"replicas": 2}, {"max_num_seqs": 3}, 2, "HEALTHY", 6),  # the new engines run 3 each
    ({"replicas": 2}, {"max_num_seqs": 3}, 1, "UPDATING", 3),  # one of two replaced: half of the new capacity
]


@pytest.mark.parametrize(("deployment", "engine", "running", "state", "capacity"), CAPACITY_CASES)
async def test_a_new_versions_replicas_and_engine_options_set_the_capacity_counted(
        tmp_path, deployment: dict, engine: dict, running: int, state: str, capacity: int) -> None:
    model = {"name": "m", "source": "builtin:tiny-random", "overflow": {"threshold_ms": 1000},
             "deployment": {"replicas": 2, "max_ongoing_requests": 4, "request_timeout_s": 10}}
    app = make_gateway(tmp_path, local_never, {"p": local_never}, extra={"models": [model]})
    gw = app.state.gateway
    gw.health.app_names = {"m": "m"}
    gw.health.refresh_from(serve_status(running=2, state="HEALTHY"))
    assert gw.models["m"].app.capacity == 8
    live = LiveFleet(running_fleet(app), gw.router, gw.providers, gw.clients)
    new = live.fleet.model_dump(mode="json")
    new["models"][0]["deployment"].update(deployment)
    new["models"][0]["engine"].update(engine)
    taken = live.take(parse_config(new))
    assert taken.ignored == [] and taken.applied
    gw.health.refresh_from(serve_status(running=running, state=state))
    m = gw.models["m"]
    assert (m.app.capacity, m.local.tracker.capacity) == (capacity, capacity)
    assert m.app.cfg.deployment == parse_config(new).models[0].deployment


async def test_a_budget_cap_changes_live_where_the_gateway_holds_a_spend_store(tmp_path) -> None:
    from lmfleet.store import caps_for_budget

    app = make_gateway(tmp_path, lambda req: httpx.Response(200, json=chat_json("m")),
                       {"p": lambda req: httpx.Response(200, json=chat_json("p-model"))},
                       extra={"budget": {"hourly_usd": 100.0}})
    gw = app.state.gateway
    c = await started_client(app)
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers=ADMIN)
    assert (await c.post("/v1/chat/completions", json=CHAT)).headers["x-lmfleet-served-by"] == "provider/p"
    live = LiveFleet(running_fleet(app), gw.router, gw.providers, gw.clients)
    taken = live.take(changed(live.fleet, budget__hourly_usd=0.0))
    assert [ch.path for ch in taken.applied] == ["budget.hourly_usd"]
    assert gw.router.budget.hourly_usd == 0.0 and gw.router.guard.caps == caps_for_budget(gw.router.budget)
    # the cap is spent: the next request stays local (on_exhausted: queue)
    assert (await c.post("/v1/chat/completions", json=CHAT)).headers["x-lmfleet-served-by"] == "local/m"


async def test_a_provider_added_and_one_removed(tmp_path) -> None:
    from lmfleet.testing.gateway_fakes import fake_backend

    app = make_gateway(tmp_path, local_never, {"p": lambda req: httpx.Response(200, json=chat_json("p-model"))})
    gw = app.state.gateway
    c = await started_client(app)
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers=ADMIN)
    old_p = gw.providers["p"]
    live = LiveFleet(running_fleet(app), gw.router, gw.providers, gw.clients)
    data = live.fleet.model_dump(mode="json")
    q = {"name": "q", "base_url": fake_backend(lambda req: httpx.Response(200, json=chat_json("q-model"))) + "/v1",
         "model_map": {"m": "q-model"}, "price": {"input_per_1m": 5.0}}
    data["providers"] = [q]
    taken = live.take(parse_config(data))
    assert [ch.path for ch in taken.applied] == ["providers[q]", "providers[p]"]
    assert list(gw.providers) == ["q"] and gw.models["m"].providers == [gw.providers["q"]]
    assert gw.providers["q"].client in gw.clients  # closed with the gateway
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "provider/q"
    assert old_p.in_flight == 0


# ------------------------------------------------------------------------------------------------ tenants
async def test_a_kept_tenants_new_settings_apply_unless_an_operator_set_them(tmp_path) -> None:
    (tmp_path / "a.keys").write_text("sk-tenant-a-1\n")
    (tmp_path / "b.keys").write_text("sk-tenant-b-1\n")
    tenants = [{"name": n, "api_keys_file": str(tmp_path / f"{n}.keys"), "limits": {"max_concurrency": 4}}
               for n in ("a", "b")]
    app = make_gateway(tmp_path, local_never, {"p": local_never}, extra={"tenants": tenants})
    gw = app.state.gateway
    c = await started_client(app)  # the lifespan builds the tenant admin
    admin = app.state.tenant_admin
    r = await c.put("/admin/tenants/b", json={"limits": {"max_concurrency": 1}}, headers=ADMIN)
    assert r.status_code == 200, r.text
    running = parse_config({**running_fleet(app).model_dump(mode="json"), "tenants": tenants})
    live = LiveFleet(running, gw.router, gw.providers, gw.clients, tenant_admin=admin)
    new = live.fleet.model_dump(mode="json")
    for t in new["tenants"]:
        t["limits"]["max_concurrency"] = 2
        t["limits"]["requests_per_minute"] = 60
    taken = live.take(parse_config(new))
    assert taken.ignored == [] and len(taken.applied) == 4
    a, b = gw.tenants.tenants["a"], gw.tenants.tenants["b"]
    assert (a.limits.max_concurrency, a.limits.requests_per_minute) == (2, 60)
    assert gw.tenants.resolve("sk-tenant-a-1") is a  # its keys resolve to the new settings
    assert b.limits.max_concurrency == 1  # the operator's run-time setting holds b ...
    r = await c.delete("/admin/tenants/b", headers=ADMIN)
    assert r.status_code == 200, r.text
    assert gw.tenants.tenants["b"].limits.max_concurrency == 2  # ... until reverted: to the new version's


# ------------------------------------------------------------------------------------------------ models
async def test_a_model_added_is_served_and_a_model_removed_takes_no_new_request(tmp_path) -> None:
    from lmfleet.engine.app import resolve_model
    from lmfleet.gateway.routing.live import NewModels

    app = make_gateway(tmp_path, lambda req: httpx.Response(200, json=chat_json("m")),
                       {"p": lambda req: httpx.Response(200, json=chat_json("p-model"))})
    gw = app.state.gateway
    c = await started_client(app)
    prepared: list[str] = []

    def prepare(f):  # what gateway_model_apps does, without weights
        prepared.extend(m.name for m in f.models)
        return [(resolve_model(m, str(tmp_path / "no-weights")), None) for m in f.models]

    live = LiveFleet(running_fleet(app), gw.router, gw.providers, gw.clients, health=gw.health,
                     new_models=NewModels(prepare, gw.new_model.make))
    data = live.fleet.model_dump(mode="json")
    data["models"].append({**data["models"][0], "name": "n"})
    data["providers"][0]["model_map"]["n"] = "p-n"
    taken = await live.take_version(parse_config(data))
    assert {ch.path for ch in taken.applied} == {"models[n]", "providers[p].model_map"} and prepared == ["n"]
    assert gw.models["n"].providers == [gw.providers["p"]] and gw.health.app_names["n"] == "lmfleet-n"
    r = await c.post("/v1/chat/completions", json={**CHAT, "model": "n"})
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/n"

    data["models"] = [m for m in data["models"] if m["name"] != "m"]
    data["providers"][0]["model_map"] = {"n": "p-n"}
    taken = await live.take_version(parse_config(data))
    assert {(ch.path, ch.cost) for ch in taken.applied} == {("models[m]", "model removed"),
                                                             ("providers[p].model_map", "none")}
    assert "m" not in gw.models and "m" not in gw.health.models
    assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 404
    assert (await c.get("/ready")).status_code == 200  # the removed model is not waited for
    gw.health.mark_failed("m", "a request it admitted earlier failed")
    assert "m" not in gw.health.models


async def test_a_model_added_without_a_way_to_serve_it_here_waits_for_a_restart(tmp_path) -> None:
    app = make_gateway(tmp_path, local_never, {"p": local_never})
    gw = app.state.gateway
    live = LiveFleet(running_fleet(app), gw.router, gw.providers, gw.clients)  # no NewModels
    data = live.fleet.model_dump(mode="json")
    data["models"].append({**data["models"][0], "name": "n"})
    taken = await live.take_version(parse_config(data))
    assert taken.applied == [] and [ch.path for ch in taken.ignored] == ["models[n]"] and "n" not in gw.models



async def test_a_model_that_cannot_be_prepared_here_leaves_the_other_changes_applied(tmp_path) -> None:
    from lmfleet.gateway.routing.live import NewModels

    app = make_gateway(tmp_path, local_never, {"p": local_never})
    gw = app.state.gateway

    def prepare(f):
        raise OSError("no weights here")

    live = LiveFleet(running_fleet(app), gw.router, gw.providers, gw.clients, health=gw.health,
                     new_models=NewModels(prepare, gw.new_model.make))
    data = live.fleet.model_dump(mode="json")
    data["models"].append({**data["models"][0], "name": "n"})
    data["models"][0]["overflow"]["threshold_ms"] = 123.0
    taken = await live.take_version(parse_config(data))
    assert [ch.path for ch in taken.ignored] == ["models[n]"] and "n" not in gw.models
    assert gw.models["m"].threshold_ms == 123.0


@pytest.mark.parametrize(("stream", "policy"), [(False, {}), (True, {}), (True, {"policy": "ttft_timeout", "ttft_timeout_ms": 50000}),
                                             (True, {"policy": "hedge", "hedge_after_ms": 50000})])
async def test_requests_waiting_in_serve_for_a_replaced_only_replica_move_to_a_provider(tmp_path, stream,
                                                                                      policy) -> None:
    """The only replica is replaced (``lmfleet apply`` of an engine option): a request routed locally just before
    waits in Serve's queue for the successor. Once Serve's status shows no replica running or finishing
    requests, it goes to the provider at once, not into its request timeout."""
    reached = threading.Event()  # the fake runs in a thread of its own

    async def serve_queue(req: httpx.Request) -> httpx.Response:  # Serve holding the request: no replica
        reached.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    model = {"name": "m", "source": "builtin:tiny-random",
             "overflow": {"threshold_ms": 1000, "local_first_token_timeout_s": 60, **policy},
             "deployment": {"replicas": 1, "max_ongoing_requests": 4, "request_timeout_s": 120}}
    app = make_gateway(tmp_path, serve_queue, {"p": lambda req: httpx.Response(200, json=chat_json("p-model"))},
                       extra={"models": [model]})
    gw = app.state.gateway
    gw.health.app_names = {"m": "m"}
    m = gw.models["m"]
    c = await started_client(app)
    sent = asyncio.ensure_future(c.post("/v1/chat/completions", json={**CHAT, "stream": stream}))
    await asyncio.wait_for(asyncio.to_thread(reached.wait, 5), 6)
    assert len(m.local.waiting) == 1
    stopping = {"m": serve_status(running=0)["m"]}
    stopping["m"].deployments["LLMServer:m"].replica_states = {"STOPPING": 1, "STARTING": 1}
    gw.health.refresh_from(stopping)  # the old replica still finishes what it holds: the request may be on it
    await asyncio.sleep(0.05)
    assert not sent.done() and len(m.local.waiting) == 1
    gw.health.refresh_from({"m": serve_status(running=0)["m"]})  # only the successor, starting
    r = await asyncio.wait_for(sent, 5)
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "provider/p"
    if not policy:  # under ttft_timeout and hedge the race reports its own reason
        assert r.headers["x-lmfleet-route-reason"] == "fallback_after_local_error"
    assert len(m.local.waiting) == 0 and m.local.tracker.snapshot().in_flight == 0


async def test_a_request_not_waiting_for_a_replica_is_left_alone(tmp_path) -> None:
    """Without a provider after it, a local request waits for the successor (nowhere else to go)."""
    reached, answer = threading.Event(), threading.Event()  # the fake runs in a thread of its own

    async def serve_queue(req: httpx.Request) -> httpx.Response:
        reached.set()
        while not answer.is_set():
            await asyncio.sleep(0.01)
        return httpx.Response(200, json=chat_json("m"))

    app = make_gateway(tmp_path, serve_queue, {})
    gw = app.state.gateway
    gw.health.app_names = {"m": "m"}
    c = await started_client(app)
    sent = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
    await asyncio.wait_for(asyncio.to_thread(reached.wait, 5), 6)
    gw.health.refresh_from({"m": serve_status(running=0)["m"]})
    await asyncio.sleep(0.05)
    assert not sent.done() and len(gw.models["m"].local.waiting) == 0
    answer.set()
    r = await asyncio.wait_for(sent, 5)
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/m"
