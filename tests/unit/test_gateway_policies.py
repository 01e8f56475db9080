"""overflow.policy wired into the gateway, against fake backends: the hedge race, the ttft_timeout failover,
on_error's local-first admission, and the admin switch. The decisions themselves: test_overflow_policies.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from lmfleet.overflow.policy import HysteresisState
from lmfleet.testing.gateway_fakes import make_gateway, sse_events, started_client, stream_response
from tests.unit.test_gateway_routing import CHAT, ok_local, provider_ok

STREAM = {**CHAT, "stream": True}
ADMIN = {"authorization": "Bearer adm"}

pytestmark = pytest.mark.usefixtures("close_started_gateways")


def slow(words: list[str], delay_s: float, calls: list | None = None):
    async def handler(req: httpx.Request) -> httpx.Response:
        if calls is not None:
            calls.append(1)
        await asyncio.sleep(delay_s)
        return stream_response(sse_events(json.loads(req.content)["model"], words))
    return handler


async def _policy(c, **body) -> httpx.Response:
    return await c.post("/admin/overflow", json={"model": "m", **body}, headers=ADMIN)


async def _rows(app) -> list[tuple[str, str, str, int, int]]:
    await app.state.gateway.recorder.flush()
    return sorted((r["served_by"], r["route_reason"], r["status"], r["input_tokens"], r["output_tokens"])
                  for r in app.state.gateway.recorder.ledger.rows())


def _count(app, metric: str, **labels) -> float:
    return app.state.gateway.metrics.registry.get_sample_value(metric, labels) or 0.0


async def test_hedge_after_its_timer_the_provider_wins_and_the_local_attempt_is_cancelled(tmp_path):
    app = make_gateway(tmp_path, slow(["late"], 3.0), {"p": provider_ok})
    c = await started_client(app)
    assert (await _policy(c, policy="hedge", hedge_after_ms=200)).status_code == 200
    r = await c.post("/v1/chat/completions", json=STREAM)
    assert r.status_code == 200 and "Remote" in r.text
    assert r.headers["x-lmfleet-served-by"] == "provider/p"
    assert r.headers["x-lmfleet-route-reason"] == "hedge_won"
    assert r.headers["x-lmfleet-hedged"] == "1"
    rows = await _rows(app)
    assert [(s, why, st) for s, why, st, *_ in rows] == [("local/m", "hedge_cancelled", "499"),
                                                         ("provider/p", "hedge_won", "200")]
    assert rows[0][3] > 0  # the cancelled attempt's prompt is in the ledger
    assert app.state.gateway.models["m"].local.tracker.in_flight == 0
    assert _count(app, "lmfleet_hedges_total", model="m", outcome="started") == 1
    assert _count(app, "lmfleet_hedges_total", model="m", outcome="won") == 1


async def test_hedge_the_local_first_token_wins_and_the_provider_attempt_is_cancelled_and_paid(tmp_path):
    app = make_gateway(tmp_path, slow(["Par", "is"], 0.6), {"p": slow(["Remote"], 3.0)})
    c = await started_client(app)
    await _policy(c, policy="hedge", hedge_after_ms=200)
    r = await c.post("/v1/chat/completions", json=STREAM)
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/m"
    assert r.headers["x-lmfleet-route-reason"] == "hedge_local_won" and r.headers["x-lmfleet-hedged"] == "1"
    rows = await _rows(app)
    assert [(s, why, st) for s, why, st, *_ in rows] == [("local/m", "hedge_local_won", "200"),
                                                         ("provider/p", "hedge_cancelled", "499")]
    await app.state.gateway.recorder.flush()
    cost = {r["served_by"]: r["cost_usd"] for r in app.state.gateway.recorder.ledger.rows()}
    assert cost["provider/p"] > 0  # the loser's prompt is paid for
    assert app.state.gateway.providers["p"].in_flight == 0
    assert _count(app, "lmfleet_hedges_total", model="m", outcome="lost") == 1


async def test_hedge_a_fast_local_answer_starts_no_hedge(tmp_path):
    app = make_gateway(tmp_path, ok_local, {"p": provider_ok})
    c = await started_client(app)
    await _policy(c, policy="hedge", hedge_after_ms=500)
    r = await c.post("/v1/chat/completions", json=STREAM)
    assert r.headers["x-lmfleet-served-by"] == "local/m" and "x-lmfleet-hedged" not in r.headers
    assert r.headers["x-lmfleet-route-reason"] == "local_ok"
    assert _count(app, "lmfleet_hedges_total", model="m", outcome="started") == 0


async def test_hedge_that_fails_leaves_the_local_attempt_to_answer(tmp_path):
    app = make_gateway(tmp_path, slow(["Par", "is"], 0.8), {"p": lambda req: httpx.Response(400, json={})})
    c = await started_client(app)
    await _policy(c, policy="hedge", hedge_after_ms=200)
    r = await c.post("/v1/chat/completions", json=STREAM)
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/m"
    assert _count(app, "lmfleet_hedges_total", model="m", outcome="failed") == 1
    assert app.state.gateway.providers["p"].in_flight == 0


async def test_ttft_timeout_cancels_the_local_attempt_and_fails_over(tmp_path):
    calls: list = []
    app = make_gateway(tmp_path, slow(["late"], 3.0, calls), {"p": provider_ok})
    c = await started_client(app)
    await _policy(c, policy="ttft_timeout", ttft_timeout_ms=300)
    r = await c.post("/v1/chat/completions", json=STREAM)
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "provider/p"
    assert r.headers["x-lmfleet-route-reason"] == "ttft_timeout" and "x-lmfleet-hedged" not in r.headers
    assert len(calls) == 1  # no local retry after the timer
    rows = await _rows(app)
    assert [(s, why, st) for s, why, st, *_ in rows] == [("local/m", "ttft_timeout_cancelled", "499"),
                                                         ("provider/p", "ttft_timeout", "200")]
    assert app.state.gateway.models["m"].local.tracker.in_flight == 0
    assert _count(app, "lmfleet_ttft_timeout_failovers_total", model="m", outcome="started") == 1
    assert _count(app, "lmfleet_ttft_timeout_failovers_total", model="m", outcome="served") == 1


@pytest.mark.parametrize("policy,timer", [("ttft_timeout", {"ttft_timeout_ms": 1}), ("on_error", {})])
async def test_local_first_policies_keep_a_request_local_whatever_the_estimate(tmp_path, policy, timer):
    app = make_gateway(tmp_path, ok_local, {"p": provider_ok})
    c = await started_client(app)
    await _policy(c, threshold_ms=0.001)
    app.state.gateway.models["m"].local.tracker.on_start()  # one in flight: every estimate is above it
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.headers["x-lmfleet-served-by"] == "provider/p"
    await _policy(c, policy=policy, **timer)
    r = await c.post("/v1/chat/completions", json=CHAT)  # unary: no timer race, the admission rule only
    assert r.headers["x-lmfleet-served-by"] == "local/m" and r.headers["x-lmfleet-route-reason"] == "local_first"


async def test_on_error_a_local_5xx_goes_to_the_provider_without_a_local_retry(tmp_path):
    calls: list = []

    def down(req):
        calls.append(1)
        return httpx.Response(503, json={"error": {"message": "busy"}})

    app = make_gateway(tmp_path, down, {"p": provider_ok})
    c = await started_client(app)
    await _policy(c, policy="on_error")
    r = await c.post("/v1/chat/completions", json=STREAM)
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "provider/p"
    assert r.headers["x-lmfleet-route-reason"] == "fallback_after_local_error"
    assert len(calls) == 1


@pytest.mark.parametrize("body,fragment", [
    ({"policy": "sometimes"}, "policy must be one of"),
    ({"policy": "hedge"}, "needs hedge_after_ms"),
    ({"policy": "ttft_timeout", "ttft_timeout_ms": -5}, "needs ttft_timeout_ms > 0"),
])
async def test_admin_refuses_a_bad_policy(tmp_path, body, fragment):
    c = await started_client(make_gateway(tmp_path, ok_local, {"p": provider_ok}))
    r = await _policy(c, **body)
    assert r.status_code == 400 and fragment in r.text


async def test_admin_refuses_a_policy_without_a_provider(tmp_path):
    c = await started_client(make_gateway(tmp_path, ok_local))
    r = await _policy(c, policy="on_error")
    assert r.status_code == 400 and "needs a provider" in r.text


async def test_admin_sets_and_reports_the_policy(tmp_path):
    app = make_gateway(tmp_path, ok_local, {"p": provider_ok})
    c = await started_client(app)
    r = await _policy(c, policy="hedge", hedge_after_ms=800)
    assert r.json()["models"]["m"]["policy"] == "hedge" and r.json()["models"]["m"]["hedge_after_ms"] == 800
    r = await _policy(c, policy="predictive", hedge_after_ms=None)
    assert r.json()["models"]["m"]["policy"] == "predictive"


async def test_the_policy_comes_from_the_models_config(tmp_path):
    model = {"name": "m", "source": "builtin:tiny-random",
             "deployment": {"max_ongoing_requests": 4, "request_timeout_s": 10},
             "overflow": {"threshold_ms": 1000, "local_first_token_timeout_s": 2, "policy": "ttft_timeout",
                          "ttft_timeout_ms": 300}}
    app = make_gateway(tmp_path, slow(["late"], 3.0), {"p": provider_ok}, extra={"models": [model]})
    c = await started_client(app)
    r = await c.post("/v1/chat/completions", json=STREAM)
    assert r.headers["x-lmfleet-served-by"] == "provider/p" and r.headers["x-lmfleet-route-reason"] == "ttft_timeout"


@pytest.mark.parametrize("may_pay,served_by,hedged", [(False, "local/m", False), (True, "provider/p", True)])
async def test_a_batch_request_is_hedged_only_when_its_tenant_may_pay(tmp_path, may_pay, served_by, hedged):
    from tests.unit.test_gateway_tenants import key, tenant_gateway

    app = tenant_gateway(tmp_path, {"a": {"priority": "batch", "batch_may_use_providers": may_pay}},
                         local=slow(["late"], 1.0), providers={"p": provider_ok})
    c = await started_client(app)
    await _policy(c, policy="hedge", hedge_after_ms=100)
    r = await c.post("/v1/chat/completions", json=STREAM, headers=key("a"))
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == served_by
    assert ("x-lmfleet-hedged" in r.headers) is hedged


async def test_the_miss_margin_moves_the_decision_not_the_estimate(tmp_path):
    app = make_gateway(tmp_path, ok_local, {"p": provider_ok})  # threshold 1000 ms; idle: cold estimate 1000 ms
    c = await started_client(app)
    m = app.state.gateway.models["m"]
    for _ in range(8):  # recent requests predicted at 1000 ms waited 1600: margin 600, capped at threshold/2
        m.margin.observe(predicted_ms=1000, realised_ms=1600, threshold_ms=m.threshold_ms)
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.headers["x-lmfleet-served-by"] == "provider/p"
    assert r.headers["x-lmfleet-route-reason"] == "queue_estimate_above_threshold"
    assert r.headers["x-lmfleet-queue-estimate-ms"] == "1000"  # the estimate itself; 1000 + 500 decided
    assert (await c.get("/admin/state", headers=ADMIN)).json()["models"]["m"]["miss_margin_ms"] == 500
    assert _count(app, "lmfleet_overflow_miss_margin_ms", model="m") == 500
    await _policy(c, threshold_ms=2500)  # the samples (predicted 1000) are not near 2500: no margin, kept local
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.headers["x-lmfleet-served-by"] == "local/m" and len(m.margin) == 8
    assert (await c.get("/admin/state", headers=ADMIN)).json()["models"]["m"]["miss_margin_ms"] == 0


async def test_the_miss_floor_spills_an_estimate_just_under_the_threshold_when_the_samples_say_it_was_right(tmp_path):
    app = make_gateway(tmp_path, ok_local, {"p": provider_ok})  # threshold 1000 ms; idle: cold estimate 1000 ms
    c = await started_client(app)
    await _policy(c, threshold_ms=1100)
    m = app.state.gateway.models["m"]
    for _ in range(8):  # recent requests predicted at 1000 ms waited 900: the learned quantile is under 0
        m.margin.observe(predicted_ms=1000, realised_ms=900, threshold_ms=1100)
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.headers["x-lmfleet-served-by"] == "provider/p"  # 1000 + the floor, 0.15 x 1100, > 1100
    assert (await c.get("/admin/state", headers=ADMIN)).json()["models"]["m"]["miss_margin_ms"] == 165
    r = await _policy(c, miss_floor=0)
    assert r.status_code == 200 and r.json()["models"]["m"]["miss_floor"] == 0
    m.hysteresis = HysteresisState(overflowing=False)  # the spill left it overflowing down to 880 ms
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.headers["x-lmfleet-served-by"] == "local/m"  # the learned margin alone: 0
    for bad in (0.6, -1, "0.1", True):
        r = await _policy(c, miss_floor=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "miss_floor"
    assert (await c.get("/admin/state", headers=ADMIN)).json()["models"]["m"]["miss_floor"] == 0


async def test_the_miss_floor_applies_to_an_idle_engine_once_its_prefill_line_is_measured(tmp_path):
    app = make_gateway(tmp_path, ok_local, {"p": provider_ok})
    c = await started_client(app)
    m = app.state.gateway.models["m"]
    for prompt in (100, 600, 1100, 1600, 2100):  # unqueued requests: TTFT 0.2 s + 0.5 ms per prompt token
        t = m.local.tracker.on_start(prompt_tokens=prompt)
        m.local.tracker.on_first_token(t, ttft_s=0.2 + 0.0005 * prompt)
        m.local.tracker.on_finish(t, 5)
    assert m.local.tracker.snapshot().line_measured
    await _policy(c, threshold_ms=5000)
    r = await c.post("/v1/chat/completions", json=CHAT)
    estimate = float(r.headers["x-lmfleet-queue-estimate-ms"])  # the line's value at this prompt
    assert r.headers["x-lmfleet-served-by"] == "local/m" and len(m.margin) == 0
    threshold = round(estimate / 0.95)  # 0.95 x the threshold: within the floor (0.15) of it
    await _policy(c, threshold_ms=threshold)
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.headers["x-lmfleet-served-by"] == "provider/p"  # idle, no samples: the floor, not 0 nor the prior
    state = (await c.get("/admin/state", headers=ADMIN)).json()["models"]["m"]
    assert state["miss_margin_ms"] == pytest.approx(0.15 * threshold, abs=0.1)
    await _policy(c, miss_floor=0)
    m.hysteresis = HysteresisState(overflowing=False)
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.headers["x-lmfleet-served-by"] == "local/m"  # no floor: the estimate alone


async def test_the_margins_prior_spills_near_the_threshold_while_the_engine_is_busy_never_when_idle(tmp_path):
    app = make_gateway(tmp_path, slow(["w"], 1.0), {"p": provider_ok})
    c = await started_client(app)
    # cold estimate 1000 ms: near the threshold, no samples yet; the prefill gate off, so a prompt sent beside another
    # is predicted at the base TTFT (with it on, it would wait for the other's first token as well)
    await _policy(c, threshold_ms=1200, prefill_gate=False)
    r = await c.post("/v1/chat/completions", json=STREAM)  # idle: no prior, kept local on its estimate
    assert r.headers["x-lmfleet-served-by"] == "local/m"
    first = asyncio.create_task(c.post("/v1/chat/completions", json=STREAM))
    await asyncio.sleep(0.2)  # one request in flight, a slot free: the estimate is the base TTFT (1 s) again
    r = await c.post("/v1/chat/completions", json=STREAM)
    estimate = float(r.headers["x-lmfleet-queue-estimate-ms"])
    assert 1200 - 360 < estimate < 1200  # local on the estimate alone
    assert r.headers["x-lmfleet-served-by"] == "provider/p"  # estimate + 0.3 x 1200 > 1200
    assert (await first).headers["x-lmfleet-served-by"] == "local/m"


async def test_behind_the_prefill_gate_a_prompt_waits_for_the_one_through_it_before_the_gates_line_is_measured(
        tmp_path):
    app = make_gateway(tmp_path, slow(["w"], 1.0), {"p": provider_ok})
    c = await started_client(app)
    await _policy(c, threshold_ms=1200, prefill_gate=True)
    await c.post("/v1/chat/completions", json=STREAM)  # measures the base TTFT: 1 s
    first = asyncio.create_task(c.post("/v1/chat/completions", json=STREAM))
    await asyncio.sleep(0.2)  # through the gate 0.2 s ago; the gate's service line has no samples yet
    r = await c.post("/v1/chat/completions", json=STREAM)
    assert 1500 < float(r.headers["x-lmfleet-queue-estimate-ms"]) < 2000  # ~0.8 s left of it + its own 1 s
    assert r.headers["x-lmfleet-route-reason"] == "queue_estimate_above_threshold"
    assert (await first).headers["x-lmfleet-served-by"] == "local/m"


async def test_an_estimate_below_the_margins_band_stays_local_whatever_the_margin(tmp_path):
    app = make_gateway(tmp_path, ok_local, {"p": provider_ok})
    c = await started_client(app)
    await _policy(c, threshold_ms=2500)  # idle: cold estimate 1000 ms, under 2500 / 2
    m = app.state.gateway.models["m"]
    for _ in range(8):  # a burst's requests predicted at 1700 waited 4000: the margin is at its cap
        m.margin.observe(predicted_ms=1700, realised_ms=4000, threshold_ms=2500)
    m.hysteresis = HysteresisState(overflowing=True)  # the burst left the model overflowing: its bar is 2000 ms
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.headers["x-lmfleet-served-by"] == "local/m"  # 1000 + 1250 would have kept it overflowing
    assert not m.hysteresis.overflowing
    assert (await c.get("/admin/state", headers=ADMIN)).json()["models"]["m"]["miss_margin_ms"] == 1250


async def test_local_answers_and_local_attempts_cancelled_before_a_first_token_feed_the_margin(tmp_path):
    app = make_gateway(tmp_path, slow(["late"], 3.0), {"p": provider_ok})
    c = await started_client(app)
    await _policy(c, policy="hedge", hedge_after_ms=200)
    r = await c.post("/v1/chat/completions", json=STREAM)
    assert r.headers["x-lmfleet-route-reason"] == "hedge_won"
    m = app.state.gateway.models["m"]
    assert len(m.margin) == 1  # the cancelled local attempt: it had waited at least until the hedge won


async def test_a_long_prompt_is_predicted_with_its_prefill_and_spilled(tmp_path):
    """The tracker has measured 1 ms of TTFT per token of prefill work: a short chat stays local at the base TTFT, a
    prompt of ~3,000 more tokens than typical is predicted ~3 s later and goes to the provider."""
    app = make_gateway(tmp_path, ok_local, {"p": provider_ok}, max_model_len=4096)
    c = await started_client(app)
    await _policy(c, threshold_ms=2500)
    m = app.state.gateway.models["m"]
    tr = m.local.tracker
    for prompt in (20, 30, 500, 25, 1500, 20, 1000, 40):  # unqueued requests: TTFT 0.1 s + 1 ms per token
        tk = tr.on_start(prompt)
        tr.on_first_token(tk, ttft_s=0.1 + 0.001 * prompt)
        tr.on_finish(tk, 5)
    tr._slope_at = float("-inf")  # as if a second had passed since the slope was last computed
    state = (await c.get("/admin/state", headers=ADMIN)).json()["models"]["m"]
    assert state["prefill_ms_per_1k_tokens"] == pytest.approx(1000) and state["pending_prefill_tokens"] == 0
    r = await c.post("/v1/chat/completions", json=STREAM)
    assert r.headers["x-lmfleet-served-by"] == "local/m"
    long = {**STREAM, "messages": [{"role": "user", "content": " ".join(["word"] * 3000)}]}
    r = await c.post("/v1/chat/completions", json=long)
    assert r.status_code == 200, r.text
    assert r.headers["x-lmfleet-served-by"] == "provider/p"
    assert r.headers["x-lmfleet-route-reason"] == "queue_estimate_above_threshold"
    assert float(r.headers["x-lmfleet-queue-estimate-ms"]) > 2500
