"""Tenants in the gateway (issue 14): key -> tenant, admission (limits, classes), attribution, no key leaks.

The real gateway (build_gateway) in front of fake backends; tenant keys come from key files in tmp_path.
Claims about the real fleet (Ray, vLLM) belong in tests/e2e.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import httpx
import pytest

from lmfleet.config import parse_config
from lmfleet.gateway.front.access import GatewayConfigError
from lmfleet.gateway.build import check_gateway_access
from lmfleet.testing.gateway_fakes import ADMIN_KEY_ENV, chat_json, make_gateway, sse_events, started_client, stream_response
from tests.support.clock import freeze_tracker_clock

pytestmark = pytest.mark.usefixtures("close_started_gateways")

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}
KEYS = {"a": "sk-tenant-a-3f9c2e", "b": "sk-tenant-b-77d01a"}
FLAT_KEY = "sk-flat-key-51be0c"
ADMIN = {"authorization": "Bearer adm"}
MODEL_M = {"name": "m", "source": "builtin:tiny-random",
           "deployment": {"max_ongoing_requests": 4, "request_timeout_s": 10},
           "overflow": {"threshold_ms": 1000, "local_first_token_timeout_s": 2}}
CLASSES = [{"name": "interactive", "order": 0}, {"name": "batch", "order": 10, "max_wait_s": 5}]


def key(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


def ok_local(req: httpx.Request) -> httpx.Response:
    body = json.loads(req.content)
    if body.get("stream"):
        return stream_response(sse_events(body["model"], ["Par", "is"]))
    return httpx.Response(200, json=chat_json(body["model"]))


class Counting:
    """A provider that answers and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, req: httpx.Request) -> httpx.Response:
        self.calls += 1
        return httpx.Response(200, json=chat_json(json.loads(req.content)["model"], "Remote."))


def tenant_gateway(tmp_path, tenants: dict[str, dict] | None = None, local=ok_local, providers=None, *,
                   flat: bool = False, classes: list[dict] | None = None, models: list[dict] | None = None):
    """The gateway with ``tenants`` (name -> extra config), each holding ``KEYS[name]`` in a key file."""
    tenants = {"a": {}, "b": {}} if tenants is None else tenants
    cfgs = []
    for name, extra in tenants.items():
        path = tmp_path / f"{name}.keys"
        path.write_text(f"# tenant {name}\n{KEYS[name]}\n")
        cfgs.append({"name": name, "api_keys_file": str(path), **extra})
    extra_cfg: dict = {"tenants": cfgs, "priority_classes": classes or CLASSES}
    if models is not None:
        extra_cfg["models"] = models
    return make_gateway(tmp_path, local, providers, extra=extra_cfg,
                        api_keys={FLAT_KEY} if flat else frozenset())


async def _ledger_rows(app) -> list[dict]:
    gw = app.state.gateway
    await gw.recorder.flush()
    return gw.recorder.ledger.rows()


def _load(app, n: int) -> None:
    """``n`` requests in flight on the local deployment (capacity 4): the predicted wait grows past 4."""
    tracker = app.state.gateway.models["m"].local.tracker
    for _ in range(n):
        tracker.on_start(10)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# ---- 1. auth: a key is a tenant; no key, no service --------------------------------------------------------
@pytest.mark.parametrize("headers", [
    {},
    {"authorization": "Bearer sk-not-a-key"},
    {"authorization": "Bearer "},
    {"authorization": f"Basic {KEYS['a']}"},
    {"authorization": f"Bearer {FLAT_KEY}"},  # no flat keys in this fleet
])
@pytest.mark.parametrize("method,path", [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                         ("GET", "/v1/models")])
async def test_a_fleet_with_only_tenants_is_not_open(tmp_path, headers, method, path):
    c = await started_client(tenant_gateway(tmp_path))
    r = await c.request(method, path, json=CHAT if method == "POST" else None, headers=headers)
    err = _error(r, 401)
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    assert "sk-" not in r.text


