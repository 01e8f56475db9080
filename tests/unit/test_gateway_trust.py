"""The gateway fails closed (issue 13): auth that cannot silently turn off, every client mistake a 4xx, limits on
what a client can make it read or do, and one bad request that cannot move traffic or money."""

from __future__ import annotations

import json

import httpx
import pytest

from lmfleet.config import parse_config
from lmfleet.gateway.front.access import GatewayConfigError, allowed_hosts, check_exposure, host_allowed
from lmfleet.gateway.build import check_gateway_access, load_api_keys
from lmfleet.testing.gateway_fakes import chat_json, make_gateway, sse_events, started_client, stream_response

pytestmark = pytest.mark.usefixtures("close_started_gateways")

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}
ADMIN = {"authorization": "Bearer adm"}


def ok_local(req: httpx.Request) -> httpx.Response:
    body = json.loads(req.content)
    if body.get("stream"):
        return stream_response(sse_events(body["model"], ["Par", "is"]))
    return httpx.Response(200, json=chat_json(body["model"]))


def _gw(**kw):
    return parse_config({"gateway": kw, "models": [{"name": "m", "source": "builtin:tiny-random"}]}).gateway


def _assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    return err


# ---- 1. auth cannot turn off silently ------------------------------------------------------------
@pytest.mark.parametrize("gw,environ,file_text,match", [
    ({"api_keys_env": "K"}, {}, None, "K, but that variable is unset or empty"),
    ({"api_keys_env": "K"}, {"K": " , ,"}, None, "unset or empty"),
    ({"api_keys_file": "FILE"}, {}, "# only a comment\n\n", "holds no key"),
    ({"api_keys_file": "FILE"}, {}, None, "cannot be read"),
])
def test_configured_keys_that_load_none_refuse_to_start(tmp_path, gw, environ, file_text, match):
    if "api_keys_file" in gw:
        gw["api_keys_file"] = str(tmp_path / "keys.txt")
        if file_text is not None:
            (tmp_path / "keys.txt").write_text(file_text)
    with pytest.raises(GatewayConfigError, match=match) as ei:
        load_api_keys(_gw(**gw), environ)
    assert "\n" not in str(ei.value)


def test_keys_load_from_env_and_file(tmp_path):
    (tmp_path / "k").write_text("# team a\nsk-a\n  sk-b  \n")
    keys = load_api_keys(_gw(api_keys_env="K", api_keys_file=str(tmp_path / "k")), {"K": "sk-c, sk-d"})
    assert keys == {"sk-a", "sk-b", "sk-c", "sk-d"}


@pytest.mark.parametrize("host,keys,allow,refused", [
    ("127.0.0.1", set(), False, False),
    ("localhost", set(), False, False),
    ("::1", set(), False, False),
    ("0.0.0.0", set(), False, True),
    ("10.0.0.5", set(), False, True),
    ("gateway.example.com", set(), False, True),
    ("0.0.0.0", {"sk"}, False, False),
    ("0.0.0.0", set(), True, False),
])
def test_non_loopback_without_keys_needs_an_explicit_yes(host, keys, allow, refused):
    if refused:
        with pytest.raises(GatewayConfigError, match="allow_unauthenticated"):
            check_exposure(host, frozenset(keys), allow)
    else:
        check_exposure(host, frozenset(keys), allow)


def test_the_effective_host_is_checked_not_only_the_config(tmp_path):
    cfg = _gw()  # host 127.0.0.1 in the file, --host 0.0.0.0 on the command line
    assert check_gateway_access(cfg, None, {}) == frozenset()
    with pytest.raises(GatewayConfigError):
        check_gateway_access(cfg, "0.0.0.0", {})


def test_build_gateway_refuses_and_make_gateway_with_keys_works(tmp_path):
    from dataclasses import replace

    from lmfleet.engine.app import resolve_model
    from lmfleet.gateway import build_gateway

    fleet = parse_config({"gateway": {"api_keys_env": "NOPE"}, "ledger": {"path": str(tmp_path / "l.sqlite")},
                          "models": [{"name": "m", "source": "builtin:tiny-random"}]})
    model = replace(resolve_model(fleet.models[0], str(tmp_path / "w")), max_model_len=64)
    with pytest.raises(GatewayConfigError, match="NOPE"):
        build_gateway(fleet, [model], serve_url="http://127.0.0.1:1", environ={}, load_tokenizer=lambda _: None)
    with pytest.raises(GatewayConfigError, match="0.0.0.0"):
        build_gateway(fleet.model_copy(update={"gateway": _gw()}), [model], serve_url="http://127.0.0.1:1",
                      host="0.0.0.0", environ={}, load_tokenizer=lambda _: None)


