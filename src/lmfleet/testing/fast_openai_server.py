"""A minimal, fast OpenAI-compatible streaming server for harness tests and capacity measurements.

Raw asyncio (no framework) so that the server, not the client, is cheap: HTTP/1.1 keep-alive,
``GET /v1/models``, ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed with chunked
transfer encoding, or not). Each answer has ``min(max_tokens, --max-tokens)`` one-word tokens,
optional TTFT / inter-token delays, a ``usage`` event when asked, and an optional
``x-lmfleet-served-by`` header. Paths may carry a route prefix (``/m/v1/chat/completions``), as
Ray Serve's do, so the server can stand in for a local model too.

    python -m lmfleet.testing.fast_openai_server --port 18555 [--ttft-ms 0] [--itl-ms 0] [--served-by local/x]

In tests: ``with FastServer() as srv: srv.base_url``  (a subprocess on a free port).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request

from lmfleet.net import free_port

STATUS = {200: b"OK", 404: b"Not Found", 400: b"Bad Request"}


class Handler(asyncio.Protocol):
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
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            method, path = head.split(" ", 2)[:2]
            asyncio.get_running_loop().create_task(self.respond(method, path, body))

    async def respond(self, method: str, path: str, body: bytes) -> None:
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
        n = max(1, min(int(req.get("max_tokens") or 16), self.opts.max_tokens))
        prompt = req.get("prompt") or " ".join(m.get("content", "") for m in req.get("messages", []))
        usage = {"prompt_tokens": len(str(prompt).split()), "completion_tokens": n,
                 "total_tokens": len(str(prompt).split()) + n}
        if not req.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": " tok" * n}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": " tok" * n, "finish_reason": "length"})
            if self.opts.ttft_ms:
                await asyncio.sleep(self.opts.ttft_ms / 1000)
            payload = json.dumps({"id": "x", "object": "chat.completion" if chat else "text_completion",
                                  "choices": [choice], "usage": usage}).encode()
            t.write(self.head(200, "application/json", len(payload)) + payload)
            return
        t.write(self.head(200, "text/event-stream", None))
        event = (b'{"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" tok"}}]}'
                 if chat else b'{"id":"x","object":"text_completion","choices":[{"index":0,"text":" tok"}]}')
        if self.opts.ttft_ms:
            await asyncio.sleep(self.opts.ttft_ms / 1000)
        chunk = self.chunk(b"data: " + event + b"\n\n")
        if self.opts.itl_ms:
            for i in range(n):
                if i:
                    await asyncio.sleep(self.opts.itl_ms / 1000)
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

    def head(self, status: int, ctype: str, length: int | None) -> bytes:
        lines = [f"HTTP/1.1 {status} {STATUS.get(status, b'').decode()}", f"Content-Type: {ctype}"]
        lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
        if self.opts.served_by:
            lines.append(f"x-lmfleet-served-by: {self.opts.served_by}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

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
    p.add_argument("--served-by", default="", help="value of the x-lmfleet-served-by header (none if empty)")
    return p.parse_args(argv)


async def serve(opts: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Handler(opts), opts.host, opts.port, backlog=4096, reuse_address=True)
    async with server:
        await server.serve_forever()


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
    asyncio.run(serve(parse_args()))
