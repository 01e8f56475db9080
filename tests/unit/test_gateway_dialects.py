"""Overflow to providers as they really answer: the gateway in front of the fake OpenAI server speaking each
provider's dialect (:mod:`lmfleet.testing.fast_openai_server`, ``--dialect``), a real HTTP server as the provider,
configured with that dialect (``providers[].dialect``): every entry of :data:`lmfleet.dialects.DIALECTS`.

Per dialect: the answer, its tool calls and its reasoning arrive intact under the client's model name, the
provider's own name comes in ``x-lmfleet-upstream-model`` and the ledger, usage is read wherever the provider
puts it and charged; without usage the answer is counted with the model's tokenizer and charged as estimated;
each dialect's 429, 5xx, content-filter and out-of-credit answers move the breaker and the retries as their shape
says. Adding a dialect: its row in :data:`EXPECTED_RETRY_AFTER_S`.
"""

from __future__ import annotations

import json

import httpx
import pytest

from lmfleet.dialects import DIALECTS
from lmfleet.testing.fake_provider import EMULATIONS, REASONING, TOOL_ARGUMENTS, emulation
from lmfleet.testing.fast_openai_server import FastServer
from lmfleet.testing.gateway_fakes import chat_json, make_gateway

NAMES = sorted(DIALECTS)
PROMPT = "What is the weather in Paris today?"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
             "city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
TOOL_CHOICE = {"type": "function", "function": {"name": "get_time"}}
PRICE_IN, PRICE_OUT = 1.0, 2.0  # make_gateway's provider price per 1M tokens


def answer_model(dialect: str) -> str:
    return f"{dialect}-model-2026-01-01"


@pytest.fixture(scope="module")
def servers():
    """One fake provider per dialect (answering with its own model name), and per usage placement one that
    sends no usage at all."""
    started: dict[str, FastServer] = {}
    try:
        for d in NAMES:
            started[d] = FastServer("--dialect", d, "--answer-model", answer_model(d)).__enter__()
        for d in ("openai", "together", "groq"):
            started[f"{d}/no-usage"] = FastServer("--dialect", d, "--answer-model", answer_model(d),
                                                  "--no-usage").__enter__()
        yield {k: s.base_url for k, s in started.items()}
    finally:
        for s in started.values():
            s.__exit__()


_STARTED: list = []


@pytest.fixture(autouse=True)
async def _stop_gateways():
    yield
    while _STARTED:
        await _STARTED.pop().state.gateway.close()


def no_local(req: httpx.Request) -> httpx.Response:
    raise AssertionError("the local deployment is down in these tests")


def gateway(tmp_path, providers: dict, dialect: str):
    """The gateway with ``providers``, each configured to speak ``dialect``."""
    app = make_gateway(tmp_path, no_local, providers, ready=False,  # local not ready: every request overflows
                       provider_extra={"dialect": dialect})
    app.state.gateway.start()
    _STARTED.append(app)
    return app, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