# ---- 2. Content-Type, Host, no schema --------------------------------------------------------------
@pytest.mark.parametrize("ctype,status", [
    ("text/plain", 415),
    (None, 415),
    ("application/x-www-form-urlencoded", 415),
    ("application/json; charset=utf-8", 200),
    ("Application/JSON", 200),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_post_routes_need_json(tmp_path, ctype, status, path):
    c = await started_client(make_gateway(tmp_path, ok_local))
    body = CHAT if "chat" in path else {"model": "m", "prompt": "hi", "max_tokens": 4}
    headers = {"content-type": ctype} if ctype else {}
    r = await c.post(path, content=json.dumps(body).encode(), headers=headers)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        assert _assert_openai_error(r, 415)["code"] == "unsupported_media_type"


async def test_admin_post_needs_json_too(tmp_path):
    c = await started_client(make_gateway(tmp_path, ok_local))
    r = await c.post("/admin/overflow", content=b'{"mode": "force_on"}', headers={**ADMIN, "content-type": "text/plain"})
    _assert_openai_error(r, 415)


@pytest.mark.parametrize("header,listen,extra,ok", [
    ("127.0.0.1:8000", "127.0.0.1", None, True),
    ("localhost", "127.0.0.1", None, True),
    ("[::1]:8000", "127.0.0.1", None, True),
    ("evil.example.com", "127.0.0.1", None, False),
    ("evil.example.com:8000", "127.0.0.1", None, False),
    ("10.0.0.5:8000", "10.0.0.5", None, True),
    ("10.0.0.6:8000", "10.0.0.5", None, False),
    ("api.example.com", "10.0.0.5", ["api.example.com"], True),
    ("API.example.com.", "10.0.0.5", ["api.example.com"], True),
    ("a.svc.example.com", "10.0.0.5", ["*.example.com"], True),
    ("example.com", "10.0.0.5", ["*.example.com"], False),
    ("anything", "0.0.0.0", None, True),  # wildcard listen, no allow-list: any (keys are required there)
    ("anything", "0.0.0.0", ["api.example.com"], False),
    ("anything", "10.0.0.5", ["*"], True),
    (None, "127.0.0.1", None, True),
])
def test_trusted_hosts(header, listen, extra, ok):
    assert host_allowed(header, allowed_hosts(listen, extra)) is ok


async def test_untrusted_host_is_400_but_health_answers(tmp_path):
    c = await started_client(make_gateway(tmp_path, ok_local), base_url="http://rebound.attacker.example")
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert _assert_openai_error(r, 400)["code"] == "invalid_host"
    assert (await c.get("/ready")).status_code == 400
    assert (await c.get("/health")).status_code == 200


async def test_no_openapi_schema_unless_asked(tmp_path):
    c = await started_client(make_gateway(tmp_path, ok_local))
    assert (await c.get("/openapi.json")).status_code == 404
    c = await started_client(make_gateway(tmp_path, ok_local, extra={"gateway": {"openapi": True, "allowed_hosts": ["gw"],
                                                                           "admin_key_env": "LMFLEET_FAKE_ADMIN_KEY"}}))
    assert (await c.get("/openapi.json")).status_code == 200


# ---- 3. operational detail behind a key ---------------------------------------------------------
@pytest.mark.parametrize("headers,detail", [
    ({}, False),
    ({"authorization": "Bearer wrong"}, False),
    (ADMIN, True),
    ({"authorization": "Bearer sk-client"}, True),
])
async def test_ready_is_bare_without_a_key(tmp_path, headers, detail):
    c = await started_client(make_gateway(tmp_path, ok_local, api_keys={"sk-client"}, ready=False))
    r = await c.get("/ready", headers=headers)
    assert r.status_code == 503
    if detail:
        assert r.json()["models"]["m"]["message"] == "engine is dead"
    else:
        assert r.json() == {"ready": False}


@pytest.mark.parametrize("headers,status", [({}, 401), ({"authorization": "Bearer x"}, 401), (ADMIN, 200),
                                            ({"authorization": "Bearer sk-client"}, 200)])
async def test_metrics_need_a_key(tmp_path, headers, status):
    c = await started_client(make_gateway(tmp_path, ok_local, api_keys={"sk-client"}))
    r = await c.get("/metrics", headers=headers)
    assert r.status_code == status
    if status == 401:
        _assert_openai_error(r, 401)


async def test_metrics_public_and_keyless_gateway(tmp_path):
    gw = {"metrics_public": True, "allowed_hosts": ["gw"], "admin_key_env": "LMFLEET_FAKE_ADMIN_KEY"}
    c = await started_client(make_gateway(tmp_path, ok_local, extra={"gateway": gw}))
    assert (await c.get("/metrics")).status_code == 200
    c = await started_client(make_gateway(tmp_path, ok_local, admin_key=None))  # no key of any kind: nothing to send
    assert (await c.get("/metrics")).status_code == 200
    assert "models" in (await c.get("/ready")).json()


# ---- 4-7. bodies that used to be 500s --------------------------------------------------------------
_DEEP = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
_DEEP_OK_FOR_PARSER = b'{"model": "m", "x": ' + b"[" * 200 + b"]" * 200 + b', "messages": []}'


@pytest.mark.parametrize("raw,param,words", [
    (_DEEP, None, "nested"),
    (_DEEP_OK_FOR_PARSER, None, "nested"),
    (json.dumps({**CHAT, "logit_bias": {"1": 5}}).replace("5}", "NaN}").encode(), None, "finite"),
    (json.dumps({**CHAT, "user": 1}).replace(": 1}", ": Infinity}").encode(), None, "finite"),
    (json.dumps({**CHAT, "user": 1}).replace(": 1}", ": -Infinity}").encode(), None, "finite"),
    (json.dumps({**CHAT, "user": 1}).replace(": 1}", ": 1e999}").encode(), None, "finite"),
    (json.dumps({**CHAT, "temperature": 1}).replace("\"temperature\": 1", "\"temperature\": NaN").encode(), None, "finite"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', None, "surrogate"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "ok"}], "\\udfff": 1}', None, "surrogate"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode(),
     "messages[0].content[0].text", "string"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}).encode(),
     "messages[0].content[0].text", "string"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": [5]}]}).encode(), "messages[0].content[0]", "object"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": [{"type": 3}]}]}).encode(),
     "messages[0].content[0]", "type"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None, "JSON"),
    (b'{"model": "m", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None, "JSON"),
])
async def test_hostile_bodies_are_400(tmp_path, raw, param, words):
    app = make_gateway(tmp_path, ok_local)
    c = await started_client(app)
    r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    err = _assert_openai_error(r, 400)
    assert err["param"] == param and words in err["message"], err
    assert app.state.gateway.models["m"].local.tracker.in_flight == 0


