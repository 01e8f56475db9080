"""The gateway's /admin/profile/* routes on the real gateway app (fake backends, a fake engine control) and the
per-node trace collector."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from lmfleet.profile.traces import NodeFiles, _reader, llm_deployments, safe_part
from lmfleet.testing.gateway_fakes import make_gateway, sse_events, stream_response

ADMIN = {"authorization": "Bearer adm"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4, "stream": True}
PAGE = ('ray_vllm_request_queue_time_seconds_sum{model_name="m"} 0.5\n'
        'ray_vllm_request_queue_time_seconds_count{model_name="m"} 2\n')


def ok_local(req: httpx.Request) -> httpx.Response:
    return stream_response(sse_events(json.loads(req.content)["model"], ["Par", "is"]))


class FakeControl:
    """Records calls; ``collect`` returns what a node would have sent."""

    def __init__(self, nodes: list[NodeFiles] | None = None, fail_start: bool = False):
        self.calls: list[tuple] = []
        self.nodes = nodes or []
        self.fail_start = fail_start

    def start(self, app_name: str) -> int:
        self.calls.append(("start", app_name))
        if self.fail_start:
            raise RuntimeError("replica gone")
        return 2

    def stop(self, app_name: str) -> int:
        self.calls.append(("stop", app_name))
        return 2

    def collect(self, dirs, window_s):
        self.calls.append(("collect", dict(dirs), window_s))
        return self.nodes


def _model(profiler_dir: str | None) -> dict:
    engine = {"profiler_dir": profiler_dir} if profiler_dir else {}
    return {"name": "m", "source": "builtin:tiny-random", "engine": engine,
            "deployment": {"max_ongoing_requests": 4, "request_timeout_s": 10}}


@pytest.fixture
async def gateway(tmp_path, request):
    """(client, fake control, store) for a gateway whose model ``m`` has a profiler folder unless the test is
    parametrized with ``profiler_dir=None``."""
    pdir = getattr(request, "param", "/var/tmp/prof")
    app = make_gateway(tmp_path, ok_local, extra={"models": [_model(pdir)]})
    control = FakeControl([NodeFiles("10.0.0.1", [("m", "rank0.1.pt.trace.json.gz", b"\x1f\x8bdata")],
                                     ["m/big: over the limit"]),
                           NodeFiles("10.0.0.2", [("m", "../evil name", b"x")], [])])
    # the app's profiler reaches the engines through Ray; the fake takes its place
    store = tmp_path / "store"
    profiler = app.state.profiler
    profiler.control, profiler.fetch_pages, profiler.store = control, lambda: [PAGE], store
    app.state.gateway.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    yield client, control, store
    await client.aclose()
    await app.state.gateway.close()


@pytest.mark.parametrize("method, path", [("GET", "/admin/profile/snapshot"), ("POST", "/admin/profile/start"),
                                          ("POST", "/admin/profile/stop")])
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}], ids=["no-key", "wrong-key"])
async def test_routes_need_the_admin_key(gateway, method, path, headers):
    client, control, _ = gateway
    r = await client.request(method, path, headers=headers, json={})
    assert r.status_code == 401 and control.calls == []


async def test_snapshot_has_gateway_phases_and_engine_sums(gateway):
    client, _, _ = gateway
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    snap = (await client.get("/admin/profile/snapshot", headers=ADMIN)).json()
    assert snap["gateway"]["m"]["prepare"][1] == 1 and 0 < snap["gateway"]["m"]["prepare"][0] < 1
    assert snap["gateway"]["m"]["e2e"][1] == 1 and snap["gateway"]["m"]["ttft"][1] == 1
    assert snap["engine"] == {"m": {"queue": [0.5, 2.0]}} and snap["engine_error"] is None
    assert snap["engine_source"] == "ray"
    assert snap["pid"] == os.getpid()


async def test_start_stop_collect_and_download(gateway):
    client, control, store = gateway
    started = (await client.post("/admin/profile/start", headers=ADMIN, json={"models": None})).json()
    assert started["models"] == {"m": {"replicas": 2, "dir": "/var/tmp/prof/m"}}
    session = started["session"]
    stopped = (await client.post("/admin/profile/stop", headers=ADMIN,
                                 json={"session": session, "models": ["m"], "window_s": 3})).json()
    assert [c[0] for c in control.calls] == ["start", "stop", "collect"]
    assert control.calls[0][1] == "lmfleet-m" and control.calls[2][1] == {"m": "/var/tmp/prof/m"}
    assert control.calls[2][2] >= 3  # the window grows by however long stopping took
    assert stopped["models"] == {"m": {"replicas": 2}} and stopped["skipped"] == ["m/big: over the limit"]
    assert stopped["files"] == [
        {"model": "m", "node": "10.0.0.1", "name": "rank0.1.pt.trace.json.gz", "bytes": 6},
        {"model": "m", "node": "10.0.0.2", "name": "_evil_name", "bytes": 1}]
    assert (store / session / "m" / "10.0.0.2" / "_evil_name").read_bytes() == b"x"
    got = await client.get(f"/admin/profile/files/{session}/m/10.0.0.1/rank0.1.pt.trace.json.gz", headers=ADMIN)
    assert got.status_code == 200 and got.content == b"\x1f\x8bdata"


@pytest.mark.parametrize("path", [
    "/admin/profile/files/{s}/m/10.0.0.1/missing", "/admin/profile/files/{s}/other/10.0.0.1/x",
    "/admin/profile/files/{s}/m/..%2F..%2Fetc/passwd", "/admin/profile/files/not-a-session/m/n/x",
    "/admin/profile/files/{s}/m/10.0.0.1/..",
])
async def test_file_route_serves_only_gathered_files(gateway, path):
    client, _, store = gateway
    session = "20261201T100000Z-abcdef"
    (store / session / "m" / "10.0.0.1").mkdir(parents=True)
    (store / session / "m" / "10.0.0.1" / "x").write_bytes(b"x")
    r = await client.get(path.format(s=session), headers=ADMIN)
    assert r.status_code == 404, r.text


@pytest.mark.parametrize("gateway", [None], indirect=True)
async def test_start_without_profiler_dir_is_409_naming_the_key(gateway):
    client, control, _ = gateway
    for body in ({}, {"models": ["m"]}):
        r = await client.post("/admin/profile/start", headers=ADMIN, json=body)
        assert r.status_code == 409 and "engine.profiler_dir" in r.json()["error"]["message"], r.text
    assert control.calls == []


@pytest.mark.parametrize("path, body, status, fragment", [
    ("start", {"models": ["nope"]}, 404, "nope"),
    ("start", {"models": "m"}, 400, "models must be"),
    ("start", {"models": []}, 400, "models must be"),
    ("stop", {"session": "x", "models": ["m"], "window_s": 3}, 400, "session"),
    ("stop", {"session": "20261201T100000Z-abcdef", "models": ["m"], "window_s": 0}, 400, "window_s"),
    ("stop", {"session": "20261201T100000Z-abcdef", "models": ["m"], "window_s": True}, 400, "window_s"),
    ("stop", {"session": "20261201T100000Z-abcdef", "window_s": 3}, 400, "models must be"),
])
async def test_bad_requests(gateway, path, body, status, fragment):
    client, control, _ = gateway
    r = await client.post(f"/admin/profile/{path}", headers=ADMIN, json=body)
    assert r.status_code == status and fragment in r.json()["error"]["message"], r.text
    assert [c for c in control.calls if c[0] != "start"] == []


async def test_engine_failure_is_502_with_its_reason(gateway):
    client, control, _ = gateway
    control.fail_start = True
    r = await client.post("/admin/profile/start", headers=ADMIN, json={})
    assert r.status_code == 502 and "replica gone" in r.json()["error"]["message"]


# ---- the per-node collector and the pure helpers -----------------------------------------------------------
def test_reader_returns_recent_files_within_the_byte_limit(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    for name, size, age in (("old.gz", 1, 3600), ("a.gz", 10, 0), ("b.gz", 20, 0), ("c.gz", 5, 0)):
        (d / name).write_bytes(b"x" * size)
        os.utime(d / name, (time.time() - age, time.time() - age))
    (d / "sub").mkdir()
    read = _reader()
    files, skipped = read({"m": str(d), "gone": str(tmp_path / "missing")}, 60.0, 5.0, 16)
    assert [(m, n, len(b)) for m, n, b in files] == [("m", "a.gz", 10), ("m", "c.gz", 5)]
    assert len(skipped) == 1 and skipped[0].startswith("m/b.gz")


@pytest.mark.parametrize("name, safe", [("10.0.0.1", "10.0.0.1"), ("..", "_"), ("a/b c", "a_b_c"),
                                        ("rank0.1.pt.trace.json.gz", "rank0.1.pt.trace.json.gz"), ("", "_")])
def test_safe_part(name, safe):
    assert safe_part(name) == safe


def test_llm_deployments_leave_the_ingress_out():
    assert llm_deployments(["OpenAiIngress", "LLMServer:tiny", "LLMServer:prefill-tiny"]) == [
        "LLMServer:prefill-tiny", "LLMServer:tiny"]


def test_llm_deployments_know_the_data_parallel_and_split_names():
    assert llm_deployments(["OpenAiIngress:ds", "DPServer:ds"]) == ["DPServer:ds"]
    assert llm_deployments(["PDProxyServer:ds", "Prefill:ds", "Decode:ds"]) == ["Decode:ds", "Prefill:ds"]