def events_of(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            out.append(json.loads(line[5:]))
    return out


def assemble(chunks: list[dict]) -> dict:
    """A streamed chat answer put together the way the openai client does: text, reasoning, tool calls."""
    msg: dict = {"content": "", "reasoning": "", "tool_calls": {}}
    for c in chunks:
        for ch in c.get("choices") or ():
            d = ch.get("delta") or {}
            msg["content"] += d.get("content") or ch.get("text") or ""
            msg["reasoning"] += d.get("reasoning_content") or d.get("reasoning") or ""
            for tc in d.get("tool_calls") or ():
                call = msg["tool_calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
    msg["tool_calls"] = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    return msg


async def last_row(app) -> dict:
    await app.state.gateway.recorder.flush()
    return app.state.gateway.recorder.ledger.rows()[-1]


def cost(prompt: int, completion: int) -> float:
    return (prompt * PRICE_IN + completion * PRICE_OUT) / 1e6


# ---- answers intact, usage read where each provider puts it ------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", NAMES)
async def test_tool_call_answer_through_each_dialect(servers, tmp_path, dialect, stream):
    app, c = gateway(tmp_path, {"p": servers[dialect]}, dialect)
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "stream": stream,
            "tools": TOOLS, "tool_choice": TOOL_CHOICE}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-lmfleet-served-by"] == "provider/p"
    assert r.headers["x-lmfleet-upstream-model"] == answer_model(dialect)
    if stream:
        chunks = events_of(r.text)
        assert chunks and all(ch["model"] == "m" for ch in chunks if "model" in ch)
        assert not any("usage" in ch for ch in chunks)  # the client did not ask for it
        assert not any(ch.get("x_groq", {}).get("usage") for ch in chunks) or dialect == "groq"
        msg = assemble(chunks)
        calls = msg["tool_calls"]
    else:
        obj = r.json()
        assert obj["model"] == "m"
        msg = obj["choices"][0]["message"]
        msg["reasoning"] = msg.get("reasoning_content") or msg.get("reasoning") or ""
        calls = [tc["function"] for tc in msg["tool_calls"]]
    # tools and tool_choice reached the provider: it called the function tool_choice named, arguments whole
    assert calls == [{"name": "get_time", "arguments": TOOL_ARGUMENTS}]
    assert msg["reasoning"] == (REASONING if emulation(dialect).reasoning else "")
    row = await last_row(app)
    completion = len(TOOL_ARGUMENTS.split()) + (len(REASONING.split()) if emulation(dialect).reasoning else 0)
    assert (row["input_tokens"], row["output_tokens"]) == (len(PROMPT.split()), completion)  # the provider's
    assert row["usage_source"] == "provider" and row["upstream_model"] == answer_model(dialect)
    assert row["cost_usd"] == pytest.approx(cost(len(PROMPT.split()), completion))


@pytest.mark.parametrize("dialect", NAMES)
async def test_streamed_text_and_usage_when_the_client_asks(servers, tmp_path, dialect):
    app, c = gateway(tmp_path, {"p": servers[dialect]}, dialect)
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = events_of(r.text)
    assert assemble(chunks)["content"] == " tok" * 5
    assert all(ch["model"] == "m" for ch in chunks)
    text = r.text
    assert text.rstrip().endswith("data: [DONE]")
    usages = [ch.get("usage") or ch.get("x_groq", {}).get("usage") for ch in chunks]
    reasoning = len(REASONING.split()) if emulation(dialect).reasoning else 0
    assert [u for u in usages if u] == [{"prompt_tokens": 7, "completion_tokens": 5 + reasoning,
                                         "total_tokens": 12 + reasoning}]
    row = await last_row(app)
    assert row["usage_source"] == "provider" and row["output_tokens"] == 5 + reasoning


# ---- answers without usage: counted with the model's tokenizer, charged, marked estimated -----------------
def expected_prompt(kind: str, tools: bool) -> int:
    """What the tests' tokenizer (one token per word, + one for the generation prompt) counts for the prompt."""
    if kind == "completions":
        return len(PROMPT.split())
    extra = len(json.dumps(TOOLS, separators=(",", ":")).split()) if tools else 0
    return len(PROMPT.split()) + 1 + extra


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind,tools", [("chat", False), ("chat", True), ("completions", False)])
@pytest.mark.parametrize("dialect", ["openai", "together", "groq"])
async def test_answer_without_usage_is_estimated_and_charged(servers, tmp_path, dialect, kind, tools, stream):
    app, c = gateway(tmp_path, {"p": servers[f"{dialect}/no-usage"]}, dialect)
    if kind == "chat":
        body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}]}
        if tools:
            body |= {"tools": TOOLS, "tool_choice": TOOL_CHOICE}
        path = "/v1/chat/completions"
    else:
        body, path = {"model": "m", "prompt": PROMPT}, "/v1/completions"
    r = await c.post(path, json={**body, "max_tokens": 6, "stream": stream})
    assert r.status_code == 200, r.text
    assert r.headers["x-lmfleet-upstream-model"] == answer_model(dialect)
    completion = len(TOOL_ARGUMENTS.split()) + 1 if tools else 6  # arguments and the function's name; else words
    row = await last_row(app)
    assert row["usage_source"] == "estimated"
    assert (row["input_tokens"], row["output_tokens"]) == (expected_prompt(kind, tools), completion)
    assert row["cost_usd"] == pytest.approx(cost(expected_prompt(kind, tools), completion)) and row["cost_usd"] > 0
    m = app.state.gateway.recorder.metrics
    assert m.tokens.labels("m", "provider/p", "output", "estimated")._value.get() == completion
    assert m.tokens.labels("m", "provider/p", "output", "provider")._value.get() == 0