# ---- 8. size limits ---------------------------------------------------------------------------------
async def test_declared_body_over_the_limit_is_413_before_reading(tmp_path):
    gw = {"max_body_bytes": 2048, "allowed_hosts": ["gw"], "admin_key_env": "LMFLEET_FAKE_ADMIN_KEY"}
    c = await started_client(make_gateway(tmp_path, ok_local, extra={"gateway": gw}))
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4000}]}
    r = await c.post("/v1/chat/completions", json=big)
    assert _assert_openai_error(r, 413)["code"] == "request_too_large"

    async def chunks():  # no Content-Length: counted while reading
        for _ in range(10):
            yield b" " * 1000
        yield json.dumps(CHAT).encode()

    r = await c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert _assert_openai_error(r, 413)["code"] == "request_too_large"
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "prompt": "x" * (64 * 1024 + 1)}, "prompt"),  # one "word" for the counting tokenizer
    ({"model": "m", "prompt": ["a", "x" * (64 * 1024 + 1)]}, "prompt"),
    ({"model": "m", "prompt": list(range(64))}, "prompt"),
    ({"model": "m", "prompt": [[1], list(range(70))]}, "prompt"),
])
async def test_prompts_too_long_by_their_size_alone_are_rejected_before_tokenizing(tmp_path, body, param):
    c = await started_client(make_gateway(tmp_path, ok_local))  # max_model_len 64
    r = await c.post("/v1/completions", json=body)
    err = _assert_openai_error(r, 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == param


async def test_chat_size_check_counts_user_text_only(tmp_path):
    c = await started_client(make_gateway(tmp_path, ok_local))
    big = "y" * (64 * 1024 + 1)
    r = await c.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": big}]})
    assert _assert_openai_error(r, 400)["code"] == "context_length_exceeded"
    # an assistant turn a template may drop (reasoning) is left to the tokenizer
    r = await c.post("/v1/chat/completions", json={**CHAT, "messages": [
        {"role": "assistant", "content": big}, {"role": "user", "content": "hi"}]})
    assert r.status_code == 200


@pytest.mark.parametrize("prompt,n,ok", [
    (["p"] * 128, 1, True), (["p"] * 129, 1, False), (["p"] * 64, 2, True), (["p"] * 65, 2, False),
    ("p", 128, True), ([[1, 2]] * 200, 1, False), ([1, 2, 3], 1, True),
])
async def test_completions_cap_prompts_times_n(tmp_path, prompt, n, ok):
    c = await started_client(make_gateway(tmp_path, ok_local))
    r = await c.post("/v1/completions", json={"model": "m", "prompt": prompt, "n": n, "max_tokens": 1})
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert _assert_openai_error(r, 400)["param"] == "prompt"


# ---- 10. one request cannot take a model down ----------------------------------------------------------
@pytest.mark.parametrize("events,ready", [
    ([(0, "a"), (1, "b")], True),
    ([(0, "a"), (1, "b"), (2, "c")], False),
    ([(0, "a"), (0.1, "a"), (0.2, "a"), (0.3, "a")], True),  # one request's retries count once
    ([(0, "a"), (1, "b"), (11.5, "c")], True),  # outside the 10 s window
    ([(0, "a"), (5, "b"), (11, "c"), (12, "d")], False),
])
def test_health_needs_failures_from_several_requests(events, ready):
    from lmfleet.gateway.routing.health import HealthBoard

    board = HealthBoard({"m": "app"}, None)
    requests: dict[str, object] = {}
    for t, who in events:
        board.note_failure("m", "local engine error: boom", requests.setdefault(who, object()), now=t)
    assert board.is_ready("m") is ready


@pytest.mark.parametrize("local,ready_after_one", [
    (lambda req: httpx.Response(500, json={"error": {"message": "boom"}}), True),
    (lambda req: httpx.Response(503, json={"error": {"message": "overloaded"}}), True),
    (lambda req: httpx.Response(400, json={"error": {"message": "bad"}}), True),
    (lambda req: httpx.Response(422, json={"error": {"message": "bad"}}), True),
    # the engine's own word that it is dead, and a connection the engine refuses: at once
    (lambda req: httpx.Response(500, json={"error": {"message": "EngineCore encountered an issue. See stack trace "
                                                                "(above) for the root cause.", "type": "InternalServerError"}}), False),
    (lambda req: (_ for _ in ()).throw(httpx.ConnectError("refused")), False),
])
async def test_what_one_request_can_do_to_readiness(tmp_path, local, ready_after_one):
    app = make_gateway(tmp_path, local)
    c = await started_client(app)
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert 400 <= r.status_code < 600 and r.status_code != 500
    assert app.state.gateway.health.is_ready("m") is ready_after_one


# ---- 13. Retry-After from a backend is finite ----------------------------------------------------------
@pytest.mark.parametrize("value", ["inf", "1e999", "-1", "nan", "Fri, 31 Dec 9999 23:59:59 GMT"])
async def test_hostile_retry_after_gives_a_clean_429(tmp_path, value):
    def limited(req):
        return httpx.Response(429, headers={"retry-after": value}, json={"error": {"message": "slow down"}})

    app = make_gateway(tmp_path, limited, {"p": limited})
    c = await started_client(app)
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers=ADMIN)
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert _assert_openai_error(r, 429)["code"] == "rate_limited"
    assert 1 <= int(r.headers["retry-after"]) <= 300
    assert app.state.gateway.providers["p"].breaker.retry_after_s() <= 300


