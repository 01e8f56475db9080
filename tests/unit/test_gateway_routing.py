"""The gateway's request handling against fake backends (httpx.MockTransport): routing, fallback,
error shapes, streaming relay, auth. Claims about the real system live in tests/e2e."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from lmfleet.testing.gateway_fakes import chat_json, make_gateway, sse_events, started_client, stream_response

pytestmark = pytest.mark.usefixtures("close_started_gateways")

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}


def ok_local(req: httpx.Request) -> httpx.Response:
    body = json.loads(req.content)
    if body.get("stream"):
        return stream_response(sse_events(body["model"], ["Par", "is"]))
    return httpx.Response(200, json=chat_json(body["model"]))


def provider_ok(req: httpx.Request) -> httpx.Response:
    body = json.loads(req.content)
    assert req.headers["authorization"] == "Bearer sk-secret-provider-key"
    if body.get("stream"):
        return stream_response(sse_events(body["model"], ["Remote"]))
    return httpx.Response(200, json=chat_json(body["model"], "Remote."))


async def test_local_ok_has_provenance_and_plain_body(tmp_path):
    c = await started_client(make_gateway(tmp_path, ok_local))
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert r.headers["x-lmfleet-served-by"] == "local/m"
    assert r.headers["x-lmfleet-route-reason"] == "local_ok"
    assert r.json()["choices"][0]["message"]["content"] == "Paris."
    assert r.json()["model"] == "m"


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1,2]", 400, None),
    (json.dumps({**CHAT, "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({**CHAT, "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({**CHAT, "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({**CHAT, "n": "two"}).encode(), 400, "n"),
    (json.dumps({**CHAT, "messages": []}).encode(), 400, "messages"),
    (json.dumps({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "messages[0].role"),
    (json.dumps({**CHAT, "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({k: v for k, v in CHAT.items() if k != "model"}).encode(), 400, "model"),
    (json.dumps({**CHAT, "model": "gpt-9"}).encode(), 404, "model"),
    (json.dumps({**CHAT, "max_tokens": 60}).encode(), 400, "max_tokens"),
])
async def test_client_errors_are_openai_shaped_4xx(tmp_path, body, status, param):
    c = await started_client(make_gateway(tmp_path, ok_local))
    r = await c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    if status == 404:
        assert "Served models: m" in err["message"]


async def test_context_error_names_both_numbers(tmp_path):
    c = await started_client(make_gateway(tmp_path, ok_local, max_model_len=20))
    r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 15})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "20" in msg and "15" in msg and "7 in the prompt" in msg


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_count_runs_alongside_the_upstream_call_and_its_400_wins(tmp_path, stream):
    """The bound (bytes) cannot prove these fit in 20 tokens: the count runs while the request goes upstream,
    and the answer waits for it."""
    c = await started_client(make_gateway(tmp_path, ok_local, max_model_len=20))
    r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 15, "stream": stream})
    assert r.status_code == 400 and "7 in the prompt" in r.json()["error"]["message"]
    for _ in range(3):  # the abandoned upstream calls freed their slots
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 13, "stream": stream})
        assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/m"


async def test_completions_prompt_too_long_without_max_tokens(tmp_path):
    c = await started_client(make_gateway(tmp_path, ok_local, max_model_len=5))
    r = await c.post("/v1/completions", json={"model": "m", "prompt": "a b c d e f"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


async def test_upstream_client_error_passes_through_cleaned(tmp_path):
    def local(req):
        return httpx.Response(400, json={"error": {"message": "Message: bad logit_bias (Request ID: 1), Internal "
                                                              "exception: X", "type": "BadRequestError"}})
    c = await started_client(make_gateway(tmp_path, local, {"p": provider_ok}))
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "bad logit_bias"


@pytest.mark.parametrize("failure", [
    lambda req: httpx.Response(500, json={"error": {"message": "EngineDeadError"}}),
    lambda req: (_ for _ in ()).throw(httpx.ConnectError("refused")),
])
async def test_local_failure_falls_back_to_provider(tmp_path, failure):
    c = await started_client(make_gateway(tmp_path, failure, {"p": provider_ok}))
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    assert r.headers["x-lmfleet-served-by"] == "provider/p"
    assert r.headers["x-lmfleet-route-reason"] == "fallback_after_local_error"
    assert r.json()["model"] == "m"  # the client sees its own model name, not the provider's


async def test_local_failure_without_provider_is_503_and_not_ready(tmp_path):
    import asyncio

    app = make_gateway(tmp_path, lambda req: httpx.Response(500, json={"error": {"message": "engine died"}}))
    c = await started_client(app)
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert "engine died" in r.json()["error"]["message"]
    # issue 13: one request's 500s (all its retries) are not evidence against the engine: still ready
    assert (await c.get("/ready")).status_code == 200
    # ... several different requests failing within the window are
    rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=CHAT) for _ in range(3)))
    assert [r.status_code for r in rs] == [503] * 3
    ready = await c.get("/ready", headers={"authorization": "Bearer adm"})
    assert ready.status_code == 503 and ready.json()["models"]["m"]["ready"] is False


async def test_provider_429_honours_retry_after_and_goes_to_next(tmp_path):
    calls = []

    def limited(req):
        calls.append("p1")
        return httpx.Response(429, headers={"retry-after": "30"}, json={"error": {"message": "slow down"}})

    app = make_gateway(tmp_path, ok_local, {"p1": limited, "p2": provider_ok}, ready=False)
    c = await started_client(app)
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "provider/p2"
    assert app.state.gateway.providers["p1"].breaker.retry_after_s() > 25
    r = await c.post("/v1/chat/completions", json=CHAT)  # p1 is skipped while its Retry-After runs
    assert r.headers["x-lmfleet-served-by"] == "provider/p2" and calls == ["p1"]


async def test_forced_overflow_through_admin(tmp_path):
    c = await started_client(make_gateway(tmp_path, ok_local, {"p": provider_ok}))
    assert (await c.post("/admin/overflow", json={"model": "m", "mode": "force_on"})).status_code == 401
    r = await c.post("/admin/overflow", json={"model": "m", "mode": "force_on"}, headers={"authorization": "Bearer adm"})
    assert r.status_code == 200
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.headers["x-lmfleet-served-by"] == "provider/p"
    assert r.headers["x-lmfleet-route-reason"] == "forced_overflow"
    r = await c.post("/admin/overflow", json={"model": "m", "mode": "sideways"}, headers={"authorization": "Bearer adm"})
    assert r.status_code == 400


async def test_stream_relays_and_hides_usage_unless_asked(tmp_path):
    c = await started_client(make_gateway(tmp_path, ok_local))
    r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/m"
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all('"usage"' not in e for e in events)
    r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert any('"usage"' in e for e in r.text.split("\n\n"))


def _regroup(events: list[bytes], how: str) -> list[bytes]:
    raw = b"".join(events)
    if how == "one_read":  # Ray Serve LLM batches stream chunks: a whole answer can arrive in one read
        return [raw]
    if how == "bytewise":
        return [raw[i:i + 1] for i in range(len(raw))]
    if how == "split_mid_event":
        return [raw[:7], raw[7:len(raw) // 2], raw[len(raw) // 2:]]
    return events


@pytest.mark.parametrize("how", ["per_event", "one_read", "bytewise", "split_mid_event"])
async def test_stream_relays_every_event_however_the_reads_group_them(tmp_path, how):
    words = ["The", " capital", " is", " Paris", "."]

    def local(req):
        return stream_response(_regroup(sse_events("m", words), how))

    c = await started_client(make_gateway(tmp_path, local))
    r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events
    deltas = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(d["choices"][0]["delta"]["content"] for d in deltas if d["choices"]) == "".join(words)
    assert deltas[-1]["usage"]["completion_tokens"] == len(words)
    assert "upstream_truncated" not in r.text


async def test_stream_failure_before_first_chunk_falls_back(tmp_path):
    def local(req):
        return stream_response([], httpx.ReadError("reset"))

    c = await started_client(make_gateway(tmp_path, local, {"p": provider_ok}))
    r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "provider/p"
    assert "Remote" in r.text


async def test_stream_failure_after_first_chunk_ends_with_error_event(tmp_path):
    def local(req):
        return stream_response(sse_events("m", ["Par", "is"], usage=False, done=False), httpx.ReadError("reset"))

    c = await started_client(make_gateway(tmp_path, local, {"p": provider_ok}))
    r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert '"Par"' in events[0]
    err = json.loads(events[-2].removeprefix("data: "))
    assert err["error"]["code"] == "upstream_stream_error"
    assert events[-1] == "data: [DONE]"


async def test_stream_without_done_is_reported_as_truncated(tmp_path):
    def local(req):
        return stream_response(sse_events("m", ["Par"], usage=False, done=False))

    c = await started_client(make_gateway(tmp_path, local))
    r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert "upstream_truncated" in r.text


async def test_auth_required_and_key_never_logged(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    c = await started_client(make_gateway(tmp_path, ok_local, api_keys={"sk-client-secret"}))
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = await c.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer wrong-key-123"})
    assert r.status_code == 401 and "wrong-key-123" not in r.text
    r = await c.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sk-client-secret"})
    assert r.status_code == 200
    assert (await c.get("/health")).status_code == 200  # liveness stays open
    assert "sk-client-secret" not in caplog.text and "wrong-key-123" not in caplog.text


async def test_provider_key_not_in_error_bodies_or_logs(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)

    def echoing_provider(req):  # a hostile provider that echoes the auth header in its error
        return httpx.Response(500, json={"error": {"message": f"bad key {req.headers['authorization']}"}})

    app = make_gateway(tmp_path, lambda r: httpx.Response(500, json={"error": {"message": "dead"}}),
                         {"p": echoing_provider})
    c = await started_client(app)
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert "sk-secret-provider-key" not in r.text
    assert "sk-secret-provider-key" not in caplog.text


async def test_ledger_and_metrics_add_up(tmp_path):
    app = make_gateway(tmp_path, ok_local, {"p": provider_ok})
    c = await started_client(app)
    for _ in range(3):
        await c.post("/v1/chat/completions", json=CHAT)
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers={"authorization": "Bearer adm"})
    for _ in range(2):
        await c.post("/v1/chat/completions", json=CHAT)
    usage = (await c.get("/admin/usage", headers={"authorization": "Bearer adm"})).json()
    by = {row["served_by"]: row for row in usage["rows"]}
    assert by["local/m"]["requests"] == 3 and by["provider/p"]["requests"] == 2
    assert by["provider/p"]["cost_usd"] == pytest.approx(2 * (7 * 1.0 + 2 * 2.0) / 1e6)
    assert usage["total"]["cost_usd"] == pytest.approx(sum(r["cost_usd"] for r in usage["rows"]))
    advice = (await c.get("/admin/usage?advise=1", headers={"authorization": "Bearer adm"})).json()
    (row,) = advice["models"]
    assert row["model"] == "m" and row["overflow_usd"] == pytest.approx(by["provider/p"]["cost_usd"])
    assert row["overflow_output_tokens"] == by["provider/p"]["output_tokens"] and row["verdict"] in ("buy", "rent")
    text = (await c.get("/metrics", headers={"authorization": "Bearer adm"})).text
    assert 'lmfleet_requests_total{model="m",served_by="provider/p",status="200"} 2.0' in text
    assert "lmfleet_time_to_first_token_seconds" in text
    await c.post("/v1/chat/completions", json={**CHAT, "temperature": 9})
    await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    text = (await c.get("/metrics", headers={"authorization": "Bearer adm"})).text
    assert 'lmfleet_errors_total{code="400",model="m"} 1.0' in text
    assert 'lmfleet_errors_total{code="404",model="unknown"} 1.0' in text


async def test_ledger_keeps_the_predicted_and_realised_wait_of_local_requests(tmp_path):
    app = make_gateway(tmp_path, ok_local, {"p": provider_ok})
    c = await started_client(app)
    adm = {"authorization": "Bearer adm"}
    for _ in range(2):
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200
    await c.post("/v1/chat/completions", json=CHAT)  # not streamed: no first token to time
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers=adm)
    await c.post("/v1/chat/completions", json={**CHAT, "stream": True})  # a provider's: no local wait
    await (await c.get("/admin/usage", headers=adm)).aread()  # flushed
    rows = app.state.gateway.recorder.ledger.rows()
    waits = [(r["served_by"], r["predicted_wait_ms"] is not None, r["realised_wait_ms"] is not None) for r in rows]
    assert waits == [("local/m", True, True), ("local/m", True, True), ("local/m", True, False),
                     ("provider/p", False, False)]
    assert all(r["realised_wait_ms"] == r["ttft_ms"] for r in rows[:2])
    est = (await c.get("/admin/usage?estimate=1", headers=adm)).json()
    (m,) = est["models"]
    assert m["model"] == "m" and m["requests"] == 2 and m["threshold_ms"] == app.state.gateway.models["m"].threshold_ms
    assert m["p90_abs_error_pct_of_threshold"] == pytest.approx(100 * m["p90_abs_error_ms"] / m["threshold_ms"], abs=0.1)
    assert (await c.get("/admin/usage?estimate=1&advise=1", headers=adm)).status_code == 400


async def test_models_lists_served_models(tmp_path):
    c = await started_client(make_gateway(tmp_path, ok_local))
    data = (await c.get("/v1/models")).json()
    assert [m["id"] for m in data["data"]] == ["m"]


async def test_slow_local_first_token_goes_to_provider_without_marking_local_down(tmp_path):
    import asyncio

    async def slow_local(req):
        await asyncio.sleep(5)  # longer than local_first_token_timeout_s=2
        return stream_response(sse_events("m", ["late"]))

    app = make_gateway(tmp_path, slow_local, {"p": provider_ok})
    c = await started_client(app)
    r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "provider/p"
    assert app.state.gateway.health.is_ready("m")  # a queue, not a dead engine


async def test_forced_local_never_times_out_the_first_token(tmp_path):
    import asyncio

    async def slowish_local(req):
        await asyncio.sleep(2.5)  # beyond local_first_token_timeout_s=2, within request_timeout_s=10
        return stream_response(sse_events("m", ["ok"]))

    app = make_gateway(tmp_path, slowish_local, {"p": provider_ok})
    c = await started_client(app)
    await c.post("/admin/overflow", json={"mode": "force_off"}, headers={"authorization": "Bearer adm"})
    r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/m"


async def test_client_going_away_while_waiting_frees_the_local_slot_and_is_recorded_cancelled(tmp_path):
    import asyncio

    async def never(req):
        await asyncio.sleep(60)
        return httpx.Response(200, json=chat_json("m"))

    app = make_gateway(tmp_path, never)
    c = await started_client(app)
    task = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
    await asyncio.sleep(0.3)
    assert app.state.gateway.models["m"].local.tracker.in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    assert app.state.gateway.models["m"].local.tracker.in_flight == 0
    await app.state.gateway.recorder.flush()
    rows = app.state.gateway.recorder.ledger.rows()
    assert [(r["served_by"], r["status"]) for r in rows] == [("local/m", "499")]


@pytest.mark.parametrize("status", [401, 403, 404])
async def test_provider_refusing_our_key_or_model_is_a_provider_fault_not_the_clients(tmp_path, status, caplog):
    def refusing(req):
        return httpx.Response(status, json={"error": {"message": "Incorrect API key sk-secret-provider-key"}})

    app = make_gateway(tmp_path, ok_local, {"p": refusing})
    c = await started_client(app)
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers={"authorization": "Bearer adm"})
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/m"  # fell back
    assert r.headers["x-lmfleet-route-reason"] == "fallback_after_provider_error"
    text = (await c.get("/metrics", headers={"authorization": "Bearer adm"})).text
    assert 'lmfleet_upstream_failures_total{kind="UpstreamMisconfigured",served_by="provider/p"} 1.0' in text
    assert app.state.gateway.providers["p"].in_flight == 0


async def test_provider_refusal_never_reaches_the_client(tmp_path):
    def refusing(req):
        return httpx.Response(401, json={"error": {"message": "Incorrect API key sk-secret-provider-key"}})

    dead = lambda req: httpx.Response(500, json={"error": {"message": "engine died"}})  # noqa: E731
    c = await started_client(make_gateway(tmp_path, dead, {"p": refusing}, ready=False))
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503  # local (tried last) is dead too; never the provider's 401
    assert "Incorrect API key" not in r.text and "sk-secret" not in r.text


@pytest.mark.parametrize("body", [
    {"id": "x", "model": "p-model", "choices": [], "usage": {"prompt_tokens": "n/a", "completion_tokens": 2}},
    {"id": "x", "model": "p-model", "choices": [], "usage": ["not", "a", "dict"]},
    [1, 2, 3],
])
async def test_malformed_upstream_answers_never_leak_a_slot(tmp_path, body):
    app = make_gateway(tmp_path, ok_local, {"p": lambda req: httpx.Response(200, json=body)})
    c = await started_client(app)
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers={"authorization": "Bearer adm"})
    for _ in range(3):
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code < 500 or r.json()["error"]["type"] == "server_error", r.text
    assert app.state.gateway.providers["p"].in_flight == 0
    assert app.state.gateway.models["m"].local.tracker.in_flight == 0


class _SlowStream(httpx.AsyncByteStream):
    """One event every 50 ms, for 10 s: a long generation."""

    async def __aiter__(self):
        import asyncio

        for i in range(200):
            yield sse_events("m", [f"w{i} "], usage=False, done=False)[0]
            await asyncio.sleep(0.05)


async def _serve(app):
    """The app on a real uvicorn server (real disconnects), on a free loopback port."""
    import asyncio
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from lmfleet.config.models import GatewayConfig
    from lmfleet.gateway.front.server import uvicorn_options

    # the server options lmfleet serve uses (head deadline, keep-alive, connection cap)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           **uvicorn_options(GatewayConfig())))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    return server, task, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_over_real_http_cancels_and_frees_the_slot(tmp_path, stream):
    import asyncio

    async def slow(req):
        if json.loads(req.content).get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_SlowStream())
        await asyncio.sleep(10)
        return httpx.Response(200, json=chat_json("m"))

    app = make_gateway(tmp_path, slow)
    server, task, url = await _serve(app)
    try:
        tracker = app.state.gateway.models["m"].local.tracker
        async with httpx.AsyncClient(base_url=url) as c:
            if stream:
                async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                    async for _ in r.aiter_raw():
                        break  # the first chunk, then hang up
            else:
                with pytest.raises(httpx.ReadTimeout):
                    await c.post("/v1/chat/completions", json=CHAT, timeout=0.5)
        for _ in range(100):
            if tracker.in_flight == 0:
                break
            await asyncio.sleep(0.05)
        assert tracker.in_flight == 0  # freed long before the 10 s generation would have ended
        await app.state.gateway.recorder.flush()
        assert [r["status"] for r in app.state.gateway.recorder.ledger.rows()] == ["499"]
    finally:
        server.should_exit = True
        await task


async def test_budget_cap_is_exact_under_200_concurrent_paid_requests(tmp_path):
    """Each request reserves its worst case before it is sent: a cap that fits 10 admits exactly 10, however many
    arrive at once (the rest stay local), and what was spent stays under the cap."""
    import asyncio

    async def slow_provider(req):
        await asyncio.sleep(2)  # every reservation is taken before the first one settles
        return httpx.Response(200, json=chat_json(json.loads(req.content)["model"], "Remote."))

    body = {**CHAT, "max_tokens": 8}
    worst_usd = (7 * 1.0 + 8 * 2.0) / 1e6  # 7 prompt tokens (the fakes' tokenizer), prices 1 $/1M in, 2 $/1M out
    # 200 connections opened at once to a fake in this process: on a loaded machine a 5 s connect timeout trips
    app = make_gateway(tmp_path, ok_local, {"p": slow_provider}, extra={"budget": {"hourly_usd": 10.5 * worst_usd}},
                       provider_extra={"timeouts": {"connect_s": 60}})
    c = await started_client(app)
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers={"authorization": "Bearer adm"})
    answers = await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(200)))
    assert all(r.status_code == 200 for r in answers)
    served = [r.headers["x-lmfleet-served-by"] for r in answers]
    assert served.count("provider/p") == 10 and served.count("local/m") == 190
    usage = (await c.get("/admin/usage", headers={"authorization": "Bearer adm"})).json()
    by = {row["served_by"]: row for row in usage["rows"]}
    assert by["provider/p"]["requests"] == 10 and by["provider/p"]["cost_usd"] <= 10.5 * worst_usd
    assert app.state.gateway.providers["p"].in_flight == 0


class _StallingStream(httpx.AsyncByteStream):
    """Sends ``events``, then goes silent for ``quiet_s`` (connection open), then the rest."""

    def __init__(self, events: list[bytes], quiet_s: float, rest: list[bytes]):
        self.events, self.quiet_s, self.rest = events, quiet_s, rest

    async def __aiter__(self):
        import asyncio

        for e in self.events:
            yield e
        await asyncio.sleep(self.quiet_s)
        for e in self.rest:
            yield e


@pytest.mark.parametrize("quiet_s, stalled", [(0.3, False), (3.0, True)])
async def test_provider_stream_that_goes_quiet_past_its_idle_timeout_ends_with_an_error(tmp_path, quiet_s, stalled):
    """A provider stream silent for longer than timeouts.first_token_s (1 s here) is cut with an error event;
    a shorter pause is relayed whole."""
    events = sse_events("p-model", ["Par", "is", "!"])

    def provider(req):
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=_StallingStream(events[:2], quiet_s, events[2:]))

    app = make_gateway(tmp_path, lambda req: httpx.Response(500), {"p": provider})
    for p in app.state.gateway.providers.values():
        p.cfg.timeouts.first_token_s = 1.0
    c = await started_client(app)
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers={"authorization": "Bearer adm"})
    r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "provider/p"
    if stalled:
        assert "StreamStalled" in r.text and "upstream_stream_error" in r.text and '"!"' not in r.text
    else:
        assert '"!"' in r.text and "error" not in r.text


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/chat/completions", 405),
    ("PUT", "/v1/completions", 405),
    ("GET", "/v1/models", 200),
    ("POST", "/v1/nothing", 404),
])
async def test_other_methods_on_the_openai_routes_get_openai_shaped_errors(tmp_path, method, path, status):
    """The OpenAI routes are answered ahead of FastAPI's stack (POST only); the rest still goes through it."""
    c = await started_client(make_gateway(tmp_path, lambda req: httpx.Response(200, json=chat_json("m"))))
    r = await c.request(method, path)
    assert r.status_code == status
    if status >= 400:
        assert r.json()["error"]["type"] == "invalid_request_error"


