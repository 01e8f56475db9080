"""``overflow.prefill_gate``: the gate itself (first come first served, its limit, leaving, timeouts and
cancellation), and wired into the gateway against a fake engine: one streamed prompt upstream before its first
token, the held one counted as prefill work ahead, the admin switch, the config key and where ``auto`` turns it on."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from lmfleet.config.diff import APPLIED_LIVE
from lmfleet.gateway.relay.prefillgate import PrefillGate, gate_on
from lmfleet.testing.gateway_fakes import make_gateway, sse_events, started_client, stream_response
from tests.unit.test_gateway_routing import CHAT, ok_local

STREAM = {**CHAT, "stream": True}
ADMIN = {"authorization": "Bearer adm"}

pytestmark = pytest.mark.usefixtures("close_started_gateways")


# ---- the gate ------------------------------------------------------------------------------------------------
async def test_keys_enter_one_at_a_time_in_arrival_order():
    gate, order = PrefillGate(), []

    async def one(k: str) -> None:
        assert await gate.enter(k)
        order.append(k)
        await asyncio.sleep(0.01)
        gate.leave(k)

    assert await gate.enter("first")
    tasks = [asyncio.create_task(one(k)) for k in "abc"]
    await asyncio.sleep(0.01)
    assert (gate.holding, gate.waiting, order) == (1, 3, [])
    gate.leave("first")
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c"] and (gate.holding, gate.waiting) == (0, 0)


@pytest.mark.parametrize("limit,enter_at_once", [(1, 1), (2, 2), (3, 3), (0, 1)])
async def test_the_limit_is_how_many_hold_it_at_once(limit, enter_at_once):
    gate = PrefillGate(limit)
    tasks = [asyncio.create_task(gate.enter(k)) for k in range(4)]
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in tasks) == enter_at_once and gate.holding == enter_at_once
    for k in range(4):
        gate.leave(k)
    await asyncio.gather(*tasks)
    assert (gate.holding, gate.waiting) == (0, 0)


async def test_raising_the_limit_lets_waiting_keys_in():
    gate = PrefillGate(1)
    assert await gate.enter("a")
    waiting = asyncio.create_task(gate.enter("b"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    gate.limit = 2
    assert await waiting and gate.holding == 2


async def test_a_timed_out_or_cancelled_waiter_holds_nothing_and_the_next_one_enters():
    gate = PrefillGate()
    assert await gate.enter("a")
    assert await gate.enter("late", timeout_s=0.01) is False
    cancelled = asyncio.create_task(gate.enter("gone"))
    nxt = asyncio.create_task(gate.enter("next"))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    gate.leave("a")
    assert await nxt and gate.holding == 1 and gate.waiting == 0


async def test_leave_is_idempotent_and_a_key_that_leaves_while_waiting_is_not_let_in():
    gate = PrefillGate()
    assert await gate.enter("a")
    assert await gate.enter("a")  # a holder entering again holds it once
    waiting = asyncio.create_task(gate.enter("b"))
    await asyncio.sleep(0.01)
    gate.leave("b")  # its attempt ended before its turn came
    assert await waiting is False
    gate.leave("a")
    gate.leave("a")
    assert (gate.holding, gate.waiting) == (0, 0)


# ---- in the gateway ------------------------------------------------------------------------------------------
def first_token_after(delay_s: float, started: list[float]):
    async def handler(req: httpx.Request) -> httpx.Response:
        started.append(time.monotonic())
        await asyncio.sleep(delay_s)
        return stream_response(sse_events(json.loads(req.content)["model"], ["Par", "is"]))
    return handler


async def _two_at_once(tmp_path, gate: bool) -> tuple[list[float], list[int], list[tuple]]:
    """Two streamed requests at once, local only: when each reached the engine, and the prefill work ahead and the
    gate's queue that the gateway counted while the second waited."""
    started: list[float] = []
    app = make_gateway(tmp_path, first_token_after(0.4, started))
    c = await started_client(app)
    r = await c.post("/admin/overflow", json={"model": "m", "mode": "force_off", "prefill_gate": gate}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["models"]["m"]["prefill_gate"] is gate
    m = app.state.gateway.models["m"]
    pending: list[int] = []
    queues: list[tuple] = []

    async def watch() -> None:
        await asyncio.sleep(0.2)
        pending.append(m.local.tracker.snapshot().pending_prefill_tokens)
        queues.append(m.local.tracker.snapshot().gate_queue)
        gate_state = (await c.get("/admin/state", headers=ADMIN)).json()["models"]["m"]["prefill_gate"]
        assert gate_state == ({"holding": 1, "waiting": 1, "limit": 1} if gate else None)

    rs = await asyncio.gather(c.post("/v1/chat/completions", json=STREAM),
                              c.post("/v1/chat/completions", json=STREAM), watch())
    assert all(r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/m" for r in rs[:2])
    assert m.local.tracker.in_flight == 0 and (m.local.gate.holding, m.local.gate.waiting) == (0, 0)
    return started, pending, queues


async def test_with_the_gate_the_second_prompt_reaches_the_engine_after_the_first_ones_first_token(tmp_path):
    started, pending, queues = await _two_at_once(tmp_path, gate=True)
    assert len(started) == 2 and started[1] - started[0] >= 0.35
    assert pending[0] > 0 and pending[0] % 2 == 0  # both prompts (same length) counted as work ahead
    # the gate's queue as the estimate sees it: the first through the gate ~0.2 s ago, the second held
    [((tokens, elapsed), (tokens2, held))] = queues
    assert tokens == tokens2 == pending[0] // 2 and 0.1 < elapsed < 0.4 and held is None


async def test_without_the_gate_both_prompts_reach_the_engine_at_once(tmp_path):
    started, _, queues = await _two_at_once(tmp_path, gate=False)
    assert len(started) == 2 and started[1] - started[0] < 0.3 and queues == [()]


async def test_a_unary_request_does_not_pass_the_gate(tmp_path):
    started: list[float] = []

    async def handler(req: httpx.Request) -> httpx.Response:
        started.append(time.monotonic())
        if json.loads(req.content).get("stream"):
            await asyncio.sleep(0.4)
            return stream_response(sse_events("m", ["Par", "is"]))
        return ok_local(req)

    app = make_gateway(tmp_path, handler)
    c = await started_client(app)
    await c.post("/admin/overflow", json={"model": "m", "mode": "force_off", "prefill_gate": True}, headers=ADMIN)
    streamed = asyncio.create_task(c.post("/v1/chat/completions", json=STREAM))
    await asyncio.sleep(0.1)
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and len(started) == 2 and not streamed.done()
    assert (await streamed).status_code == 200


async def test_a_client_that_leaves_while_held_frees_the_gate_and_its_slot(tmp_path):
    started: list[float] = []
    app = make_gateway(tmp_path, first_token_after(0.4, started))
    c = await started_client(app)
    await c.post("/admin/overflow", json={"model": "m", "mode": "force_off", "prefill_gate": True}, headers=ADMIN)
    m = app.state.gateway.models["m"]
    first = asyncio.create_task(c.post("/v1/chat/completions", json=STREAM))
    await asyncio.sleep(0.1)
    held = asyncio.create_task(c.post("/v1/chat/completions", json=STREAM))
    await asyncio.sleep(0.1)
    assert m.local.gate.waiting == 1
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert (await first).status_code == 200
    for _ in range(50):  # the cancelled request's cleanup runs on the gateway's side
        if m.local.tracker.in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert m.local.tracker.in_flight == 0 and (m.local.gate.holding, m.local.gate.waiting) == (0, 0)
    assert len(started) == 1


async def test_admin_refuses_a_prefill_gate_that_is_not_a_boolean_or_auto(tmp_path):
    app = make_gateway(tmp_path, ok_local)
    c = await started_client(app)
    r = await c.post("/admin/overflow", json={"model": "m", "prefill_gate": "yes"}, headers=ADMIN)
    assert r.status_code == 400 and "prefill_gate" in r.text and '"auto"' in r.json()["error"]["message"]


# ---- where it is on ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,parsed", [(None, "auto"), ("auto", "auto"), (True, True), (False, False)])
def test_the_config_key_is_true_false_or_auto(value, parsed):
    from lmfleet.config import parse_config
    overflow = {} if value is None else {"prefill_gate": value}
    fleet = parse_config({"models": [{"name": "m", "source": "builtin:tiny-random", "overflow": overflow}]})
    assert fleet.models[0].overflow.prefill_gate == parsed


def test_a_config_value_that_is_not_true_false_or_auto_names_the_key_and_the_choices():
    from lmfleet.config import ConfigError, parse_config
    with pytest.raises(ConfigError) as e:
        parse_config({"models": [{"name": "m", "source": "builtin:tiny-random", "overflow": {"prefill_gate": "on"}}]})
    assert "models[0].overflow.prefill_gate" in str(e.value) and "'auto'" in str(e.value)


@pytest.mark.parametrize("setting,device,has_provider,on", [
    ("auto", "cpu", True, True),     # a CPU engine's step is long against the threshold
    ("auto", "gpu", True, False),    # a GPU engine's is not
    ("auto", "cpu", False, False),   # no provider: the estimate decides nothing the gate would pay for
    ("auto", "gpu", False, False),
    (True, "gpu", False, True),      # true and false hold either way
    (True, "cpu", True, True),
    (False, "cpu", True, False),
    (False, "gpu", True, False),
])
def test_where_the_gate_is_on(setting, device, has_provider, on):
    assert gate_on(setting, device, has_provider) is on


@pytest.mark.parametrize("providers,device,on", [({"p": ok_local}, "cpu", True), ({}, "cpu", False),
                                                 ({"p": ok_local}, "gpu", False)])
async def test_auto_is_the_default_and_follows_the_models_engine_and_providers(tmp_path, providers, device, on):
    from dataclasses import replace
    app = make_gateway(tmp_path, ok_local, providers)
    c = await started_client(app)
    m = app.state.gateway.models["m"]
    m.app = replace(m.app, device=device)
    assert m.prefill_gate == "auto" and m.gated is on
    state = (await c.get("/admin/state", headers=ADMIN)).json()["models"]["m"]
    assert state["prefill_gate_setting"] == "auto" and (state["prefill_gate"] is not None) is on
    r = await c.post("/admin/overflow", json={"model": "m", "prefill_gate": not on}, headers=ADMIN)
    assert (r.json()["models"]["m"]["prefill_gate"], r.json()["models"]["m"]["prefill_gate_on"]) == (not on, not on)
    r = await c.post("/admin/overflow", json={"model": "m", "prefill_gate": "auto"}, headers=ADMIN)
    assert (r.json()["models"]["m"]["prefill_gate"], r.json()["models"]["m"]["prefill_gate_on"]) == ("auto", on)


async def test_the_gate_comes_from_the_models_config_and_applies_live(tmp_path):
    model = {"name": "m", "source": "builtin:tiny-random", "deployment": {"max_ongoing_requests": 4},
             "overflow": {"prefill_gate": True}}
    app = make_gateway(tmp_path, ok_local, extra={"models": [model]})
    assert app.state.gateway.models["m"].prefill_gate is True
    assert "models[].overflow.prefill_gate" in APPLIED_LIVE


@pytest.mark.parametrize("running,limit", [(3, 3), (1, 1), (0, 1)])
def test_the_gate_lets_one_prompt_through_per_running_replica(tmp_path, running, limit):
    from lmfleet.gateway.routing.health import ModelHealth
    from lmfleet.gateway.routing.live import RunningCapacity

    app = make_gateway(tmp_path, ok_local)
    gw = app.state.gateway
    gw.health.models["m"] = ModelHealth(ready=running > 0, message="", running_replicas=running)
    RunningCapacity(gw.models, gw.health).update()
    assert gw.models["m"].local.gate.limit == limit


async def test_a_local_attempt_raced_by_the_hedge_timer_does_not_pass_the_gate(tmp_path):
    started: list[float] = []
    app = make_gateway(tmp_path, first_token_after(0.4, started), {"p": ok_local})
    c = await started_client(app)
    r = await c.post("/admin/overflow", json={"model": "m", "threshold_ms": 100000, "policy": "hedge",
                                              "hedge_after_ms": 5000, "prefill_gate": True}, headers=ADMIN)
    assert r.status_code == 200
    rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=STREAM) for _ in range(2)))
    assert all(r.headers["x-lmfleet-served-by"] == "local/m" for r in rs)
    assert len(started) == 2 and started[1] - started[0] < 0.3  # both at the engine at once: the timer runs there
