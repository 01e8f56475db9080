"""A minimal, fast OpenAI-compatible streaming server for harness tests and capacity measurements.

Raw asyncio (no framework) so that the server, not the client, is cheap: HTTP/1.1 keep-alive,
``GET /v1/models``, ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed with chunked
transfer encoding, or not). Each answer has ``min(max_tokens, --max-tokens)`` one-word tokens,
optional TTFT / inter-token delays, a ``usage`` event when asked, and an optional
``x-lmfleet-served-by`` header. To stream like an engine: ``--itl-ms A --itl-ms-max B`` draws each stream's
inter-token time from uniform(A, B), ``--ttft-ms-per-prompt-token`` adds prefill time in proportion to the prompt's
words, and ``--workers N`` serves from N processes on one port (SO_REUSEPORT), so the fake is not the limit. Paths may carry a route prefix (``/m/v1/chat/completions``), as
Ray Serve's do, so the server can stand in for a local model too.

    python -m lmfleet.testing.fast_openai_server --port 18555 [--ttft-ms 0] [--itl-ms 0] [--served-by local/x]

``--dialect NAME`` answers the way one real provider does (any of :data:`lmfleet.dialects.DIALECTS`, as
:mod:`lmfleet.testing.fake_provider` emulates it): where its usage goes, its extra chunks and comment lines,
reasoning, tool calls (streamed in pieces, as OpenAI does), a 401 for a key in another header than its own, and
its 429 / 5xx / content-filter / out-of-credit answers with their headers. A prompt asks for an error with
``[fake:429]``, ``[fake:5xx]``, ``[fake:filter]`` or ``[fake:credit]``, optionally ``[fake:5xx*2#id]``: only
the first 2 requests carrying that directive fail. ``--no-usage`` sends no usage
anywhere; ``--answer-model NAME`` answers with that model name instead of the one it was sent.

``--latency-model MEDIAN_MS,P99_MS,PER_TOKEN_MS`` (with ``--seed``) replaces the fixed delays with a hosted
API's shape: each answer's TTFT drawn log-normal with that median and P99, then one token every PER_TOKEN_MS
(``lmfleet.bench.trace.ProviderLatency``; draws in arrival order from one seeded generator).

In tests: ``with FastServer() as srv: srv.base_url``  (a subprocess on a free port).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from typing import Any

from lmfleet.dialects import DIALECTS
from lmfleet.net import free_port
from lmfleet.testing.fake_provider import REASONING, TOOL_ARGUMENTS, Directives, answer

__all__ = ["DIALECTS", "REASONING", "TOOL_ARGUMENTS", "FastServer", "Handler", "main", "parse_args"]

STATUS = {200: b"OK", 404: b"Not Found", 400: b"Bad Request", 401: b"Unauthorized", 402: b"Payment Required",
          429: b"Too Many Requests",
          500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable"}


class Handler(asyncio.Protocol):
    directives = Directives()
    """Requests seen per error directive (the whole server process)."""

    def __init__(self, opts: argparse.Namespace):
        self.opts = opts
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            headers = {}
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length") or 0)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            method, path = head.split(" ", 2)[:2]
            asyncio.get_running_loop().create_task(self.respond(method, path, body, headers))

    async def respond(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        path = path[path.find("/v1/"):] if "/v1/" in path else path  # any route prefix: /m/v1/... as Serve has
        if method == "GET" and path.startswith("/v1/models"):
            payload = json.dumps({"object": "list", "data": [
                {"id": self.opts.model, "object": "model", "max_model_len": self.opts.max_model_len}]}).encode()
            t.write(self.head(200, "application/json", len(payload)) + payload)
            return
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            t.write(self.head(404, "application/json", 2) + b"{}")
            return
        req = json.loads(body or b"{}")
        chat = path.endswith("chat/completions")
        if self.opts.dialect:
            await self.respond_dialect(chat, req, headers)
            return
        n = max(1, min(int(req.get("max_tokens") or 16), self.opts.max_tokens))
        prompt = req.get("prompt") or " ".join(m.get("content", "") for m in req.get("messages", []))
        prompt_tokens = len(str(prompt).split())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        ttft_s = (self.opts.ttft_ms + self.opts.ttft_ms_per_prompt_token * prompt_tokens) / 1000
        itl_s = random.uniform(self.opts.itl_ms, max(self.opts.itl_ms, self.opts.itl_ms_max)) / 1000
        if self.opts.latency is not None:
            ttft_s, itl_s = self.opts.latency.sample(self.opts.rng, n).ttft_s, self.opts.latency.per_output_token_s
        if not req.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": " tok" * n}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": " tok" * n, "finish_reason": "length"})
            if ttft_s:
                await asyncio.sleep(ttft_s)
            payload = json.dumps({"id": "x", "object": "chat.completion" if chat else "text_completion",
                                  "choices": [choice], "usage": usage}).encode()
            t.write(self.head(200, "application/json", len(payload)) + payload)
            return
        t.write(self.head(200, "text/event-stream", None))
        event = (b'{"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" tok"}}]}'
                 if chat else b'{"id":"x","object":"text_completion","choices":[{"index":0,"text":" tok"}]}')
        if ttft_s:
            await asyncio.sleep(ttft_s)
        chunk = self.chunk(b"data: " + event + b"\n\n")
        if itl_s:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for i in range(n):
                if i:  # on a fixed schedule from the first token, so that timer slack does not add up
                    await asyncio.sleep(t0 + i * itl_s - loop.time())
                if t.is_closing():
                    return
                t.write(chunk)
        else:
            t.write(chunk * n)
        tail = b""
        if (req.get("stream_options") or {}).get("include_usage"):
            tail += self.chunk(b"data: " + json.dumps({"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n")
        tail += self.chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        if not t.is_closing():
            t.write(tail)

    def head(self, status: int, ctype: str, length: int | None, extra: dict[str, str] | None = None) -> bytes:
        lines = [f"HTTP/1.1 {status} {STATUS.get(status, b'').decode()}", f"Content-Type: {ctype}"]
        lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
        if self.opts.served_by:
            lines.append(f"x-lmfleet-served-by: {self.opts.served_by}")
        lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    # ---- dialects ------------------------------------------------------------------------------
    async def respond_dialect(self, chat: bool, req: dict[str, Any], headers: dict[str, str]) -> None:
        t = self.transport
        assert t is not None
        a = answer(self.opts.dialect, chat, req, headers, self.directives, max_tokens=self.opts.max_tokens,
                   model=self.opts.answer_model or req.get("model") or self.opts.model, no_usage=self.opts.no_usage)
        if a.status == 200 and self.opts.ttft_ms:
            await asyncio.sleep(self.opts.ttft_ms / 1000)
        if a.body is not None:
            t.write(self.head(a.status, "application/json", len(a.body), a.headers) + a.body)
            return
        t.write(self.head(200, "text/event-stream", None))
        for e in a.events:
            if self.opts.itl_ms:
                await asyncio.sleep(self.opts.itl_ms / 1000)
            if t.is_closing():
                return
            t.write(self.chunk(e))
        if not t.is_closing():
            t.write(b"0\r\n\r\n")

    @staticmethod
    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18555)
    p.add_argument("--model", default="fast")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=10**6, help="cap on tokens per answer")
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--itl-ms-max", type=float, default=0.0,
                   help="above --itl-ms: each stream's inter-token time is drawn from uniform(itl-ms, itl-ms-max)")
    p.add_argument("--ttft-ms-per-prompt-token", type=float, default=0.0,
                   help="prefill time per prompt word, added to --ttft-ms")
    p.add_argument("--workers", type=int, default=1, help="server processes on the port (SO_REUSEPORT)")
    p.add_argument("--served-by", default="", help="value of the x-lmfleet-served-by header (none if empty)")
    p.add_argument("--dialect", choices=sorted(DIALECTS), default=None,
                   help="answer the way this provider does (default: the lean answers above)")
    p.add_argument("--no-usage", action="store_true", help="with --dialect: send no usage anywhere")
    p.add_argument("--answer-model", default="", help="with --dialect: answer with this model name")
    p.add_argument("--latency-model", default="", metavar="MEDIAN_MS,P99_MS,PER_TOKEN_MS",
                   help="log-normal TTFT and a per-token pace instead of the delays above (module docstring)")
    p.add_argument("--seed", type=int, default=0, help="seed of --latency-model's draws")
    opts = p.parse_args(argv)
    opts.latency, opts.rng = None, random.Random(opts.seed)
    if opts.latency_model:
        from lmfleet.bench.trace import ProviderLatency

        median, p99, per_token = (float(x) / 1000 for x in opts.latency_model.split(","))
        opts.latency = ProviderLatency(median, p99, per_token)
    return opts


async def serve(opts: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Handler(opts), opts.host, opts.port, backlog=4096, reuse_address=True,
                                      reuse_port=opts.workers > 1 or None)
    async with server:
        await server.serve_forever()


def main(opts: argparse.Namespace) -> None:
    """Serve; with ``--workers N`` fork N-1 more processes first (they end when this one is terminated)."""
    children = []
    for _ in range(opts.workers - 1):
        pid = os.fork()
        if pid == 0:
            random.seed()  # each process its own draws
            asyncio.run(serve(opts))
            os._exit(0)
        children.append(pid)
    import signal

    def stop(*_: object) -> None:
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        asyncio.run(serve(opts))
    finally:
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)


class FastServer:
    """Run the server in a subprocess on a free port for the duration of a ``with`` block."""

    def __init__(self, *args: str):
        self.port = free_port("127.0.0.1")
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "FastServer":
        self.proc = subprocess.Popen([sys.executable, "-m", "lmfleet.testing.fast_openai_server", "--port", str(self.port), *self.args])
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=1).read()
                return self
            except OSError:
                time.sleep(0.05)
        self.__exit__()
        raise RuntimeError("fast_openai_server did not start")

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


if __name__ == "__main__":
    main(parse_args())
