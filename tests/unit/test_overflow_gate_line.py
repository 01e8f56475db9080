"""The prefill gate's service line: the tracker's samples (gate to first token), the gate's queue in the signals,
and the estimate of a gated request (:func:`lmfleet.overflow.estimator.gate_wait_s`), table-tested."""

from __future__ import annotations

import dataclasses
import time

import pytest

from lmfleet.overflow.estimator import estimate_wait_ms, gate_wait_s
from lmfleet.overflow.signals import GATE_MIN_SAMPLES, LoadTracker, QueueSignals

BASE = QueueSignals(now=0.0, in_flight=0, drain_rps=2.0, output_tps=None, ttft_s=None, base_ttft_s=0.5,
                    completions_in_window=0, prefill_s_per_token=0.001, base_prefill_tokens=300.0,
                    gate_base_s=0.4, gate_base_tokens=200.0, gate_s_per_token=0.002)
"""A service line of 0.4 s at 200 tokens, 2 ms a token (0 s at 0 tokens); the prefill line 0.5 s at 300, 1 ms."""


def sig(**kw) -> QueueSignals:
    return dataclasses.replace(BASE, **kw)


@pytest.mark.parametrize("signals, prompt, limit, expected_s", [
    # nothing ahead: its own service, 100 tokens -> 0.2 s
    (sig(), 100, 1, 0.2),
    # one held prompt of 300 tokens ahead: 0.6 + 0.2
    (sig(gate_queue=((300, None),), pending_prefill_tokens=300, in_flight=1), 100, 1, 0.8),
    # the holder (200 tokens, 0.4 s) passed the gate 0.3 s ago: 0.1 left; a held one of 100: 0.2; own 0.2
    (sig(gate_queue=((200, 0.3), (100, None)), pending_prefill_tokens=300, in_flight=2), 100, 1, 0.5),
    # a holder past its service time counts 0, not less
    (sig(gate_queue=((200, 2.0),), pending_prefill_tokens=200, in_flight=1), 100, 1, 0.2),
    # two replicas: the queue ahead is shared between the two prompts let through at once
    (sig(gate_queue=((300, None), (300, None)), pending_prefill_tokens=600, in_flight=2), 100, 2, 0.8),
    # a prompt at the engine that did not pass the gate (a hedged attempt): the prefill line's slope, 500 x 1 ms
    (sig(gate_queue=((300, None),), pending_prefill_tokens=800, in_flight=2), 100, 1, 1.3),
    # a service line below 0 for tiny prompts counts 0 (intercept -0.4 s at 0 tokens with 4 ms a token)
    (sig(gate_s_per_token=0.004), 10, 1, 0.0),
    # a service line without a slope yet (its samples all short prompts): the prefill line's, 1 ms a token from
    # 0.4 s at 200 tokens; no slope anywhere: flat
    (sig(gate_s_per_token=None), 1200, 1, 1.4),
    (sig(gate_s_per_token=None, prefill_s_per_token=None), 1200, 1, 0.4),
    # no service line yet: the prefill line's TTFT of a prompt alone, 0.5 s at 300 tokens, 1 ms a token; own 0.3 s
    (sig(gate_base_s=None), 100, 1, 0.3),
    # ... and each held prompt a whole TTFT of its own: 3 x 0.3 s ahead, not 3 x 100 tokens x 1 ms
    (sig(gate_base_s=None, gate_queue=((100, None),) * 3, pending_prefill_tokens=300, in_flight=3), 100, 1, 1.2),
    # ... a prefill line without a slope yet: its median TTFT for each, flat: 2 x 0.5 s
    (sig(gate_base_s=None, prefill_s_per_token=None, gate_queue=((900, None),), pending_prefill_tokens=900,
         in_flight=1), 100, 1, 1.0),
    # no TTFT measured, or a stale prefill line: None (the cold defaults, or the prefill line, decide)
    (sig(gate_base_s=None, base_ttft_s=None), 100, 1, None),
    (sig(prefill_stale=True), 100, 1, None),
])
def test_gate_wait(signals, prompt, limit, expected_s):
    got = gate_wait_s(signals, prompt, limit)
    assert got == (None if expected_s is None else pytest.approx(expected_s))


@pytest.mark.parametrize("gated, expected_ms", [
    (True, 800.0),  # 0.6 + 0.2 s on the gate's line
    (False, 600.0),  # the prefill line: 0.5 + 1 ms x (400 - 300)
])
def test_the_estimate_of_a_gated_request_uses_the_gate_line(gated, expected_ms):
    s = sig(gate_queue=((300, None),), pending_prefill_tokens=300, in_flight=1)
    assert estimate_wait_ms(s, 8, prompt_tokens=100, gated=gated) == pytest.approx(expected_ms)


