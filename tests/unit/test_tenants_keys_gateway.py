"""Key rotation on the real gateway (build_gateway, fake backends): key files re-read while it serves, the poller in
the app's lifespan, ``POST /admin/keys/reload``; in-flight requests are not dropped; no key in answers or logs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading

import httpx
import pytest

from lmfleet.testing.gateway_fakes import ADMIN_KEY_ENV, chat_json, make_gateway, sse_events, started_client, stream_response
from tests.unit.test_gateway_tenants import (
    ADMIN,
    CHAT,
    CLASSES,
    _until,
    ok_local,
)

pytestmark = pytest.mark.usefixtures("close_started_gateways")

OLD, NEW, BETA = "sk-rot-old-4f1", "sk-rot-new-9c2", "sk-rot-beta-77e"
FLAT_OLD, FLAT_NEW = "sk-flat-a-1d0", "sk-flat-b-2e9"
SECRETS = [OLD, NEW, BETA, FLAT_OLD, FLAT_NEW]


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def write_keys(path, *keys: str) -> None:
    """Replace a key file the way operators should: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text("# rotated\n" + "".join(f"{k}\n" for k in keys))
    os.replace(tmp, path)


def rotating_gateway(tmp_path, local=ok_local, *, flat: bool = False, limits: dict | None = None):
    """Tenants a (``a.keys``: OLD; ``limits``) and b (``b.keys``: BETA); with ``flat``, ``gateway.api_keys_file``
    too."""
    write_keys(tmp_path / "a.keys", OLD)
    write_keys(tmp_path / "b.keys", BETA)
    tenants = [{"name": "a", "api_keys_file": str(tmp_path / "a.keys"), "limits": limits or {}},
               {"name": "b", "api_keys_file": str(tmp_path / "b.keys")}]
    gateway = {"admin_key_env": ADMIN_KEY_ENV, "allowed_hosts": ["gw"]}
    if flat:
        write_keys(tmp_path / "flat.keys", FLAT_OLD)
        gateway["api_keys_file"] = str(tmp_path / "flat.keys")
    return make_gateway(tmp_path, local, extra={"tenants": tenants, "priority_classes": CLASSES, "gateway": gateway})


async def status(c: httpx.AsyncClient, key: str) -> int:
    return (await c.post("/v1/chat/completions", json=CHAT, headers=bearer(key))).status_code


async def test_a_rotated_key_file_holds_at_the_next_look_without_a_restart(tmp_path):
    app = rotating_gateway(tmp_path, flat=True)
    c = await started_client(app)
    assert [await status(c, k) for k in (OLD, NEW, BETA, FLAT_OLD, FLAT_NEW)] == [200, 401, 200, 200, 401]
    write_keys(tmp_path / "a.keys", NEW)
    write_keys(tmp_path / "flat.keys", FLAT_NEW)
    await app.state.key_files.check()  # what the lifespan's poller does every 2 s
    assert [await status(c, k) for k in (OLD, NEW, BETA, FLAT_OLD, FLAT_NEW)] == [401, 200, 200, 401, 200]
    r = await c.post("/v1/chat/completions", json=CHAT, headers=bearer(NEW))
    assert r.headers["x-lmfleet-priority"] == "interactive"
    rows = [row["tenant"] for row in (await _flush(app))]
    assert (rows.count("a"), rows.count("b"), rows.count("default")) == (3, 2, 2)  # NEW is a's, in the ledger too


