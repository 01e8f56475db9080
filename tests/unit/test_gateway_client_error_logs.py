"""A handled client mistake leaves at most one log line in the serving terminal, never a traceback (issue 16: a
nested-JSON request used to print a RecursionError traceback)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from lmfleet.testing.gateway_fakes import chat_json, make_gateway

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
_DEEP = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def _local(req: httpx.Request) -> httpx.Response:
    body = json.loads(req.content)
    if body.get("max_tokens") == 7:  # the engine refuses it: the client's mistake, relayed
        return httpx.Response(400, json={"error": {"message": "max_tokens too large", "type": "BadRequestError"}})
    return httpx.Response(200, json=chat_json("m"))


@pytest.mark.parametrize("raw,content_type,status", [
    (_DEEP, "application/json", 400),                                   # RecursionError inside the JSON parser
    (b'{"model": "m", "x": ' + b"[" * 200 + b"]" * 200 + b"}", "application/json", 400),  # deeper than we allow
    (b"{not json", "application/json", 400),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "application/json", 400),
    (json.dumps({**CHAT, "temperature": "hot"}).encode(), "application/json", 400),
    (json.dumps({**CHAT, "model": "nope"}).encode(), "application/json", 404),
    (json.dumps(CHAT).encode(), "text/plain", 415),
    (json.dumps({**CHAT, "max_tokens": 7}).encode(), "application/json", 400),
])
async def test_client_mistakes_log_at_most_one_line_and_no_traceback(tmp_path, caplog, raw, content_type, status):
    caplog.set_level(logging.DEBUG)
    app = make_gateway(tmp_path, _local)
    app.state.gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            caplog.clear()
            r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": content_type})
    finally:
        await app.state.gateway.close()
    assert r.status_code == status, r.text
    ours = [rec for rec in caplog.records if rec.name.startswith("lmfleet") and rec.levelno >= logging.INFO]
    assert not [rec for rec in caplog.records if rec.exc_info], "a handled client error logged a traceback"
    assert "Traceback" not in caplog.text
    assert len(ours) <= 1, [rec.getMessage() for rec in ours]
    assert all("\n" not in rec.getMessage() for rec in ours)
