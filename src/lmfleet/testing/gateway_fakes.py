"""Fakes for gateway unit tests: the real gateway (build_gateway) in front of fake backends.

A fake backend is a handler ``httpx.Request -> httpx.Response`` (sync or async), the shape of
``httpx.MockTransport`` handlers, served over real HTTP by one aiohttp server per test session (its own
thread and event loop) under its own path prefix. A handler that raises before answering makes the server
drop the connection (a reset, as a dead backend gives); a response stream that raises mid-way cuts the
connection there (a stream that breaks).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import threading
from collections.abc import Callable

import httpx
from aiohttp import web

from dataclasses import replace

from fastapi import FastAPI

from lmfleet.config import parse_config
from lmfleet.engine.app import resolve_model
from lmfleet.gateway import build_gateway

Handler = Callable[[httpx.Request], httpx.Response]


class FakeBackends:
    """One aiohttp server (in a daemon thread) serving every registered handler under ``/<id>/``."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._ids = itertools.count()
        self._ready = threading.Event()
        self.port = 0
        threading.Thread(target=self._serve, name="fake-backends", daemon=True).start()
        self._ready.wait(10)

    def add(self, handler: Handler) -> str:
        """Register ``handler``; returns the base URL it answers under (no trailing slash)."""
        key = f"b{next(self._ids)}"
        self._handlers[key] = handler
        return f"http://127.0.0.1:{self.port}/{key}"

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{key}/{path:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        loop.run_until_complete(runner.setup())
        # a deep accept queue: tests open hundreds of connections at once, and with aiohttp's default of 128 a
        # loaded machine drops SYNs, whose retries (1, 3, 7 s) then trip the gateway's connect timeouts
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        loop.run_forever()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        handler = self._handlers[request.match_info["key"]]
        req = httpx.Request(request.method, f"http://fake/{request.match_info['path']}",
                            headers=list(request.headers.items()), content=await request.read())
        try:
            resp = handler(req)
            if inspect.isawaitable(resp):
                resp = await resp
        except Exception:  # a backend that dies before answering: drop the connection
            request.transport.close()  # type: ignore[union-attr]
            raise web.HTTPInternalServerError() from None
        out = web.StreamResponse(status=resp.status_code,
                                 headers={k: v for k, v in resp.headers.items()
                                          if k.lower() not in ("content-length", "transfer-encoding")})
        out.enable_chunked_encoding()
        await out.prepare(request)
        try:
            async for chunk in resp.stream:  # type: ignore[union-attr]
                await out.write(chunk)
        except Exception:  # a stream that breaks mid-way: cut the connection without ending the body
            request.transport.close()  # type: ignore[union-attr]
            return out
        await out.write_eof()
        return out


_BACKENDS: FakeBackends | None = None


def fake_backend(handler: Handler) -> str:
    """Serve ``handler`` over HTTP; returns its base URL."""
    global _BACKENDS
    if _BACKENDS is None:
        _BACKENDS = FakeBackends()
    return _BACKENDS.add(handler)


def chat_json(model: str, text: str = "Paris.", prompt: int = 7, completion: int = 2) -> dict:
    return {"id": "x", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def sse_events(model: str, words: list[str], *, usage: bool = True, done: bool = True) -> list[bytes]:
    out = []
    for w in words:
        out.append(b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "model": model,
                                           "choices": [{"index": 0, "delta": {"content": w}}]}).encode() + b"\n\n")
    if usage:
        out.append(b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "model": model, "choices": [],
                                           "usage": {"prompt_tokens": 5, "completion_tokens": len(words),
                                                     "total_tokens": 5 + len(words)}}).encode() + b"\n\n")
    if done:
        out.append(b"data: [DONE]\n\n")
    return out


class BreakingStream(httpx.AsyncByteStream):
    """Yields some events, then raises like a connection reset."""

    def __init__(self, events: list[bytes], error: Exception | None = None):
        self.events = events
        self.error = error

    async def __aiter__(self):
        for e in self.events:
            yield e
        if self.error is not None:
            raise self.error