async def test_rotated_keys_resolve_to_the_tenants_settings_changed_at_run_time(tmp_path):
    app = rotating_gateway(tmp_path)
    c = await started_client(app)
    r = await c.put("/admin/tenants/a", json={"priority": "batch"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    write_keys(tmp_path / "a.keys", OLD, NEW)
    await app.state.key_files.check()
    for k in (OLD, NEW):
        r = await c.post("/v1/chat/completions", json=CHAT, headers=bearer(k))
        assert r.status_code == 200 and r.headers["x-lmfleet-priority"] == "batch"
    assert (await c.delete("/admin/tenants/a", headers=ADMIN)).status_code == 200
    r = await c.post("/v1/chat/completions", json=CHAT, headers=bearer(NEW))
    assert r.headers["x-lmfleet-priority"] == "interactive"


async def _flush(app) -> list[dict]:
    gw = app.state.gateway
    await gw.recorder.flush()
    return gw.recorder.ledger.rows()


def held_until(release: threading.Event):
    """A local deployment that holds "hold" requests until ``release``; streams when asked to."""
    async def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        if body["messages"][0]["content"] == "hold":
            while not release.is_set():
                await asyncio.sleep(0.01)
        if body.get("stream"):
            return stream_response(sse_events("m", ["Par", "is"]))
        return httpx.Response(200, json=chat_json("m"))
    return handler


async def test_a_request_in_flight_when_its_key_is_removed_is_answered(tmp_path):
    release = threading.Event()
    app = rotating_gateway(tmp_path, local=held_until(release), limits={"max_concurrency": 5})
    book, q = app.state.gateway.router.tenants, app.state.gateway.models["m"].queue
    c = await started_client(app)
    held = {**CHAT, "messages": [{"role": "user", "content": "hold"}]}
    streaming = asyncio.create_task(c.post("/v1/chat/completions", json={**held, "stream": True},
                                           headers=bearer(OLD)))
    unary = asyncio.create_task(c.post("/v1/chat/completions", json=held, headers=bearer(OLD)))
    await _until(lambda: q.running == 2 and book.in_flight["a"] == 2)
    write_keys(tmp_path / "a.keys", NEW)
    await app.state.key_files.check()
    assert await status(c, OLD) == 401  # new requests with the removed key: refused at once
    release.set()
    answers = await asyncio.gather(streaming, unary)
    assert [a.status_code for a in answers] == [200, 200]
    assert "data: [DONE]" in answers[0].text and answers[1].json()["choices"][0]["message"]["content"] == "Paris."
    assert book.in_flight["a"] == 0 and q.running == 0  # released under the tenant they were admitted as


@pytest.mark.parametrize("headers,code", [({}, 401), (bearer(OLD), 401), ({"authorization": "Bearer nope"}, 401)])
async def test_the_reload_route_needs_the_admin_key(tmp_path, headers, code):
    c = await started_client(rotating_gateway(tmp_path))
    r = await c.post("/admin/keys/reload", headers=headers)
    assert r.status_code == code and r.json()["error"]["code"] == "invalid_api_key"


async def test_the_reload_route_rereads_now_and_answers_counts_only(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    app = rotating_gateway(tmp_path, flat=True)
    c = await started_client(app)
    r = await c.post("/admin/keys/reload", headers=ADMIN)
    assert r.status_code == 200
    assert r.json() == {"tenants": {"default": {"keys": 1, "reloadable": True}, "a": {"keys": 1, "reloadable": True},
                                    "b": {"keys": 1, "reloadable": True}}, "changed": [], "errors": []}
    write_keys(tmp_path / "a.keys", OLD, NEW)
    r = await c.post("/admin/keys/reload", headers=ADMIN)
    assert r.status_code == 200 and r.json()["changed"] == ["a"] and r.json()["tenants"]["a"]["keys"] == 2
    assert await status(c, NEW) == 200

    (tmp_path / "b.keys").write_text("# all gone\n")  # a mistake: b keeps its key, the answer says so
    r = await c.post("/admin/keys/reload", headers=ADMIN)
    assert r.status_code == 422
    body = r.json()
    assert body["tenants"]["b"]["keys"] == 1 and body["changed"] == []
    assert [e["param"] for e in body["errors"]] == ["tenants[1].api_keys_file"]
    assert "holds no key" in body["errors"][0]["message"]
    assert (body["error"]["code"], body["error"]["param"]) == ("key_file_unusable", "tenants[1].api_keys_file")
    assert await status(c, BETA) == 200
    texts = [caplog.text, r.text, *(str(x) for x in app.state.gateway.tenants.sources)]
    assert not any(s in t for s in SECRETS for t in texts)


async def test_env_keys_are_reported_as_not_reloadable(tmp_path):
    app = make_gateway(tmp_path, ok_local, api_keys={FLAT_OLD})  # gateway.api_keys_env only
    c = await started_client(app)
    r = await c.post("/admin/keys/reload", headers=ADMIN)
    assert r.status_code == 200
    assert r.json() == {"tenants": {"default": {"keys": 1, "reloadable": False}}, "changed": [], "errors": []}
    assert app.state.key_files.sources == ()


async def test_the_lifespan_polls_the_key_files(tmp_path):
    """The poller runs in the app's lifespan (as uvicorn runs it in every gateway worker process)."""
    app = rotating_gateway(tmp_path)
    app.state.key_files.period_s = 0.05
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        assert await status(c, OLD) == 200
        write_keys(tmp_path / "a.keys", NEW)
        await _until(lambda: app.state.gateway.tenants.resolve(NEW) is not None)
        assert await status(c, NEW) == 200 and await status(c, OLD) == 401
        (tmp_path / "a.keys").unlink()  # gone: a keeps NEW
        await asyncio.sleep(0.3)
        assert await status(c, NEW) == 200