async def test_a_stream_whose_upstream_lingers_after_done_is_recorded_as_served(tmp_path):
    """[DONE] reaches the client and completes its response; the upstream's own end comes later (Ray Serve
    sends the chunked terminator in a later read). The client closing its finished exchange meanwhile is not
    a cancellation: the request counts as served (200), with its tokens."""
    events = sse_events("m", ["Par", "is"])

    def local(req):
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=_StallingStream(events, 0.5, []))

    app = make_gateway(tmp_path, local)
    c = await started_client(app)
    r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    gw = app.state.gateway
    await asyncio.sleep(1.0)  # the relay reads the upstream to its end, then records
    await gw.recorder.flush()
    served = gw.metrics.requests.labels("m", "local/m", "200")._value.get()
    cancelled = gw.metrics.requests.labels("m", "local/m", "499")._value.get()
    assert (served, cancelled) == (1, 0)


async def test_a_stream_without_usage_reuses_the_prompts_count(tmp_path, monkeypatch):
    """The count made for the context check is what the ledger gets; the prompt is not tokenized again."""
    from lmfleet.gateway.relay import usage

    def no_usage(req):
        return stream_response(sse_events("m", ["a", "b"], usage=False))

    def recount(*a):
        raise AssertionError("the prompt was tokenized again")

    app = make_gateway(tmp_path, no_usage, max_model_len=20)
    c = await started_client(app)
    monkeypatch.setattr(usage, "count_chat", recount)
    r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 13, "stream": True})
    assert r.status_code == 200 and b"[DONE]" in r.content
    await app.state.gateway.recorder.flush()
    [row] = app.state.gateway.recorder.ledger.rows()
    assert (row["input_tokens"], row["output_tokens"], row["usage_source"]) == (7, 2, "estimated")