@pytest.mark.parametrize("tenants,flat_env,host,refused", [
    ([], None, "0.0.0.0", True),
    ([{"name": "a", "api_keys_env": "A_KEYS"}], None, "0.0.0.0", False),  # tenant keys count as client keys
    ([{"name": "a", "api_keys_env": "A_KEYS"}], "FLAT", "0.0.0.0", False),
    ([], "FLAT", "0.0.0.0", False),
    ([], None, "127.0.0.1", False),
])
def test_tenant_keys_count_for_the_exposure_check(tenants, flat_env, host, refused):
    fleet = parse_config({"gateway": {"api_keys_env": flat_env}, "tenants": tenants,
                          "models": [{"name": "m", "source": "builtin:tiny-random"}]})
    environ = {"A_KEYS": KEYS["a"], "FLAT": FLAT_KEY}

    def check():
        return check_gateway_access(fleet.gateway, host, environ, tenants=fleet.tenants,
                                    classes=fleet.priority_classes)

    if refused:
        with pytest.raises(GatewayConfigError, match="allow_unauthenticated"):
            check()
    else:
        check()


@pytest.mark.parametrize("tenant,environ,match", [
    ({"name": "a", "api_keys_env": "A_KEYS"}, {}, r"tenants\[0\]\.api_keys_env names A_KEYS"),
    ({"name": "a", "api_keys_env": "A_KEYS"}, {"A_KEYS": " , "}, "unset or empty"),
    ({"name": "a", "api_keys_file": "/nonexistent/a.keys"}, {}, "cannot be read"),
])
def test_a_tenant_whose_keys_do_not_load_stops_the_start(tenant, environ, match):
    fleet = parse_config({"tenants": [tenant], "models": [{"name": "m", "source": "builtin:tiny-random"}]})
    with pytest.raises(GatewayConfigError, match=match):
        check_gateway_access(fleet.gateway, "127.0.0.1", environ, tenants=fleet.tenants)


def test_one_key_held_by_two_tenants_stops_the_start(tmp_path):
    (tmp_path / "b.keys").write_text(KEYS["a"] + "\n")
    fleet = parse_config({"tenants": [{"name": "a", "api_keys_env": "A"}, {"name": "b", "api_keys_file": str(
        tmp_path / "b.keys")}], "models": [{"name": "m", "source": "builtin:tiny-random"}]})
    with pytest.raises(GatewayConfigError, match="hold the same API key") as ei:
        check_gateway_access(fleet.gateway, "127.0.0.1", {"A": KEYS["a"]}, tenants=fleet.tenants)
    assert KEYS["a"] not in str(ei.value)


# ---- 2. served and attributed -----------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_each_key_is_served_as_its_tenant_and_attributed_in_the_ledger(tmp_path, stream):
    app = tenant_gateway(tmp_path, flat=True)
    c = await started_client(app)
    for who, headers in [("a", key("a")), ("b", key("b")), ("a", key("a")),
                         ("default", {"authorization": f"Bearer {FLAT_KEY}"})]:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers=headers)
        assert r.status_code == 200, (who, r.text)
        assert r.headers["x-lmfleet-priority"] == "interactive"
    rows = await _ledger_rows(app)
    assert [r["tenant"] for r in rows] == ["a", "b", "a", "default"]
    metrics = (await c.get("/metrics", headers=ADMIN)).text
    assert 'lmfleet_tenant_requests_total{status="200",tenant="a"} 2.0' in metrics
    assert 'lmfleet_tenant_requests_total{status="200",tenant="default"} 1.0' in metrics


async def test_flat_keys_alone_behave_as_before_as_tenant_default(tmp_path):
    app = make_gateway(tmp_path, ok_local, api_keys={FLAT_KEY})
    c = await started_client(app)
    assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 401
    r = await c.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {FLAT_KEY}"})
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "local/m"
    assert not any(h.startswith("x-ratelimit") for h in r.headers)  # the default tenant has no limits
    assert [r["tenant"] for r in await _ledger_rows(app)] == ["default"]


