"""The gateway records what it knew when it predicted a local request's wait (the ledger's ``admission``) and serves
it through ``/admin/usage?estimate=1&features=1``."""

from __future__ import annotations

import json

import httpx
import pytest

from lmfleet.overflow.admission import parse_admission
from lmfleet.testing.gateway_fakes import chat_json, make_gateway, sse_events, started_client, stream_response

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}
ADM = {"authorization": "Bearer adm"}

pytestmark = pytest.mark.usefixtures("close_started_gateways")


def ok(req: httpx.Request) -> httpx.Response:
    body = json.loads(req.content)
    if body.get("stream"):
        return stream_response(sse_events(body["model"], ["Par", "is"]))
    return httpx.Response(200, json=chat_json(body["model"]))


async def test_local_requests_carry_their_admission_and_providers_none(tmp_path):
    app = make_gateway(tmp_path, ok, {"p": ok})
    c = await started_client(app)
    for _ in range(2):
        assert (await c.post("/v1/chat/completions", json={**CHAT, "stream": True})).status_code == 200
    await c.post("/admin/overflow", json={"mode": "force_on"}, headers=ADM)
    await c.post("/v1/chat/completions", json={**CHAT, "stream": True})  # a provider's: no estimate, no record
    got = (await c.get("/admin/usage?estimate=1&features=1", headers=ADM)).json()
    m = app.state.gateway.models["m"]
    assert got["models"][0]["requests"] == 2 and len(got["requests"]) == 2
    for r in got["requests"]:
        a = parse_admission(r["admission"])
        assert r["served_by"] == "local/m" and r["realised_wait_ms"] is not None
        assert a.estimate_ms == r["predicted_wait_ms"] and a.threshold_ms == m.threshold_ms
        assert a.capacity == m.app.capacity and a.prompt_tokens > 0
    assert parse_admission(got["requests"][1]["admission"]).signals.completions_in_window >= 1
    assert "requests" not in (await c.get("/admin/usage?estimate=1", headers=ADM)).json()
    assert (await c.get("/admin/usage?features=1", headers=ADM)).status_code == 400