# ---- error shapes: breaker and retries ------------------------------------------------------------------
def provider_ok(req: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=chat_json(json.loads(req.content)["model"], "Remote."))


EXPECTED_RETRY_AFTER_S = {"openai-compatible": 1.0, "openai": 1.5, "azure": 2.0, "deepseek": None, "openrouter": None,
                          "together": 1.0, "fireworks": 3.0, "groq": 2.0}
"""What each dialect's 429 asks for (None: nothing the gateway reads; the breaker's default applies). One row per
dialect of the table."""


def test_every_dialect_has_its_row():
    assert set(EXPECTED_RETRY_AFTER_S) == set(DIALECTS)


@pytest.mark.parametrize("dialect", NAMES)
async def test_rate_limited_blocks_the_provider_for_what_its_headers_say(servers, tmp_path, dialect):
    app, c = gateway(tmp_path, {"p": servers[dialect], "q": provider_ok}, dialect)
    body = {"model": "m", "messages": [{"role": "user", "content": f"hi [fake:429#{dialect}]"}], "max_tokens": 2}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "provider/q"
    breaker = app.state.gateway.providers["p"].breaker
    want = EXPECTED_RETRY_AFTER_S[dialect] or breaker.rate_limit_default_s
    assert want - 0.5 < breaker.retry_after_s() <= want


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", NAMES)
async def test_server_error_moves_on_to_the_next_provider(servers, tmp_path, dialect, stream):
    """A provider's 5xx (a retryable failure) counts against its breaker and the request goes on to the next
    backend of its plan (here the same server under a second name, which answers)."""
    app, c = gateway(tmp_path, {"p": servers[dialect], "q": servers[dialect]}, dialect)
    body = {"model": "m", "messages": [{"role": "user", "content": f"hi [fake:5xx*1#{dialect}{stream}]"}],
            "max_tokens": 2, "stream": stream}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-lmfleet-served-by"] == "provider/q"
    m = app.state.gateway.recorder.metrics
    assert m.retries.labels("m", "provider/p")._value.get() == 1
    assert m.upstream_failures.labels("provider/p", "UpstreamServerError")._value.get() == 1
    assert app.state.gateway.providers["p"].breaker.retry_after_s() == 0  # a 5xx is not a rate limit


async def test_azure_content_filter_is_the_clients_400_and_not_a_provider_failure(servers, tmp_path):
    calls = []

    def q(req):
        calls.append(req)
        return provider_ok(req)

    app, c = gateway(tmp_path, {"p": servers["azure"], "q": q}, "azure")
    body = {"model": "m", "messages": [{"role": "user", "content": "something violent [fake:filter]"}]}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert "content management policy" in r.json()["error"]["message"]
    assert calls == []  # the request itself is refused: no other provider is asked
    assert app.state.gateway.providers["p"].breaker.state().value == "closed"


@pytest.mark.parametrize("dialect", sorted(d for d, e in EMULATIONS.items() if e.out_of_credit))
async def test_out_of_credit_is_the_providers_failure_and_moves_on(servers, tmp_path, dialect):
    """An account out of quota or balance (OpenAI's 429 ``insufficient_quota``, a 402) is not a rate limit and
    not the client's: the provider's breaker counts a failure and the next backend serves."""
    app, c = gateway(tmp_path, {"p": servers[dialect], "q": provider_ok}, dialect)
    body = {"model": "m", "messages": [{"role": "user", "content": f"hi [fake:credit#{dialect}]"}], "max_tokens": 2}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "provider/q"
    m = app.state.gateway.recorder.metrics
    assert m.upstream_failures.labels("provider/p", "UpstreamMisconfigured")._value.get() == 1
    assert app.state.gateway.providers["p"].breaker.retry_after_s() == 0


async def test_a_key_in_the_wrong_header_is_refused(servers, tmp_path):
    """The fake checks the auth header its dialect names: the gateway configured as OpenAI sends
    ``Authorization`` to an Azure deployment, which refuses it: the gateway's misconfiguration, never relayed
    as the client's fault (here nothing else serves: 5xx)."""
    app, c = gateway(tmp_path, {"p": servers["azure"]}, "openai")
    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code >= 500
    m = app.state.gateway.recorder.metrics
    assert m.upstream_failures.labels("provider/p", "UpstreamMisconfigured")._value.get() == 1