async def test_an_open_loopback_gateway_serves_everyone_as_default(tmp_path):
    app = make_gateway(tmp_path, ok_local)
    c = await started_client(app)
    r = await c.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer whatever"})
    assert r.status_code == 200
    assert [r["tenant"] for r in await _ledger_rows(app)] == ["default"]


# ---- 3. limits --------------------------------------------------------------------------------------------
async def test_over_requests_per_minute_is_429_with_openai_headers_and_body(tmp_path):
    app = tenant_gateway(tmp_path, {"a": {"limits": {"requests_per_minute": 2}}, "b": {}})
    c = await started_client(app)
    for i in range(2):
        r = await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-requests"] == "2"
        assert r.headers["x-ratelimit-remaining-requests"] == str(2 - i)
    r = await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))
    err = _error(r, 429)
    assert (err["type"], err["code"]) == ("requests", "rate_limit_exceeded")
    assert "tenant 'a'" in err["message"] and "Limit 2" in err["message"]
    assert r.headers["x-ratelimit-limit-requests"] == "2" and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-reset-requests"]
    assert r.headers["x-lmfleet-priority"] == "interactive"
    assert (await c.post("/v1/chat/completions", json=CHAT, headers=key("b"))).status_code == 200  # b is not a
    metrics = (await c.get("/metrics", headers=ADMIN)).text
    assert 'lmfleet_tenant_rejected_total{reason="requests_per_minute",tenant="a"} 1.0' in metrics
    assert 'lmfleet_tenant_requests_total{status="429",tenant="a"} 1.0' in metrics
    assert [r["tenant"] for r in await _ledger_rows(app)] == ["a", "a", "b"]  # refusals cost nothing, no row


async def test_over_tokens_per_minute_is_429_tokens(tmp_path):
    # each answer uses 7 + 2 tokens; the next prompt (~8 tokens by the fake tokenizer) no longer fits in 12
    c = await started_client(tenant_gateway(tmp_path, {"a": {"limits": {"tokens_per_minute": 12}}}))
    assert (await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))).status_code == 200
    r = await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))
    err = _error(r, 429)
    assert (err["type"], err["code"]) == ("tokens", "rate_limit_exceeded")
    assert r.headers["x-ratelimit-limit-tokens"] == "12" and "retry-after" in r.headers


def _held_local(release: threading.Event, ending: str):
    async def handler(req: httpx.Request) -> httpx.Response:
        if json.loads(req.content)["messages"][0]["content"] == "hold":
            while not release.is_set():
                await asyncio.sleep(0.01)
            if ending == "upstream_error":
                return httpx.Response(400, json={"error": {"message": "bad request upstream"}})
        return httpx.Response(200, json=chat_json("m"))
    return handler


async def _until(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("ending", ["ok", "upstream_error", "client_gone"])
async def test_max_concurrency_refuses_the_next_and_frees_the_slot_however_the_request_ends(tmp_path, ending):
    release = threading.Event()
    app = tenant_gateway(tmp_path, {"a": {"limits": {"max_concurrency": 1}}}, local=_held_local(release, ending))
    book = app.state.gateway.router.tenants
    c = await started_client(app)
    held = {**CHAT, "messages": [{"role": "user", "content": "hold"}]}
    first = asyncio.create_task(c.post("/v1/chat/completions", json=held, headers=key("a")))
    await _until(lambda: book.in_flight["a"] == 1)
    r = await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))
    err = _error(r, 429)
    assert (err["type"], err["code"]) == ("rate_limit_error", "concurrency_limit_exceeded")
    assert r.headers["retry-after"] == "1"
    if ending == "client_gone":
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
    else:
        release.set()
        assert (await first).status_code == (200 if ending == "ok" else 400)
    await _until(lambda: book.in_flight["a"] == 0)
    release.set()
    assert (await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))).status_code == 200


