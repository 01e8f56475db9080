"""OpenTelemetry spans per request (issue 16): request -> upstream attempt(s) -> relay, the client's trace joined,
the context sent upstream, nothing when off, and real OTLP/HTTP export to a collector."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from aiohttp import web

from lmfleet.gateway import build as build_mod
from lmfleet.gateway.observe.tracing import RequestTracer, traces_url
from lmfleet.testing.gateway_fakes import chat_json, make_gateway, sse_events, started_client, stream_response

pytestmark = pytest.mark.usefixtures("close_started_gateways")

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"
OBS = {"observability": {"otlp_endpoint": "http://127.0.0.1:4318"}}


@pytest.fixture
def memory(monkeypatch):
    """Every gateway built in the test traces into one in-memory exporter (spans exported as they end)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    monkeypatch.setattr(build_mod, "request_tracer",
                        lambda cfg: RequestTracer(None, exporter=exporter, batch=False) if cfg.otlp_endpoint else None)
    return exporter


def _by_name(spans):
    return {s.name: s for s in spans}


async def test_a_stream_has_request_upstream_and_relay_spans_in_the_clients_trace(tmp_path, memory):
    seen = {}

    def local(req):
        seen["traceparent"] = req.headers.get("traceparent")
        return stream_response(sse_events(json.loads(req.content)["model"], ["Par", "is"]))

    c = await started_client(make_gateway(tmp_path, local, extra=OBS))
    r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"traceparent": CLIENT_PARENT})
    assert r.status_code == 200 and "[DONE]" in r.text
    spans = _by_name(memory.get_finished_spans())
    assert set(spans) == {"lmfleet.request", "lmfleet.upstream", "lmfleet.relay"}
    req, up, relay = spans["lmfleet.request"], spans["lmfleet.upstream"], spans["lmfleet.relay"]
    assert {format(s.context.trace_id, "032x") for s in spans.values()} == {CLIENT_TRACE}  # the client's trace
    assert format(req.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert up.parent.span_id == req.context.span_id and relay.parent.span_id == req.context.span_id
    assert seen["traceparent"].split("-")[2] == format(up.context.span_id, "016x")  # the attempt's context went up
    assert up.attributes["lmfleet.backend"] == "local/m"
    a = req.attributes
    assert (a["http.response.status_code"], a["lmfleet.served_by"], a["gen_ai.request.model"]) == (200, "local/m", "m")
    assert a["gen_ai.usage.output_tokens"] == 2 and a["lmfleet.ttft_ms"] > 0
    assert relay.attributes["lmfleet.output_tokens"] == 2
    assert req.start_time <= up.start_time and relay.end_time <= req.end_time


async def test_a_failed_attempt_and_its_fallback_are_two_upstream_spans(tmp_path, memory):
    def dead(req):
        raise ConnectionResetError("gone")

    def provider(req):
        return httpx.Response(200, json=chat_json(json.loads(req.content)["model"], "Remote."))

    c = await started_client(make_gateway(tmp_path, dead, {"p": provider}, extra=OBS))
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.headers["x-lmfleet-served-by"] == "provider/p"
    ups = [s for s in memory.get_finished_spans() if s.name == "lmfleet.upstream"]
    assert [s.attributes["lmfleet.backend"] for s in ups][-1] == "provider/p"
    failed = [s for s in ups if "error.type" in s.attributes]
    assert failed and all(s.attributes["lmfleet.backend"] == "local/m" for s in failed)
    req = _by_name(memory.get_finished_spans())["lmfleet.request"]
    assert req.attributes["lmfleet.served_by"] == "provider/p"


@pytest.mark.parametrize("body, status, code", [
    ({**CHAT, "model": "nope"}, 404, "model_not_found"),
    ({**CHAT, "max_tokens": -1}, 400, None),
])
async def test_refused_requests_end_their_span_with_the_status(tmp_path, memory, body, status, code):
    c = await started_client(make_gateway(tmp_path, lambda req: httpx.Response(500), extra=OBS))
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == status
    (req,) = memory.get_finished_spans()
    assert req.name == "lmfleet.request" and req.attributes["http.response.status_code"] == status
    if code:
        assert req.attributes["lmfleet.error.code"] == code


async def test_tracing_is_off_by_default(tmp_path, memory):
    app = make_gateway(tmp_path, lambda req: httpx.Response(200, json=chat_json("m")))
    assert app.state.gateway.tracer is None
    c = await started_client(app)
    assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert memory.get_finished_spans() == ()


@pytest.mark.parametrize("endpoint, url", [
    ("http://collector:4318", "http://collector:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://otel.example.com/v1/traces", "https://otel.example.com/v1/traces"),
])
def test_traces_url(endpoint, url):
    assert traces_url(endpoint) == url


class Collector:
    """A real OTLP/HTTP receiver: stores each POST /v1/traces body (protobuf), in its own thread."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, bytes]] = []
        self.port = 0
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def traces(request: web.Request) -> web.Response:
            self.bodies.append((request.content_type, await request.read()))
            return web.Response(status=200, content_type="application/x-protobuf", body=b"")

        def serve() -> None:
            app = web.Application()
            app.router.add_post("/v1/traces", traces)
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            self._loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=serve, daemon=True).start()
        ready.wait(10)

    def spans(self) -> list[str]:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        names = []
        for _, body in self.bodies:
            msg = ExportTraceServiceRequest()
            msg.ParseFromString(body)
            names += [s.name for rs in msg.resource_spans for ss in rs.scope_spans for s in ss.spans]
        return names


async def test_spans_reach_a_real_otlp_collector(tmp_path):
    collector = Collector()
    app = make_gateway(tmp_path, lambda req: stream_response(sse_events("m", ["Par", "is"])),
                       extra={"observability": {"otlp_endpoint": f"http://127.0.0.1:{collector.port}",
                                                "service_name": "gw-test"}})
    app.state.gateway.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200
    await app.state.gateway.close()  # flushes the batch
    assert collector.bodies and all(ct == "application/x-protobuf" for ct, _ in collector.bodies)
    assert sorted(collector.spans()) == ["lmfleet.relay", "lmfleet.request", "lmfleet.upstream"]


def test_bad_endpoints_are_config_errors():
    from lmfleet.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="observability.otlp_endpoint"):
        parse_config({"models": [{"name": "m", "source": "builtin:tiny-random"}],
                      "observability": {"otlp_endpoint": "collector:4318"}})
