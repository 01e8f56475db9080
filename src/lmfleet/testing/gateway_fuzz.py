"""Property-based fuzzing of the OpenAI routes: whatever JSON a client sends, the gateway answers 2xx or an
OpenAI-shaped 4xx, never a 5xx; no local slot stays in flight; every request is counted.

Bodies are generated with hypothesis: the known fields with valid, boundary and wrong-typed values, random
extra fields, deep nesting, NaN/Infinity, huge numbers, lone surrogates, and raw bytes that are not JSON.
tests/unit/test_gateway_fuzz.py runs it briefly; benchmarks/fuzz_gateway.py runs it longer.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmfleet.testing.gateway_fakes import chat_json, make_gateway, sse_events, stream_response

ERROR_KEYS = {"message", "type", "param", "code"}


def _local(req: httpx.Request) -> httpx.Response:
    body = json.loads(req.content)
    if body.get("stream"):
        return stream_response(sse_events("m", ["Par", "is"]))
    return httpx.Response(200, json=chat_json("m"))


# ---- strategies ---------------------------------------------------------------------------------------
_text = st.one_of(st.text(max_size=20), st.sampled_from(["", " ", "\ud800", "\udfff x", "\x00", "m", "text",
                                                          "image_url", "user", "assistant", "é" * 5]))
_number = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, -1, 0.5, 2, 128, 129, 2**63, -(2**63) - 1, 1e308]))
_scalar = st.one_of(st.none(), st.booleans(), _number, _text)
_json = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(_text, inner, max_size=4)), max_leaves=12)


_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(_text, _json)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "video_url", "file", "x"]),
                           "image_url": st.fixed_dictionaries({"url": st.sampled_from(
                               ["http://169.254.169.254/", "data:image/png;base64,AAAA", "file:///etc/passwd"])})}),
    _json)
_content = st.one_of(_text, st.lists(_part, max_size=3), _json)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]),
                           "content": _content}),
    _json)
_messages = st.one_of(st.lists(_message, min_size=1, max_size=4), _json)
_prompt = st.one_of(_text, st.lists(_text, min_size=1, max_size=5), st.lists(st.integers(-5, 2**40), max_size=8),
                    st.lists(st.lists(st.integers(0, 100), max_size=4), max_size=4), _json)
_FIELDS = {
    "model": st.one_of(st.just("m"), st.just("m"), _text, _json),
    "temperature": st.one_of(st.floats(-1, 3), _json), "top_p": st.one_of(st.floats(-0.5, 1.5), _json),
    "n": st.one_of(st.integers(-2, 200), _json), "max_tokens": st.one_of(st.integers(-2, 100), _json),
    "max_completion_tokens": st.one_of(st.integers(-2, 100), _json), "stream": st.one_of(st.booleans(), _json),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": _json}), _json),
    "stop": st.one_of(_text, st.lists(_text, max_size=3), _json), "seed": st.one_of(_number, _json),
    "top_k": st.one_of(st.integers(-3, 100), _json), "logprobs": _json, "top_logprobs": _json,
    "presence_penalty": _json, "frequency_penalty": _json, "logit_bias": _json, "user": _json, "tools": _json,
    "response_format": _json,
}


@st.composite
def request_bodies(draw) -> tuple[str, bytes]:
    """(path, raw body) for one request."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    kind = draw(st.integers(0, 19))
    if kind == 0:  # bytes that are (mostly) not JSON
        return path, draw(st.one_of(st.binary(max_size=64), st.sampled_from(
            [b"", b"null", b"[]", b'"x"', b"{", b'{"model": "m",}', b"\xff\xfe{}", b'{"model": NaN}'])))
    if kind == 1:  # deep nesting somewhere (written by hand: json.dumps itself would recurse)
        depth = draw(st.sampled_from([62, 63, 64, 300, 5000, 100_000]))
        opener, closer = (b"[", b"]") if draw(st.booleans()) else (b'{"a":', b"}")
        where = draw(st.sampled_from(["x", "messages", "prompt", "stop"]))
        return path, (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "'
                      + where.encode() + b'": ' + opener * depth + b"1" + closer * depth + b"}")
    body: dict[str, Any] = {}
    body["model"] = draw(_FIELDS["model"])
    if path.endswith("chat/completions") or draw(st.booleans()):
        body["messages"] = draw(_messages)
    if path.endswith("/completions") and not path.endswith("chat/completions") or draw(st.booleans()):
        body["prompt"] = draw(_prompt)
    for name in draw(st.lists(st.sampled_from(sorted(_FIELDS)), max_size=6, unique=True)):
        body[name] = draw(_FIELDS[name])
    body.update(draw(st.dictionaries(_text, _json, max_size=3)))
    raw = json.dumps(body, allow_nan=True).encode()  # lone surrogates go out as \\ud800 escapes
    return path, raw


def _check_answer(r_status: int, text: str, content_type: str) -> None:
    assert r_status < 500, (r_status, text[:500])
    if r_status >= 400:
        err = json.loads(text)["error"]
        assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], text[:300]
        assert err["param"] is None or isinstance(err["param"], str)
    elif "text/event-stream" in content_type:
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
        assert '"error"' not in text, text[-300:]
    else:
        assert "choices" in json.loads(text)


def run_fuzz(tmp_path, examples: int, *, seed: int | None = None, report: dict | None = None) -> None:
    """Send ``examples`` generated bodies through one gateway; assert the properties after each and at the end."""
    app = make_gateway(tmp_path, _local)
    gw = app.state.gateway
    loop = asyncio.new_event_loop()
    loop.run_until_complete(asyncio.sleep(0))
    gw_started = loop.run_until_complete(_start(gw))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30)
    sent = [0]
    statuses: dict[int, int] = {}

    async def one(path: str, raw: bytes) -> None:
        r = await client.post(path, content=raw, headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        _check_answer(r.status_code, r.text, r.headers.get("content-type", ""))

    @settings(max_examples=examples, deadline=None, derandomize=seed is None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request_bodies())
    def prop(case: tuple[str, bytes]) -> None:
        sent[0] += 1
        loop.run_until_complete(one(*case))

    t0 = time.monotonic()
    try:
        if seed is not None:
            from hypothesis import seed as hseed

            hseed(seed)(prop)()
        else:
            prop()
        assert gw.models["m"].local.tracker.in_flight == 0
        counted = sum(s.value for m in gw.metrics.requests.collect() for s in m.samples if s.name.endswith("_total"))
        assert counted == sent[0], (counted, sent[0])
    finally:
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(gw.close())
        loop.close()
    if report is not None:
        report.update(requests=sent[0], seconds=round(time.monotonic() - t0, 1), statuses=dict(sorted(statuses.items())))
    del gw_started


async def _start(gw) -> bool:
    gw.start()
    return True