# ---- 4. models ---------------------------------------------------------------------------------------------
async def test_a_model_the_tenant_may_not_use_is_refused_and_not_listed(tmp_path):
    m2 = {**MODEL_M, "name": "m2"}
    app = tenant_gateway(tmp_path, {"a": {"models": ["m2"]}, "b": {"models": ["m"]}}, models=[MODEL_M, m2])
    c = await started_client(app)
    r = await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))
    err = _error(r, 403)
    assert (err["type"], err["param"], err["code"]) == ("permission_error", "model", "model_not_allowed")
    assert (await c.post("/v1/chat/completions", json=CHAT, headers=key("b"))).status_code == 200
    assert [m["id"] for m in (await c.get("/v1/models", headers=key("a"))).json()["data"]] == []
    assert [m["id"] for m in (await c.get("/v1/models", headers=key("b"))).json()["data"]] == ["m"]
    missing = await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=key("a"))
    assert _error(missing, 404)["code"] == "model_not_found"


# ---- 5. priority classes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tenant,header,status,cls", [
    ({}, None, 200, "interactive"),                                         # null priority: most urgent class
    ({"priority": "batch"}, None, 200, "batch"),
    ({"priority": "batch"}, "interactive", 200, "batch"),                   # capped at max_priority (= priority)
    ({"priority": "batch", "max_priority": "interactive"}, " Interactive ", 200, "interactive"),
    ({}, "batch", 200, "batch"),                                            # asking for less is always allowed
    ({}, "", 200, "interactive"),
    ({}, "urgent", 400, None),
])
async def test_the_priority_header_is_read_and_capped(tmp_path, tenant, header, status, cls):
    c = await started_client(tenant_gateway(tmp_path, {"a": tenant}))
    headers = {**key("a"), **({"x-lmfleet-priority": header} if header is not None else {})}
    r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == status, r.text
    if status == 200:
        assert r.headers["x-lmfleet-priority"] == cls
    else:
        err = _error(r, 400)
        assert (err["param"], err["code"]) == ("x-lmfleet-priority", "invalid_priority")


@pytest.mark.parametrize("priority,load,may_pay,status,served_by,reason", [
    # predicted wait: load 0 -> 1 s (threshold 1 s), load 4 -> 3.5 s, load 8 -> 13.5 s; batch deadline 5 s
    ("batch", 0, False, 200, "local/m", "local_ok"),
    ("batch", 4, False, 200, "local/m", "within_deadline"),
    ("batch", 4, True, 200, "local/m", "within_deadline"),
    ("batch", 8, False, 429, None, None),
    ("batch", 8, True, 200, "provider/p", "queue_estimate_above_threshold"),
    ("interactive", 4, False, 200, "provider/p", "queue_estimate_above_threshold"),  # as today
    ("interactive", 8, False, 200, "provider/p", "queue_estimate_above_threshold"),
])
async def test_batch_waits_locally_and_pays_only_when_the_tenant_may(tmp_path, priority, load, may_pay, status,
                                                                      served_by, reason):
    provider = Counting()
    app = tenant_gateway(tmp_path, {"a": {"priority": priority, "batch_may_use_providers": may_pay}},
                         providers={"p": provider})
    c = await started_client(app)
    _load(app, load)
    r = await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))
    assert r.status_code == status, r.text
    assert r.headers["x-lmfleet-priority"] == priority
    if status == 200:
        assert (r.headers["x-lmfleet-served-by"], r.headers["x-lmfleet-route-reason"]) == (served_by, reason)
        assert provider.calls == (1 if served_by == "provider/p" else 0)
    else:
        err = _error(r, 429)
        assert (err["type"], err["code"]) == ("rate_limit_error", "queue_deadline_exceeded")
        assert int(r.headers["retry-after"]) >= 1
        assert provider.calls == 0


async def test_batch_that_may_not_pay_never_falls_back_to_a_provider(tmp_path):
    provider = Counting()
    dead = lambda req: httpx.Response(500, json={"error": {"message": "engine error"}})  # noqa: E731
    app = tenant_gateway(tmp_path, {"a": {"priority": "batch"}}, local=dead, providers={"p": provider})
    c = await started_client(app)
    _load(app, 4)  # over the threshold: an interactive request would go to p
    r = await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))
    assert r.status_code == 503 and provider.calls == 0
    assert r.headers["x-lmfleet-priority"] == "batch"  # error answers carry the class too