# ---- 14. only the half-open probe closes a provider's breaker --------------------------------------------
def _provider(clock):
    from lmfleet.config.models import ProviderConfig
    from lmfleet.gateway.routing.backends import ProviderBackend
    from lmfleet.gateway.front.errors import UpstreamServerError
    from lmfleet.gateway.relay.upstream import HttpPool
    from lmfleet.overflow import CircuitBreaker

    cfg = ProviderConfig(name="p", base_url="http://127.0.0.1:1/v1", model_map={"m": "x"},
                         breaker={"consecutive_failures": 2, "cooldown_s": 10})
    p = ProviderBackend(cfg, HttpPool(max_connections=1), None, CircuitBreaker.from_config(cfg.breaker, clock=clock))
    return p, UpstreamServerError("boom", status=500)


async def test_a_long_stream_from_before_opening_does_not_close_the_breaker():
    from lmfleet.gateway.routing.backends import Ask
    from lmfleet.overflow import BreakerState

    t = [0.0]
    p, err = _provider(lambda: t[0])
    ask = Ask("r", 10, None, None, None)
    long_stream = await p.acquire(ask)  # admitted while closed
    for _ in range(2):
        p.fail(await p.acquire(ask), err)
    assert p.breaker.state() is BreakerState.OPEN and await p.acquire(ask) is None
    t[0] = 10.0
    probe = await p.acquire(ask)
    assert probe is not None and await p.acquire(ask) is None  # one probe at a time
    p.finish(long_stream, 100)  # ends during half-open: proves nothing about now
    assert p.breaker.state() is BreakerState.HALF_OPEN
    p.cancel(probe)  # the client went away: neutral, and the probe slot is free again
    assert p.breaker.state() is BreakerState.HALF_OPEN
    p.finish(await p.acquire(ask), 5)  # the new probe's success closes it
    assert p.breaker.state() is BreakerState.CLOSED and p.in_flight == 0


