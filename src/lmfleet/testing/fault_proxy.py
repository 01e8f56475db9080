"""A fault-injecting HTTP reverse proxy for testing overflow against flaky providers.

Put it in front of a real OpenAI-compatible server; every request is forwarded (streams chunk by
chunk, SSE events one by one) unless a fault is armed::

    python -m lmfleet.testing.fault_proxy --upstream http://127.0.0.1:9000 --port 9100

    with FaultProxy("http://127.0.0.1:9000").running() as proxy:      # in-process, background thread
        proxy.set_fault(mode="status", status=429, retry_after=2, count=1)
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")

Control endpoints (never forwarded):

``POST /_fault`` with JSON ``{"mode": ..., "count": N, ...}`` arms a fault for the next ``N``
requests (``count`` omitted or null: until changed; ``{"mode": "none"}`` disarms). Modes:

* ``none``: pass through.
* ``status``: answer ``status`` (default 503) with an OpenAI-style error body; ``retry_after``
  adds a ``Retry-After`` header (use with 429 or 503).
* ``reset``: abort the TCP connection (RST) before any response byte.
* ``stall``: forward the response, then after ``after_chunks`` chunks (SSE events) stop sending:
  hold the connection open for ``delay_s`` (default 60) and then abort it, or with
  ``"close": true`` abort it at once (an abrupt close mid-stream).
* ``slow_connect``: wait ``delay_s`` (default 5) before forwarding, so nothing comes back for that
  long. The TCP connect itself succeeds at once (a proxy cannot delay the kernel's accept), so this
  exercises first-byte / read timeouts, not a connect timeout in the strict sense.

``GET /_stats`` returns counts: requests proxied, faults injected per mode, passed through,
upstream errors, and the armed fault.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from aiohttp import web

MODES = ("none", "status", "reset", "stall", "slow_connect")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host", "upgrade"}


@dataclass
class Fault:
    mode: str = "none"
    status: int = 503
    retry_after: float | None = None
    after_chunks: int = 0
    close: bool = False
    delay_s: float | None = None
    count: int | None = None

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "Fault":
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown fault keys {unknown}; expected {sorted(cls.__dataclass_fields__)}")
        f = cls(**data)
        if f.mode not in MODES:
            raise ValueError(f"mode={f.mode!r}; expected one of {list(MODES)}")
        if f.count is not None and f.count < 0:
            raise ValueError(f"count={f.count} must be >= 0 or null")
        return f


class FaultProxy:
    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = upstream.rstrip("/")
        self.host = host
        self.port = port
        self._fault = Fault()
        self._lock = threading.Lock()
        self.stats: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- control -------------------------------------------------------------------------------

    def set_fault(self, **kw: Any) -> None:
        fault = Fault.parse(kw)
        with self._lock:
            self._fault = fault

    def _take_fault(self) -> Fault:
        with self._lock:
            f = self._fault
            if f.mode == "none":
                return f
            if f.count is not None:
                if f.count <= 0:
                    self._fault = Fault()
                    return self._fault
                f.count -= 1
                if f.count == 0:
                    self._fault = Fault()
            return Fault(**{**asdict(f), "count": None})

    def stats_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self.stats["requests"],
                "passed": self.stats["passed"],
                "upstream_errors": self.stats["upstream_errors"],
                "faults": {m: self.stats[f"fault:{m}"] for m in MODES if m != "none"},
                "fault": asdict(self._fault),
            }

    # -- server ----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/_fault", self._h_fault)
        app.router.add_get("/_stats", self._h_stats)
        app.router.add_route("*", "/{tail:.*}", self._h_proxy)
        return app

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        self._runner = web.AppRunner(self.app(), handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def start_in_thread(self, timeout_s: float = 10.0) -> "FaultProxy":
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.start())
            except BaseException as e:  # surfaced to the caller below
                errors.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop())
            loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise TimeoutError(f"fault proxy did not start within {timeout_s}s")
        if errors:
            raise errors[0]
        return self

    def stop_thread(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    @contextlib.contextmanager
    def running(self) -> Iterator["FaultProxy"]:
        self.start_in_thread()
        try:
            yield self
        finally:
            self.stop_thread()

    # -- handlers --------------------------------------------------------------------------------

    async def _h_fault(self, request: web.Request) -> web.Response:
        try:
            self.set_fault(**(await request.json()))
        except (ValueError, TypeError) as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(self.stats_dict()["fault"])

    async def _h_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats_dict())

    async def _h_proxy(self, request: web.Request) -> web.StreamResponse:
        fault = self._take_fault()
        with self._lock:
            self.stats["requests"] += 1
            self.stats[f"fault:{fault.mode}" if fault.mode != "none" else "passed"] += 1
        if fault.mode == "status":
            headers = {} if fault.retry_after is None else {"Retry-After": f"{fault.retry_after:g}"}
            body = {"error": {"message": f"injected fault: HTTP {fault.status}", "type": "fault_proxy", "code": fault.status}}
            return web.json_response(body, status=fault.status, headers=headers)
        if fault.mode == "reset":
            _abort(request)
            raise asyncio.CancelledError  # nothing more to send on a dead connection
        if fault.mode == "slow_connect":
            await asyncio.sleep(5.0 if fault.delay_s is None else fault.delay_s)
        return await self._forward(request, fault if fault.mode == "stall" else None)

    async def _forward(self, request: web.Request, stall: Fault | None) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = await request.read()
        try:
            upstream = await self._session.request(
                request.method, self.upstream + request.rel_url.path_qs, headers=headers, data=body or None
            )
        except aiohttp.ClientError as e:
            with self._lock:
                self.stats["upstream_errors"] += 1
            return web.json_response({"error": {"message": f"upstream unreachable: {e}", "type": "fault_proxy"}}, status=502)
        async with upstream:
            out = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP},
            )
            await out.prepare(request)
            sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
            sent = 0
            async for chunk in _chunks(upstream, sse):
                if stall is not None and sent >= stall.after_chunks:
                    if not stall.close:
                        await asyncio.sleep(60.0 if stall.delay_s is None else stall.delay_s)
                    _abort(request)
                    raise asyncio.CancelledError
                await out.write(chunk)
                sent += 1
            if stall is not None:  # the stream ended before the stall point: stall at its end
                if not stall.close:
                    await asyncio.sleep(60.0 if stall.delay_s is None else stall.delay_s)
                _abort(request)
                raise asyncio.CancelledError
            await out.write_eof()
            return out


async def _chunks(resp: aiohttp.ClientResponse, sse: bool):
    """Upstream body as it arrives: whole SSE events (``...\\n\\n``) when ``sse``, else raw chunks."""
    if not sse:
        async for chunk in resp.content.iter_any():
            yield chunk
        return
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buf:
        yield buf


def _abort(request: web.Request) -> None:
    """Close the client connection with a TCP RST (SO_LINGER 0), not a clean FIN."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lmfleet.testing.fault_proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="Base URL of the real server, e.g. http://127.0.0.1:9000")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    proxy = FaultProxy(args.upstream, args.host, args.port)

    async def serve() -> None:
        await proxy.start()
        print(f"fault proxy on {proxy.url} -> {proxy.upstream}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await proxy.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