def stream_response(events: list[bytes], error: Exception | None = None) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=BreakingStream(events, error))


class CountingTokenizer:
    """Counts one token per word; good enough to test the context-length check."""

    def encode(self, text, add_special_tokens=True):
        return text.split()

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [w for m in messages for w in (m["content"] or "").split()] + ["<gen>"]


API_KEYS_ENV = "LMFLEET_FAKE_API_KEYS"
ADMIN_KEY_ENV = "LMFLEET_FAKE_ADMIN_KEY"
PROVIDER_KEY_ENV = "LMFLEET_FAKE_PROVIDER_KEY"


def make_gateway(tmp_path, local: Handler, providers: dict[str, Handler | str] | None = None, *,
                 ready: bool = True, extra: dict | None = None, max_model_len: int = 64,
                 api_keys: frozenset[str] | set[str] = frozenset(), admin_key: str | None = "adm",
                 provider_extra: dict | None = None) -> FastAPI:
    """The real gateway app for one model ``m`` (capacity 4) whose local deployment and providers are fakes
    (a provider given as a string is a server's base URL, without ``/v1``).

    ``app.state.gateway`` holds its parts (router, providers, health, recorder) for assertions.
    """
    providers = providers or {}
    data = {
        # "gw": the tests' client base URL (http://gw), a trusted Host name
        "gateway": {"api_keys_env": API_KEYS_ENV if api_keys else None, "admin_key_env": ADMIN_KEY_ENV,
                    "allowed_hosts": ["gw"]},
        "models": [{"name": "m", "source": "builtin:tiny-random",
                    "deployment": {"max_ongoing_requests": 4, "request_timeout_s": 10},
                    "overflow": {"threshold_ms": 1000, "local_first_token_timeout_s": 2}}],
        "providers": [{"name": n, "base_url": f"{h if isinstance(h, str) else fake_backend(h)}/v1", "model_map": {"m": f"{n}-model"},
                       "api_key_env": PROVIDER_KEY_ENV,
                       "price": {"input_per_1m": 1.0, "output_per_1m": 2.0}, "max_retries": 1,
                       "breaker": {"backoff_base_s": 0.01, "backoff_cap_s": 0.02}, **(provider_extra or {})}
                      for n, h in providers.items()],
        "ledger": {"path": str(tmp_path / "ledger.sqlite")},
    }
    for k, v in (extra or {}).items():
        data[k] = v
    fleet = parse_config(data)
    model = replace(resolve_model(fleet.models[0], str(tmp_path / "no-weights")), max_model_len=max_model_len)
    environ = {API_KEYS_ENV: ",".join(api_keys), PROVIDER_KEY_ENV: "sk-secret-provider-key"}
    if admin_key:
        environ[ADMIN_KEY_ENV] = admin_key
    # the local model's base URL is <serve_url>/m/v1
    app = build_gateway(fleet, [model], serve_url=fake_backend(local), environ=environ,
                        load_tokenizer=lambda _: CountingTokenizer())
    # a fake local deployment fails at once: its retries need not wait as long as a real replica's restart
    app.state.gateway.models["m"].local.retry_backoff_s = (0.01, 0.05)
    if not ready:
        app.state.gateway.health.mark_failed("m", "engine is dead")
    return app


STARTED_GATEWAYS: list[FastAPI] = []
"""Gateways :func:`started_client` started; the ``close_started_gateways`` fixture (tests/unit/conftest.py) closes
them after each test."""


async def started_client(app: FastAPI, base_url: str = "http://gw") -> httpx.AsyncClient:
    """Start ``app``'s gateway (what its lifespan does: ``ASGITransport`` runs none) and give a client on it."""
    app.state.gateway.start()
    STARTED_GATEWAYS.append(app)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url)
