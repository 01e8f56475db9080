"""The provider dialect table (:mod:`lmfleet.dialects`) and what reads it: detection from the base URL, the
configuration's check, the body a stream is sent with, whose fault an error is, the rate-limit headers read,
where usage and reasoning are found, and the fake provider's emulations (tables of cases; no I/O)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from multidict import CIMultiDict

from lmfleet.config import ConfigError, parse_config
from lmfleet.dialects import DIALECTS, GENERIC, REASONING_KEYS, USAGE_PATHS, detect, markdown_table, resolve
from lmfleet.gateway.relay import sse
from lmfleet.gateway.relay.upstream import Endpoint, HttpPool, _error_from_response, prepare_body, retry_after_from
from lmfleet.gateway.relay.usage import answer_text
from lmfleet.gateway.front.errors import (
    UpstreamMisconfigured,
    UpstreamRateLimited,
    UpstreamRejected,
    UpstreamServerError,
)
from lmfleet.testing.fake_provider import EMULATIONS, Directives, answer, emulation


@pytest.mark.parametrize("url, name", [
    ("https://api.openai.com/v1", "openai"),
    ("https://myres.openai.azure.com/openai/deployments/gpt4o/v1", "azure"),
    ("https://myres.cognitiveservices.azure.com/openai/v1", "azure"),
    ("https://api.deepseek.com/v1", "deepseek"),
    ("https://openrouter.ai/api/v1", "openrouter"),
    ("https://api.together.xyz/v1", "together"),
    ("https://api.fireworks.ai/inference/v1", "fireworks"),
    ("https://api.groq.com/openai/v1", "groq"),
    ("https://API.GROQ.COM/openai/v1", "groq"),
    ("http://10.0.0.5:8000/v1", "openai-compatible"),
    ("https://notopenai.com/v1", "openai-compatible"),  # a suffix is not a parent domain
    ("https://api.openai.com.evil.example/v1", "openai-compatible"),
])
def test_detect_from_the_base_url(url, name):
    assert detect(url).name == name


def test_a_configured_dialect_wins_over_the_url():
    assert resolve("azure", "http://127.0.0.1:9/v1").name == "azure"
    assert resolve(None, "https://api.groq.com/openai/v1").name == "groq"
    assert resolve(None, "http://127.0.0.1:9/v1") is GENERIC


def _fleet(provider: dict):
    return parse_config({"models": [{"name": "m", "source": "builtin:tiny-random"}],
                         "providers": [{"name": "p", "base_url": "http://x/v1", "model_map": {"m": "y"}, **provider}]},
                        "fleet.yaml")


def test_config_takes_a_known_dialect_and_leaves_it_out_by_default():
    assert _fleet({"dialect": "groq"}).providers[0].dialect == "groq"
    assert _fleet({}).providers[0].dialect is None


def test_config_names_the_known_dialects_for_an_unknown_one():
    with pytest.raises(ConfigError) as ei:
        _fleet({"dialect": "grok"})
    msg = str(ei.value)
    assert "providers[0].dialect" in msg and "unknown dialect 'grok'" in msg
    assert all(name in msg for name in DIALECTS), msg


@pytest.mark.parametrize("name, headers", [
    ("openai", {"authorization": "Bearer sk-1"}),
    ("azure", {"api-key": "sk-1"}),
    ("openai-compatible", {"authorization": "Bearer sk-1"}),
])
def test_auth_headers(name, headers):
    assert DIALECTS[name].auth_headers("sk-1") == headers
    assert DIALECTS[name].auth_headers(None) == {}


NO_OPTIONS = GENERIC.__class__("no-options", stream_options=False)
"""A dialect that refuses ``stream_options`` (no provider of the table does today)."""


@pytest.mark.parametrize("dialect, body, sent", [
    (GENERIC, {}, {"stream_options": {"include_usage": True}}),
    (GENERIC, {"stream_options": {"include_usage": False}}, {"stream_options": {"include_usage": True}}),
    (GENERIC, {"stream_options": {"x": 1}}, {"stream_options": {"x": 1, "include_usage": True}}),
    (DIALECTS["together"], {}, {}),  # its usage comes in the last chunk anyway: nothing added
    (DIALECTS["together"], {"stream_options": {"include_usage": True}}, {"stream_options": {"include_usage": True}}),
    (DIALECTS["groq"], {}, {}),
    (NO_OPTIONS, {"stream_options": {"include_usage": True}}, {}),
    (NO_OPTIONS, {}, {}),
])
def test_stream_body(dialect, body, sent):
    body = {"messages": [], **body}
    before = json.dumps(body)
    assert dialect.stream_body(body) == {"messages": [], **sent}
    assert json.dumps(body) == before  # the client's body is not changed


def _endpoint(name: str) -> Endpoint:
    d = DIALECTS[name]
    return Endpoint("provider/p", "provider p", "http://x/v1", "up", HttpPool(max_connections=1),
                    d.auth_headers("sk-secret"), dialect=d)


def test_prepare_body_sends_the_upstream_name_and_asks_usage_per_dialect():
    body = {"model": "m", "messages": [], "stream": True}
    assert json.loads(prepare_body(_endpoint("openai"), body, True)) == {
        "model": "up", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
    plain = {"model": "up", "messages": [], "stream": True}
    assert json.loads(prepare_body(_endpoint("fireworks"), body, True)) == plain
    assert json.loads(prepare_body(_endpoint("openai"), body, False)) == plain


def _err(code, message: str = "x") -> bytes:
    return json.dumps({"error": {"message": message, "code": code}}).encode()


@pytest.mark.parametrize("name, status, code, kind", [
    ("azure", 400, "content_filter", UpstreamRejected),
    ("openai", 400, "content_filter", UpstreamRejected),  # any 4xx: the status says it already
    ("openai", 429, "insufficient_quota", UpstreamMisconfigured),
    ("openai", 429, "rate_limit_exceeded", UpstreamRateLimited),
    ("openai-compatible", 429, "insufficient_quota", UpstreamRateLimited),
    ("deepseek", 402, "invalid_request_error", UpstreamMisconfigured),
    ("openrouter", 402, 402, UpstreamMisconfigured),
    ("openai-compatible", 402, None, UpstreamRejected),
    ("groq", 503, None, UpstreamServerError),
    ("azure", 500, "content_filter", UpstreamRejected),  # the client's, whatever the status
])
def test_whose_fault_an_error_is(name, status, code, kind):
    err = _error_from_response(_endpoint(name), status, _err(code), CIMultiDict())
    assert type(err) is kind
    if kind is UpstreamRejected:
        assert 400 <= err.status < 500 and not err.retryable


GROQ_429 = {"retry-after-ms": "900", "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "7s"}


@pytest.mark.parametrize("name, headers, seconds", [
    ("openai-compatible", GROQ_429, 0.9),  # reads every header known
    ("groq", GROQ_429, 7.0),  # Groq sends no retry-after-ms: not read
    ("deepseek", GROQ_429, None),  # only retry-after
    ("deepseek", {"retry-after": "3"}, 3.0),
    ("azure", {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "4s"}, None),
    ("fireworks", {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "4s"}, 4.0),
    ("openrouter", {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "1764763200000"}, None),
])
def test_rate_limit_headers_read_per_dialect(name, headers, seconds):
    got = retry_after_from(CIMultiDict(headers), DIALECTS[name].rate_limits)
    assert got == (pytest.approx(seconds) if seconds is not None else None)


def test_usage_and_reasoning_are_found_wherever_a_dialect_puts_them():
    assert ("usage",) == USAGE_PATHS[0] and ("x_groq", "usage") in USAGE_PATHS
    groq = {"choices": [], "x_groq": {"id": "r", "usage": {"prompt_tokens": 3, "completion_tokens": 4}}}
    assert sse.usage_of(groq) == (3, 4)
    assert sse.usage_of(groq, paths=(("usage",),)) is None
    assert all(d.usage_marker == b'"usage":' for d in DIALECTS.values())  # what the relay's fast path tests for
    assert {"reasoning_content", "reasoning"} <= set(REASONING_KEYS)
    for key in REASONING_KEYS:
        assert answer_text({"choices": [{"delta": {key: "hm", "content": "ok"}}]}) == "okhm"


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_the_fake_provider_emulates_every_dialect_from_its_entry(name):
    """Each emulation's samples fit the table: its rate-limit values go to headers its dialect sends, its
    content filter is a client's error, its out-of-credit answer the provider's; it takes the dialect's key."""
    d, emu = DIALECTS[name], emulation(name)
    assert set(EMULATIONS) <= set(DIALECTS)
    emu.rate_limited_headers(d)
    if emu.content_filter is not None:
        assert d.fault(emu.content_filter.status, emu.content_filter.body["error"]["code"]) == "client"
    if emu.out_of_credit is not None:
        assert d.fault(emu.out_of_credit.status, emu.out_of_credit.body["error"].get("code")) == "provider"
    if emu.reasoning:
        assert d.reasoning_keys
    req = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 2}
    ok = answer(name, True, req, d.auth_headers("sk-1"), Directives(), max_tokens=8, model="m")
    assert ok.status == 200 and ok.events[-1] == b"data: [DONE]\n\n"
    other = "api-key" if d.auth_header == "authorization" else "authorization"
    assert answer(name, True, req, {other: "sk-1"}, Directives(), max_tokens=8, model="m").status == 401


def test_the_docs_show_the_table_as_it_is():
    """docs/providers.md carries ``python -m lmfleet.dialects``'s output; after changing the table, print it again."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "providers.md").read_text()
    assert markdown_table() in docs


@pytest.mark.parametrize("name", ["openai", "azure"])
def test_the_key_is_redacted_whichever_header_carries_it(name):
    err = _error_from_response(_endpoint(name), 401, _err(None, "bad key sk-secret"), CIMultiDict())
    assert "sk-secret" not in err.message and "***" in err.message
