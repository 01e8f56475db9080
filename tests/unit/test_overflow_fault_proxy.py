"""The fault-injecting proxy (lmfleet.testing.fault_proxy) in front of a tiny OpenAI-like upstream."""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from aiohttp import web

from lmfleet.testing.fault_proxy import FaultProxy

N_EVENTS = 5
GAP_S = 0.1


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.json_response({"object": "chat.completion", "choices": [{"message": {"content": "hi"}}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(N_EVENTS):
        await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
        await asyncio.sleep(GAP_S)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@pytest.fixture(scope="module")
def upstream():
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    th.join(5)
    loop.close()


@pytest.fixture
def proxy(upstream):
    with FaultProxy(upstream).running() as p:
        yield p


def _stream(url, timeout=5.0):
    """POST a streaming chat request; returns (events received, error or None, seconds to first event)."""
    events, first = [], None
    t0 = time.monotonic()
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json={"model": "m", "stream": True},
                          timeout=httpx.Timeout(timeout)) as r:
            if r.status_code != 200:
                return r.status_code, None, None
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first = first if first is not None else time.monotonic() - t0
                    events.append(line[6:])
    except httpx.HTTPError as e:
        return events, e, first
    return events, None, first


def test_passthrough_nonstream_and_stats(proxy):
    r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "m"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    stats = httpx.get(proxy.url + "/_stats").json()
    assert (stats["requests"], stats["passed"]) == (1, 1)


def test_stream_passes_through_event_by_event(proxy):
    t0 = time.monotonic()
    events, err, first = _stream(proxy.url)
    assert err is None and len(events) == N_EVENTS + 1 and events[-1] == "[DONE]"
    assert first < (N_EVENTS - 2) * GAP_S  # the first event arrives long before the stream ends
    assert time.monotonic() - t0 >= N_EVENTS * GAP_S * 0.9


@pytest.mark.parametrize(
    "fault, status, retry_after",
    [
        ({"mode": "status", "status": 503}, 503, None),
        ({"mode": "status", "status": 500}, 500, None),
        ({"mode": "status", "status": 429, "retry_after": 2}, 429, "2"),
    ],
)
def test_status_fault_then_recovers(proxy, fault, status, retry_after):
    proxy.set_fault(**fault, count=1)
    r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "m"})
    assert r.status_code == status
    assert r.headers.get("retry-after") == retry_after
    assert "injected fault" in r.json()["error"]["message"]
    assert httpx.post(proxy.url + "/v1/chat/completions", json={"model": "m"}).status_code == 200


def test_count_applies_to_next_n_requests(proxy):
    r = httpx.post(proxy.url + "/_fault", json={"mode": "status", "status": 502, "count": 2})
    assert r.status_code == 200
    codes = [httpx.post(proxy.url + "/v1/chat/completions", json={}).status_code for _ in range(3)]
    assert codes == [502, 502, 200]
    stats = httpx.get(proxy.url + "/_stats").json()
    assert stats["faults"]["status"] == 2 and stats["passed"] == 1 and stats["fault"]["mode"] == "none"


def test_reset_before_response(proxy):
    proxy.set_fault(mode="reset", count=1)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError)):
        httpx.post(proxy.url + "/v1/chat/completions", json={"model": "m"})


@pytest.mark.parametrize(
    "fault, timeout, error_type",
    [
        # stop after 2 events and hang: the client's read timeout fires
        ({"mode": "stall", "after_chunks": 2, "delay_s": 5}, 0.5, httpx.ReadTimeout),
        # stop after 2 events and close abruptly
        ({"mode": "stall", "after_chunks": 2, "close": True}, 5.0, (httpx.RemoteProtocolError, httpx.ReadError)),
    ],
)
def test_stall_mid_stream(proxy, fault, timeout, error_type):
    proxy.set_fault(**fault, count=1)
    events, err, _ = _stream(proxy.url, timeout=timeout)
    assert len(events) == 2
    assert isinstance(err, error_type)


@pytest.mark.parametrize("delay_s, timeout, ok", [(0.6, 0.2, False), (0.3, 5.0, True)])
def test_slow_connect(proxy, delay_s, timeout, ok):
    proxy.set_fault(mode="slow_connect", delay_s=delay_s, count=1)
    t0 = time.monotonic()
    if ok:
        r = httpx.post(proxy.url + "/v1/chat/completions", json={}, timeout=timeout)
        assert r.status_code == 200 and time.monotonic() - t0 >= delay_s
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(proxy.url + "/v1/chat/completions", json={}, timeout=timeout)


@pytest.mark.parametrize("body", [{"mode": "explode"}, {"mode": "status", "colour": "red"}, {"mode": "none", "count": -1}])
def test_bad_fault_is_400(proxy, body):
    r = httpx.post(proxy.url + "/_fault", json=body)
    assert r.status_code == 400


def test_upstream_down_is_502():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with FaultProxy(f"http://127.0.0.1:{dead}").running() as p:
        assert httpx.post(p.url + "/v1/chat/completions", json={}).status_code == 502


def test_runs_as_a_module(upstream):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "lmfleet.testing.fault_proxy", "--upstream", upstream, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={})
                break
            except httpx.ConnectError:
                assert proc.poll() is None and time.monotonic() < deadline, "proxy did not start"
                time.sleep(0.1)
        assert r.status_code == 200
    finally:
        proc.terminate()
        proc.wait(10)