# ---- 6. keys stay secret -----------------------------------------------------------------------------------
async def test_no_key_reaches_a_log_an_error_body_or_a_header(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    app = tenant_gateway(tmp_path, {"a": {"limits": {"requests_per_minute": 1}, "models": ["m"]}, "b": {}})
    c = await started_client(app)
    answers = [await c.post("/v1/chat/completions", json=CHAT, headers=key("a")) for _ in range(2)]  # 200, 429
    answers.append(await c.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sk-wrong-1"}))
    answers.append(await c.post("/v1/chat/completions", json={**CHAT, "model": "x"}, headers=key("b")))
    answers.append(await c.post("/v1/chat/completions", json=CHAT,
                                headers={**key("b"), "x-lmfleet-priority": "nope"}))
    assert [a.status_code for a in answers] == [200, 429, 401, 404, 400]
    gw = app.state.gateway
    assert KEYS["a"] not in repr(gw.tenants) and KEYS["a"] not in repr(gw.router.tenants.directory)
    for text in [caplog.text, *(a.text for a in answers), *(str(a.headers) for a in answers)]:
        for secret in [*KEYS.values(), "sk-wrong-1"]:
            assert secret not in text


# ---- 7. admin read ------------------------------------------------------------------------------------------
async def test_admin_sees_tenants_limits_and_live_usage_without_keys(tmp_path):
    app = tenant_gateway(tmp_path, {"a": {"limits": {"requests_per_minute": 5, "max_concurrency": 2},
                                          "priority": "batch", "max_priority": "interactive"}, "b": {}}, flat=True)
    c = await started_client(app)
    assert (await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))).status_code == 200
    assert _error(await c.get("/admin/tenants", headers=key("a")), 401)["code"] == "invalid_api_key"
    r = await c.get("/admin/tenants", headers=ADMIN)
    assert r.status_code == 200
    body = r.json()
    assert [c["name"] for c in body["classes"]] == ["interactive", "batch"]
    assert list(body["tenants"]) == ["default", "a", "b"]
    a = body["tenants"]["a"]
    assert (a["priority"], a["max_priority"], a["in_flight"]) == ("batch", "interactive", 0)
    assert a["limits"]["max_concurrency"] == 2
    assert a["windows"]["requests_per_minute"] == {"limit": 5, "used": 1.0, "remaining": 4}
    assert body["tenants"]["b"]["windows"] == {}
    assert not any(k in r.text for k in [*KEYS.values(), FLAT_KEY])


# ---- 8. the local priority queue ------------------------------------------------------------------------------
QUICK_M = {**MODEL_M, "overflow": {"threshold_ms": 1000, "cold_service_s": 1.0, "cold_ttft_s": 0.2}}
"""Predicted wait: 0.2 s idle, 0.45 s with its 4 slots taken: under the threshold, so admission keeps it local."""