# ---- 18. cleaning an upstream message is linear ---------------------------------------------------------
def test_clean_message_is_bounded_on_whitespace_runs():
    import time

    from lmfleet.gateway.relay.upstream import MAX_MESSAGE_CHARS, clean_message

    raw = "Message: a" + " " * 200_000 + "b (Request ID: 1)"
    t0 = time.perf_counter()
    out = clean_message(raw)
    assert time.perf_counter() - t0 < 0.5  # was ~2 s at 20,000 spaces, quadratic
    assert len(out) <= MAX_MESSAGE_CHARS


# ---- 16. content parts per model; the engine fetches no media URL unless told --------------------------
@pytest.mark.parametrize("parts,allowed,param", [
    ([{"type": "text", "text": "hi"}], None, None),
    ([{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}], None, "messages[0].content[0].type"),
    ([{"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {}}], None, "messages[0].content[1].type"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], ["text", "image_url"], None),
])
async def test_content_part_types_are_allow_listed_per_model(tmp_path, parts, allowed, param):
    extra = None
    if allowed is not None:
        extra = {"models": [{"name": "m", "source": "builtin:tiny-random", "content_parts": allowed,
                             "deployment": {"max_ongoing_requests": 4, "request_timeout_s": 10}}]}
    c = await started_client(make_gateway(tmp_path, ok_local, extra=extra))
    r = await c.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": parts}]})
    if param is None:
        assert r.status_code == 200, r.text
    else:
        err = _assert_openai_error(r, 400)
        assert err["param"] == param and err["code"] == "unsupported_content_part" and "accepts ['text']" in err["message"]


@pytest.mark.parametrize("extra_args,domains", [
    ({}, ["media-fetching-disabled.invalid"]),
    ({"allowed_media_domains": ["upload.example.com"]}, ["upload.example.com"]),
])
def test_engine_fetches_media_only_from_configured_domains(extra_args, domains):
    from lmfleet.config.models import ModelConfig
    from lmfleet.engine.app import llm_config_kwargs

    m = ModelConfig(name="m", source="builtin:tiny-random", engine={"extra_args": extra_args})
    assert llm_config_kwargs(m, "/weights")["engine_kwargs"]["allowed_media_domains"] == domains


def test_content_parts_config_is_checked():
    from pydantic import ValidationError

    from lmfleet.config.models import ModelConfig

    with pytest.raises(ValidationError, match="content_parts"):
        ModelConfig(name="m", source="builtin:tiny-random", content_parts=["Image URL"])


# ---- 9. slow clients, idle connections and the connection cap, on a real uvicorn server -------------------
async def _tiny_app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _uvicorn(**gateway):
    import asyncio
    import socket

    import uvicorn

    from lmfleet.config.models import GatewayConfig
    from lmfleet.gateway.front.server import uvicorn_options

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_tiny_app, host="127.0.0.1", port=port, log_level="error", lifespan="off",
                                           **uvicorn_options(GatewayConfig(**gateway))))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    return server, task, port


async def _closed_after(reader, limit_s: float) -> float | None:
    """Seconds until the server closes the connection (None: still open after ``limit_s``)."""
    import asyncio
    import time

    t0 = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(1024), limit_s)
    except asyncio.TimeoutError:
        return None
    except ConnectionError:
        data = b""
    assert data == b"" or data.startswith(b"HTTP/1.1 4"), data
    return time.monotonic() - t0


