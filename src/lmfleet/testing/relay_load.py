"""Load generators for streamed chat completions, and the gateway built without Ray, for relay benchmarks.

``run_load`` is raw asyncio (a Protocol per keep-alive connection, no HTTP library) so that it stays cheaper than
the gateway it measures; ``LOADERS`` also holds the same load through the official openai client, httpx and
aiohttp. ``measure`` charges each named process its CPU seconds over a phase.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import psutil

CHOICE_MARKS = (b'"choices":[{', b'"choices": [{')


def make_gateway_app(fleet, fake_url: str):
    """The gateway ASGI app for ``fleet``, its local model served by ``fake_url`` (no Ray, no pollers).

    The one place that knows how lmfleet assembles a gateway: switch it when the builder moves.
    """
    from lmfleet.engine.app import resolve_model
    from lmfleet.gateway import build_gateway
    from lmfleet.models import resolve_source

    apps = [resolve_model(m, resolve_source(m.source)) for m in fleet.models]
    return build_gateway(fleet, apps, serve_url=fake_url, environ=dict(os.environ), fetch_status=None,
                         fetch_engine_metrics=None)


def serve_gateway_worker(config: str, fake_url: str) -> None:
    """A process's entry: one gateway process on the fleet file's port shared with others (``SO_REUSEPORT``, as
    ``lmfleet serve``'s workers), its model served by ``fake_url``, until SIGTERM. Its metrics go to the folder
    of ``PROMETHEUS_MULTIPROC_DIR`` when its environment names one (a :class:`SharedMetricsDir`'s ``env()``)."""
    from lmfleet.config import load_config
    from lmfleet.serve.gateway_proc import GatewayServer, listen_socket, loop_factory, stop_event

    fleet = load_config(config)
    app = make_gateway_app(fleet, fake_url)

    async def main() -> None:
        stop = stop_event()
        server = GatewayServer(app, fleet, listen_socket(fleet.gateway.host, fleet.gateway.port, reuse_port=True))
        if not await server.start():
            raise SystemExit(1)
        await stop.wait()
        await server.stop()

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(main())


class StreamConn(asyncio.Protocol):
    """One keep-alive connection; ``request`` sends a request and returns (status, ttft_s, events, choices)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self._done: asyncio.Future | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.lost = exc or ConnectionResetError("server closed the connection")
        if self._done is not None and not self._done.done():
            self._done.set_exception(self.lost)

    async def request(self, raw: bytes) -> tuple[int, float, int, int]:
        if self.lost is not None or self.transport is None:
            raise self.lost or ConnectionError("not connected")
        self._done = asyncio.get_running_loop().create_future()
        self._buf = b""
        self._status = 0
        self._length: int | None = None  # None: chunked
        self._in_head = True
        self._ttft = 0.0
        self._events = self._choices = 0
        self._tail = b""
        self._t0 = time.perf_counter()
        self.transport.write(raw)
        return await self._done

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        if self._in_head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._buf = buf
                return
            head = buf[:end].lower() + b"\r\n"
            self._status = int(head[9:12])
            i = head.find(b"\r\ncontent-length:")
            self._length = int(head[i + 17:head.find(b"\r\n", i + 2)]) if i >= 0 else None
            self._in_head = False
            buf = buf[end + 4:]
        if self._length is not None:  # an error or non-streamed answer
            if len(buf) >= self._length:
                self._finish()
            else:
                self._buf = buf
            return
        pos = 0
        while True:
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                break
            size = int(buf[pos:nl], 16)
            if len(buf) < nl + 2 + size + 2:
                break
            if size == 0:
                self._finish()
                return
            self._body(buf[nl + 2:nl + 2 + size])
            pos = nl + 4 + size
        self._buf = buf[pos:]

    def _body(self, chunk: bytes) -> None:
        choices = chunk.count(CHOICE_MARKS[0]) + chunk.count(CHOICE_MARKS[1])
        if choices and not self._choices:
            self._ttft = time.perf_counter() - self._t0
        self._choices += choices
        joined = self._tail + chunk  # a blank line may straddle two chunks
        self._events += joined.count(b"\n\n")
        self._tail = b"" if chunk.endswith(b"\n\n") else chunk[-1:]

    def _finish(self) -> None:
        self._buf = b""
        if self._done is not None and not self._done.done():
            self._done.set_result((self._status, self._ttft, self._events, self._choices))


def chat_request(host: str, path: str, model: str, max_tokens: int) -> bytes:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
                       "max_tokens": max_tokens, "stream": True}).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@dataclass
class PhaseResult:
    requests: int = 0
    errors: int = 0
    events: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds during the phase


async def run_load(url: str, model: str, concurrency: int, duration_s: float, max_tokens: int) -> PhaseResult:
    loop = asyncio.get_running_loop()
    hostport = url.removeprefix("http://")
    host, port = hostport.split(":")
    path = "/v1/chat/completions"
    raw = chat_request(hostport, path, model, max_tokens)
    res = PhaseResult()
    conns = [(await loop.create_connection(StreamConn, host, int(port)))[1] for _ in range(concurrency)]

    async def worker(conn: StreamConn, deadline: float) -> None:
        while time.perf_counter() < deadline:
            try:
                status, ttft, events, choices = await conn.request(raw)
            except OSError:
                res.errors += 1
                conn = (await loop.create_connection(StreamConn, host, int(port)))[1]
                continue
            if status != 200 or not choices:
                res.errors += 1
                continue
            res.requests += 1
            res.events += events
            res.tokens += choices
            res.ttfts.append(ttft)
        if conn.transport is not None:
            conn.transport.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c, t0 + duration_s) for c in conns))
    res.wall_s = time.perf_counter() - t0
    return res


async def run_load_openai(url: str, model: str, concurrency: int, duration_s: float, max_tokens: int) -> PhaseResult:
    """The same load through the official ``openai`` client (httpx underneath): what an application sends with.
    It costs far more CPU per request than the raw client, so with it "direct" is bounded by the client."""
    import openai

    res = PhaseResult()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0,
                                http_client=None, timeout=60)
    messages = [{"role": "user", "content": "Say hello to the benchmark."}]

    async def worker(deadline: float) -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            ttft = None
            choices = 0
            try:
                stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                              stream=True)
                async for chunk in stream:
                    if chunk.choices:
                        choices += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
            except openai.OpenAIError:
                res.errors += 1
                continue
            if not choices:
                res.errors += 1
                continue
            res.requests += 1
            res.events += choices
            res.tokens += choices
            res.ttfts.append(ttft or 0.0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(t0 + duration_s) for _ in range(concurrency)))
    res.wall_s = time.perf_counter() - t0
    await client.close()
    return res


async def run_load_http_lib(url: str, model: str, concurrency: int, duration_s: float, max_tokens: int,
                            lib: str) -> PhaseResult:
    """The same load through a general HTTP client library (``httpx``: what the issue's first figures used, 660
    req/s direct; ``aiohttp``: what load generators and many services use), one keep-alive connection per user,
    SSE lines read as they come."""
    res = PhaseResult()
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
            "max_tokens": max_tokens, "stream": True}
    headers = {"authorization": "Bearer bench"}
    endpoint = f"{url}/v1/chat/completions"

    def account(t0: float, ttft: float | None, events: int, ok: bool) -> None:
        if not ok or not events:
            res.errors += 1
            return
        res.requests += 1
        res.events += events
        res.tokens += events
        res.ttfts.append(ttft or 0.0)

    if lib == "httpx":
        import httpx

        client = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency,
                                                                   max_keepalive_connections=concurrency))

        async def one() -> None:
            t0, ttft, events = time.perf_counter(), None, 0
            try:
                async with client.stream("POST", endpoint, json=body, headers=headers) as r:
                    ok = r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            events += 1
                            if ttft is None:
                                ttft = time.perf_counter() - t0
            except httpx.HTTPError:
                ok = False
            account(t0, ttft, events, ok)

        close = client.aclose
    else:
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                        timeout=aiohttp.ClientTimeout(total=60))

        async def one() -> None:
            t0, ttft, events = time.perf_counter(), None, 0
            try:
                async with session.post(endpoint, json=body, headers=headers) as r:
                    ok = r.status == 200
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            events += 1
                            if ttft is None:
                                ttft = time.perf_counter() - t0
            except aiohttp.ClientError:
                ok = False
            account(t0, ttft, events, ok)

        close = session.close

    async def worker(deadline: float) -> None:
        while time.perf_counter() < deadline:
            await one()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(t0 + duration_s) for _ in range(concurrency)))
    res.wall_s = time.perf_counter() - t0
    await close()
    return res


async def run_load_httpx(url: str, model: str, concurrency: int, duration_s: float, max_tokens: int) -> PhaseResult:
    return await run_load_http_lib(url, model, concurrency, duration_s, max_tokens, "httpx")


async def run_load_aiohttp(url: str, model: str, concurrency: int, duration_s: float, max_tokens: int) -> PhaseResult:
    return await run_load_http_lib(url, model, concurrency, duration_s, max_tokens, "aiohttp")


LOADERS = {"raw": run_load, "openai": run_load_openai, "httpx": run_load_httpx, "aiohttp": run_load_aiohttp}


def http_json(method: str, url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"content-type": "application/json",
                                          **({"authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def measure(url: str, model: str, concurrency: int, duration_s: float, max_tokens: int,
            procs: dict[str, psutil.Process], client: str = "raw") -> PhaseResult:
    me = psutil.Process()
    before = {n: cpu_s(p) for n, p in {**procs, "client": me}.items()}
    res = asyncio.run(LOADERS[client](url, model, concurrency, duration_s, max_tokens))
    res.cpu = {n: cpu_s(p) - before[n] for n, p in {**procs, "client": me}.items()}
    return res