async def test_the_local_queue_serves_interactive_first_and_enforces_the_batch_deadline(tmp_path, monkeypatch):
    release = threading.Event()
    app = tenant_gateway(tmp_path, {"a": {"max_priority": "interactive"}, "b": {}},
                         local=_held_local(release, "ok"), models=[QUICK_M],
                         classes=[{"name": "interactive", "order": 0}, {"name": "batch", "order": 10, "max_wait_s": 1}])
    gw = app.state.gateway
    q = gw.models["m"].queue
    # the held requests never finish: with busy time passing and no completion the estimate would rise over the
    # threshold while the batch request waits
    freeze_tracker_clock(gw.models["m"].local.tracker, monkeypatch)
    c = await started_client(app)
    held = {**CHAT, "messages": [{"role": "user", "content": "hold"}]}
    running = [asyncio.create_task(c.post("/v1/chat/completions", json=held, headers=key("a"))) for _ in range(4)]
    await _until(lambda: q.running == 4)

    # every slot is taken: a batch request waits up to its 1 s deadline, then 429
    r = await c.post("/v1/chat/completions", json=CHAT, headers={**key("a"), "x-lmfleet-priority": "batch"})
    err = _error(r, 429)
    assert (err["type"], err["code"]) == ("rate_limit_error", "queue_deadline_exceeded")
    assert r.headers["retry-after"] == "1" and r.headers["x-lmfleet-priority"] == "batch"
    assert not q.waiting and gw.models["m"].local.tracker.in_flight == 4

    # a's batch request, then b's interactive one: when slots free up, b's goes first
    waiting = [asyncio.create_task(c.post("/v1/chat/completions", json=CHAT, headers={**key("a"), **h}))
               for h in ({"x-lmfleet-priority": "batch"},)]
    await _until(lambda: len(q.waiting) == 1)
    waiting.append(asyncio.create_task(c.post("/v1/chat/completions", json=CHAT, headers=key("b"))))
    await _until(lambda: len(q.waiting) == 2)
    release.set()
    answers = await asyncio.gather(*running, *waiting)
    assert [r.status_code for r in answers] == [200] * 6
    assert q.last_served["b"] < q.last_served["a"]  # dispatch numbers: interactive b before batch a
    assert q.running == 0 and not q.waiting and gw.models["m"].local.tracker.in_flight == 0
    queues = (await c.get("/admin/tenants", headers=ADMIN)).json()["local_queues"]
    assert queues == {"m": {"capacity": 4, "running": 0, "waiting": 0, "peer_running": 0, "share": 4}}


async def test_a_client_that_leaves_while_queued_frees_everything(tmp_path):
    release = threading.Event()
    app = tenant_gateway(tmp_path, {"a": {"limits": {"max_concurrency": 10}}}, local=_held_local(release, "ok"),
                         models=[QUICK_M])
    gw = app.state.gateway
    q, book = gw.models["m"].queue, gw.router.tenants
    c = await started_client(app)
    held = {**CHAT, "messages": [{"role": "user", "content": "hold"}]}
    running = [asyncio.create_task(c.post("/v1/chat/completions", json=held, headers=key("a"))) for _ in range(4)]
    await _until(lambda: q.running == 4)
    queued = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT, headers=key("a")))
    await _until(lambda: len(q.waiting) == 1)
    assert book.in_flight["a"] == 5
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    await _until(lambda: not q.waiting and book.in_flight["a"] == 4)
    release.set()
    assert [r.status_code for r in await asyncio.gather(*running)] == [200] * 4
    assert q.running == 0 and book.in_flight["a"] == 0 and gw.models["m"].local.tracker.in_flight == 0


async def test_past_its_queue_deadline_batch_goes_to_a_provider_only_when_the_tenant_may_pay(tmp_path):
    release = threading.Event()
    provider = Counting()
    app = tenant_gateway(tmp_path, {"a": {"priority": "batch", "batch_may_use_providers": True}},
                         local=_held_local(release, "ok"), providers={"p": provider}, models=[QUICK_M],
                         classes=[{"name": "interactive", "order": 0}, {"name": "batch", "order": 10, "max_wait_s": 1}])
    q = app.state.gateway.models["m"].queue
    c = await started_client(app)
    held = {**CHAT, "messages": [{"role": "user", "content": "hold"}]}
    running = [asyncio.create_task(c.post("/v1/chat/completions", json=held, headers=key("a"))) for _ in range(4)]
    await _until(lambda: q.running == 4)
    r = await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "provider/p" and provider.calls == 1
    release.set()
    await asyncio.gather(*running)
    assert q.running == 0 and not q.waiting