@pytest.mark.timeout(20)
async def test_slowloris_and_idle_connections_are_closed():
    import asyncio

    server, task, port = await _uvicorn(header_timeout_s=1.0, keep_alive_s=1)
    try:
        # a slowloris client: a valid request line, then one header byte every 0.2 s, for ever
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")

        async def trickle():
            for _ in range(40):
                writer.write(b"X")
                await asyncio.sleep(0.2)

        dripper = asyncio.create_task(trickle())
        closed = await _closed_after(reader, 5.0)
        dripper.cancel()
        assert closed is not None and closed < 3.0, closed  # not after the 8 s the trickle would take
        writer.close()

        # a connection that never sends a byte
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        closed = await _closed_after(reader, 5.0)
        assert closed is not None and closed < 3.0
        writer.close()

        # a normal request on the same server is answered, and its kept-alive connection is closed when idle
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"ok"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        await asyncio.sleep(1.5)  # still no second request after the head deadline: the keep-alive timer closes it
        assert await _closed_after(reader, 3.0) is not None
        writer.close()
    finally:
        server.should_exit = True
        await task


@pytest.mark.timeout(20)
async def test_head_size_and_connection_cap():
    import asyncio

    server, task, port = await _uvicorn(header_timeout_s=5.0, max_connections=2)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 70_000)
        assert await _closed_after(reader, 3.0) is not None  # over the 64 KiB head limit, no end in sight
        writer.close()

        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head = await asyncio.wait_for(reader.read(200), 5)
        assert head.startswith(b"HTTP/1.1 503"), head
        for _, w in idle:
            w.close()
        writer.close()
    finally:
        server.should_exit = True
        await task


# ---- 17. cluster command lines: validated, quoted, token file permissions -------------------------------
@pytest.mark.parametrize("node,ok", [
    ({"address": "10.0.0.2"}, True),
    ({"address": "fe80::1"}, True),
    ({"address": "gpu-7.dc1.example.com"}, True),
    ({"address": "10.0.0.2; rm -rf ~"}, False),
    ({"address": "$(reboot)"}, False),
    ({"address": "-oProxyCommand=x"}, False),
    ({"address": "a", "labels": {"zone": "us-east-1a"}}, True),
    ({"address": "a", "labels": {"zone": "a b"}}, False),
    ({"address": "a", "labels": {"zone": "$(id)"}}, False),
    ({"address": "a", "labels": {"zone": "x'y"}}, False),
])
def test_node_addresses_and_labels_are_validated(node, ok):
    from pydantic import ValidationError

    from lmfleet.config.models import NodeConfig

    if ok:
        NodeConfig(**node)
    else:
        with pytest.raises(ValidationError):
            NodeConfig(**node)


def test_launcher_lines_quote_what_they_join():
    import shlex

    from lmfleet.cluster.launcher import launcher_config, manual_commands
    from lmfleet.config.models import ClusterConfig

    c = ClusterConfig.model_validate({"head": {"address": "10.0.0.1"}, "workers": [{"address": "10.0.0.2"}],
                                      "ssh": {"user": "ops team;id", "key_path": "~/.ssh/my key"}})
    ssh = next(line for line in manual_commands(c) if line.startswith("ssh "))
    assert "'ops team;id@10.0.0.2'" in ssh and "~/'.ssh/my key'" in ssh
    for line in launcher_config(c)["worker_start_ray_commands"][1:]:
        assert "--address=$RAY_HEAD_IP:6379" in line  # left for the launcher's shell to expand
        shlex.split(line)


def test_cluster_up_warns_on_a_wide_token_file(tmp_path, capsys):
    from lmfleet.cli.cluster import _ensure_token

    token = tmp_path / "auth_token"
    token.write_text("secret")
    token.chmod(0o644)
    _ensure_token(str(token))
    err = capsys.readouterr().err
    assert "readable by others" in err and "0644" in err and "secret" not in err
    token.chmod(0o600)
    _ensure_token(str(token))
    assert capsys.readouterr().err == ""