@pytest.mark.parametrize("queue, expected_ms", [
    ((), 1000.0 + 300.0),  # two completions ahead of a free slot at 2/s: 1 s, then the prefill line's 0.5 - 0.2 s
    (((300, None), (300, None)), 1000.0 + 900.0),  # and the held prompts' 600 tokens at 1 ms
])
def test_behind_a_full_engine_the_queue_term_and_the_prefill_line_decide(queue, expected_ms):
    s = sig(in_flight=9, gate_queue=queue, pending_prefill_tokens=sum(t for t, _ in queue))
    assert estimate_wait_ms(s, 8, prompt_tokens=100, gated=True) == pytest.approx(expected_ms)
    assert estimate_wait_ms(s, 8, prompt_tokens=100, gated=False) == pytest.approx(expected_ms)


def serve_gated(tr: LoadTracker, t: float, tokens: int, service_s: float) -> float:
    k = tr.on_start(tokens, now=t)
    tr.on_gate_wait(k)
    tr.on_gate_enter(k, now=t)
    tr.on_first_token(k, now=t + service_s)
    tr.on_finish(k, 4, now=t + service_s + 0.1)
    return t + service_s + 1.0


def test_the_tracker_fits_the_service_line_from_gated_prompts_only():
    tr, t = LoadTracker(8), 0.0
    for i in range(GATE_MIN_SAMPLES - 1):
        t = serve_gated(tr, t, 100 + 50 * i, 0.3 + 0.002 * (100 + 50 * i))
    k = tr.on_start(900, now=t)  # not gated (a hedged attempt, or the gate off): no service sample
    tr.on_first_token(k, now=t + 5.0)
    tr.on_finish(k, now=t + 5.1)
    t += 6.0
    assert tr.snapshot(now=t).gate_base_s is None  # one sample short
    t = serve_gated(tr, t, 600, 0.3 + 0.002 * 600)
    s = tr.snapshot(now=t)
    assert s.gate_s_per_token == pytest.approx(0.002) and \
        s.gate_base_s == pytest.approx(0.3 + 0.002 * s.gate_base_tokens)


def test_the_signals_list_the_gates_queue_in_arrival_order():
    tr = LoadTracker(8)
    a, b, c = (tr.on_start(n, now=0.0) for n in (200, 100, 300))
    for k in (a, b, c):
        tr.on_gate_wait(k)
    tr.on_gate_enter(a, now=1.0)
    assert tr.snapshot(now=1.5).gate_queue == ((200, 0.5), (100, None), (300, None))
    tr.on_first_token(a, now=2.0)
    tr.on_gate_enter(b, now=2.0)
    tr.on_finish(c, now=2.0)  # left while held (its client went away): out of the queue
    assert tr.snapshot(now=2.25).gate_queue == ((100, 0.25),)


async def test_the_router_prices_on_the_gate_line_only_a_request_that_would_pass_the_gate(tmp_path,
                                                                                         close_started_gateways):
    from lmfleet.overflow.policies import Policy, PolicyTimers
    from lmfleet.testing.gateway_fakes import make_gateway, started_client
    from tests.unit.test_gateway_routing import ok_local

    app = make_gateway(tmp_path, ok_local)
    await started_client(app)
    gw = app.state.gateway
    m = gw.models["m"]
    tr, t = m.local.tracker, time.monotonic() - 100.0
    for i in range(GATE_MIN_SAMPLES):  # every gated prompt took 1 s from the gate to its first token
        t = serve_gated(tr, t, 100 + 50 * i, 1.0)
    tr.on_gate_wait(tr.on_start(100))  # one prompt held in the gate
    m.prefill_gate = True
    assert gw.router.estimate(m) == pytest.approx(2000.0)  # the held prompt's second, then its own
    m.timers = PolicyTimers(Policy.HEDGE, hedge_after_ms=1500)  # hedged attempts race a timer: no gate
    assert gw.router.estimate(m) == pytest.approx(1000.0)  # the prefill line: 1 s, no slope
    m.timers, m.prefill_gate = PolicyTimers(), False
    assert gw.router.estimate(m) == pytest.approx(1000.0)


async def test_admin_switches_the_gate_line_and_refuses_a_value_that_is_not_a_boolean(tmp_path,
                                                                                       close_started_gateways):
    from lmfleet.testing.gateway_fakes import make_gateway, started_client
    from tests.unit.test_gateway_routing import ok_local

    admin = {"authorization": "Bearer adm"}
    app = make_gateway(tmp_path, ok_local)
    c = await started_client(app)
    r = await c.post("/admin/overflow", json={"model": "m", "gate_line": "no"}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "gate_line"
    assert app.state.gateway.models["m"].gate_line is True  # nothing changed
    r = await c.post("/admin/overflow", json={"model": "m", "gate_line": False}, headers=admin)
    assert r.status_code == 200 and r.json()["models"]["m"]["gate_line"] is False
    state = (await c.get("/admin/state", headers=admin)).json()["models"]["m"]
    assert state["gate_line"] is False and state["gate_service_line"] is None  # no gated prompt measured yet