# ---- 9. operator routes and the listen address -----------------------------------------------------------------
@pytest.mark.parametrize("headers,metrics_status,detail", [
    ({}, 401, False),
    ({"authorization": f"Bearer {KEYS['a']}"}, 200, True),   # any tenant's key may see operational detail
    ({"authorization": "Bearer sk-nope"}, 401, False),
    (ADMIN, 200, True),
])
async def test_tenant_keys_open_metrics_and_ready_detail(tmp_path, headers, metrics_status, detail):
    c = await started_client(tenant_gateway(tmp_path))
    assert (await c.get("/metrics", headers=headers)).status_code == metrics_status
    r = await c.get("/ready", headers=headers)
    assert ("models" in r.json()) is detail


async def test_a_fleet_with_only_tenant_keys_may_listen_on_every_interface(tmp_path):
    from dataclasses import replace

    from lmfleet.engine.app import resolve_model
    from lmfleet.gateway import build_gateway

    (tmp_path / "a.keys").write_text(KEYS["a"] + "\n")
    fleet = parse_config({"ledger": {"path": str(tmp_path / "l.sqlite")}, "models": [MODEL_M],
                          "tenants": [{"name": "a", "api_keys_file": str(tmp_path / "a.keys")}]})
    model = replace(resolve_model(fleet.models[0], str(tmp_path / "w")), max_model_len=64)
    app = build_gateway(fleet, [model], serve_url="http://127.0.0.1:1", host="0.0.0.0", environ={},
                        load_tokenizer=lambda _: None)
    assert app.state.gateway.tenants.key_count == 1 and not app.state.gateway.tenants.is_open
    await app.state.gateway.close()
    (tmp_path / "a.keys").write_text("# emptied\n")
    with pytest.raises(GatewayConfigError, match=r"tenants\[0\]\.api_keys_file .* holds no key"):
        build_gateway(fleet, [model], serve_url="http://127.0.0.1:1", host="0.0.0.0", environ={},
                      load_tokenizer=lambda _: None)


async def test_without_tenants_there_is_no_local_queue_and_no_limit_bookkeeping(tmp_path):
    app = make_gateway(tmp_path, ok_local, api_keys={FLAT_KEY})
    gw = app.state.gateway
    assert gw.models["m"].queue is None and not gw.router.tenants.is_limited(gw.tenants.tenants["default"])
    c = await started_client(app)
    r = await c.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {FLAT_KEY}"})
    assert r.status_code == 200 and gw.router.tenants.in_flight["default"] == 0


async def test_a_tenant_spend_cap_is_exact_and_leaves_the_others_alone(tmp_path):
    """Tenant a's hourly_usd fits 3 worst-case paid requests: of 12 sent at once with overflow forced on, exactly 3
    reach the provider (the rest stay local), while tenant b (no cap of its own) is paid for every time; the
    ledger attributes each row to its tenant."""
    async def slow_provider(req):
        await asyncio.sleep(1)  # every reservation is taken before the first one settles
        return httpx.Response(200, json=chat_json(json.loads(req.content)["model"], "Remote."))

    worst_usd = (7 * 1.0 + 8 * 2.0) / 1e6  # 7 prompt tokens (the fakes' tokenizer), prices 1 $/1M in, 2 $/1M out
    app = tenant_gateway(tmp_path, {"a": {"limits": {"hourly_usd": 3.5 * worst_usd}}, "b": {}},
                         providers={"p": slow_provider})
    c = await started_client(app)
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers=ADMIN)
    answers = await asyncio.gather(*(c.post("/v1/chat/completions", json=CHAT, headers=key(t))
                                     for t in ["a"] * 12 + ["b"] * 4))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    served = [(t, r.headers["x-lmfleet-served-by"]) for t, r in zip(["a"] * 12 + ["b"] * 4, answers)]
    assert served.count(("a", "provider/p")) == 3 and served.count(("a", "local/m")) == 9
    assert served.count(("b", "provider/p")) == 4
    await app.state.gateway.recorder.flush()
    rows = app.state.gateway.recorder.ledger.rows()
    paid_a = [r for r in rows if r["tenant"] == "a" and r["served_by"] == "provider/p"]
    assert len(paid_a) == 3 and sum(r["cost_usd"] for r in paid_a) <= 3.5 * worst_usd
    assert sorted({r["tenant"] for r in rows}) == ["a", "b"] and len(rows) == 16


# ---- limits across gateway processes (the shared store) ----------------------------------------------------
async def test_two_gateways_of_a_two_worker_fleet_share_a_tenants_concurrency_limit(tmp_path):
    """``gateway.workers: 2``: two gateways (as two worker processes build them, each its own store) on one ledger
    file; tenant a
    (``max_concurrency: 2``) sends 3 held requests to each at once -> exactly 2 run, 4 get 429; once they end,
    the slots are free in both."""
    release = threading.Event()
    gateway = {"admin_key_env": ADMIN_KEY_ENV, "allowed_hosts": ["gw"], "workers": 2}
    apps = [_worker_gateway(tmp_path, release, gateway) for _ in range(2)]
    books = [app.state.gateway.router.tenants for app in apps]
    assert all(b.shared is not None for b in books)
    clients = [await started_client(app) for app in apps]
    held = {**CHAT, "messages": [{"role": "user", "content": "hold"}]}
    tasks = [asyncio.create_task(c.post("/v1/chat/completions", json=held, headers=key("a")))
             for c in clients for _ in range(3)]
    await _until(lambda: sum(t.done() for t in tasks) == 4)
    refused = [t.result() for t in tasks if t.done()]
    assert all(_error(r, 429)["code"] == "concurrency_limit_exceeded" for r in refused)
    assert sum(b.in_flight["a"] for b in books) == 2
    release.set()
    answers = await asyncio.gather(*(t for t in tasks if not t.done()))
    assert [r.status_code for r in answers] == [200, 200]
    for b in books:
        await asyncio.to_thread(b.shared.drain)
    assert books[0].shared.store.tenant_counts("tenant:a:rate", now=books[0].clock(), window_s=60).in_flight == 0
    for c in clients:
        assert (await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))).status_code == 200


def _worker_gateway(tmp_path, release: threading.Event, gateway: dict):
    """One of the gateways of a fleet with ``gateway`` (workers: 2): tenant a, ``max_concurrency: 2``."""
    path = tmp_path / "a.keys"
    path.write_text(f"{KEYS['a']}\n")
    tenants = [{"name": "a", "api_keys_file": str(path), "limits": {"max_concurrency": 2}}]
    return make_gateway(tmp_path, _held_local(release, "ok"),
                        extra={"tenants": tenants, "priority_classes": CLASSES, "gateway": gateway})


@pytest.mark.parametrize("workers, limits, budget, shared", [
    (1, {"max_concurrency": 2}, False, False),   # one process: in memory, no database on the path
    (2, {"max_concurrency": 2}, False, True),    # several: the store is opened for the limits alone
    (2, {"requests_per_minute": 5}, True, True),  # ... or the budget's store is reused
    (2, {"hourly_usd": 1.0}, False, False),      # a spend cap is not a rate limit (its own reservations)
    (2, {}, False, False),
])
def test_limits_are_shared_only_when_there_are_several_processes_to_share_them(tmp_path, workers, limits, budget,
                                                                               shared):
    path = tmp_path / "a.keys"
    path.write_text(f"{KEYS['a']}\n")
    extra = {"tenants": [{"name": "a", "api_keys_file": str(path), "limits": limits}], "priority_classes": CLASSES,
             "gateway": {"admin_key_env": ADMIN_KEY_ENV, "allowed_hosts": ["gw"], "workers": workers}}
    if budget:
        extra["budget"] = {"hourly_usd": 5}
    gw = make_gateway(tmp_path, ok_local, extra=extra).state.gateway
    book = gw.router.tenants
    assert (book.shared is not None) is shared
    if shared:
        assert book.shared.workers == workers and book.shared.slot_ttl_s == 10 + 5 + 60  # timeout + batch wait
        assert gw.recorder.store is book.shared.store  # closed with the ledger at shutdown
        if budget:
            assert gw.router.guard.store is book.shared.store
