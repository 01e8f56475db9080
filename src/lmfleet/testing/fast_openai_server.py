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

``--dialect NAME`` answers the way one real provider does (:data:`DIALECTS`: openai, azure, deepseek,
openrouter, together, fireworks, groq): where its usage goes, its extra chunks and comment lines, reasoning,
tool calls (streamed in pieces, as OpenAI does), and its 429 / 5xx / content-filter answers with their
headers. A prompt asks for an error with ``[fake:429]``, ``[fake:5xx]`` or ``[fake:filter]``, optionally
``[fake:5xx*2#id]``: only the first 2 requests carrying that directive fail. ``--no-usage`` sends no usage
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
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from lmfleet.net import free_port

STATUS = {200: b"OK", 404: b"Not Found", 400: b"Bad Request", 429: b"Too Many Requests",
          500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable"}


@dataclass(frozen=True)
class ErrorShape:
    """One error answer as a provider sends it: status, headers, JSON body."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Dialect:
    """How one provider answers an OpenAI-compatible request."""

    name: str
    usage_in: str
    """Where a stream's usage goes: "chunk" (its own chunk with empty ``choices``, after
    ``stream_options.include_usage``), "last" (in the last content chunk, always) or "x_groq"."""
    rate_limited: ErrorShape
    server_error: ErrorShape
    content_filter: ErrorShape | None = None
    comments: tuple[bytes, ...] = ()
    """SSE comment lines sent before the first chunk."""
    first_chunk: dict[str, Any] | None = None
    """A chunk with empty ``choices`` sent before the first answer chunk."""
    reasoning: bool = False
    """Reasoning arrives first, as ``reasoning_content`` deltas (and in the whole answer's message)."""
    usage_null: bool = False
    """Every chunk carries ``"usage": null`` until the one with the usage."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields every chunk and whole answer carries."""


_FILTER = {"hate": {"filtered": False, "severity": "safe"}, "self_harm": {"filtered": False, "severity": "safe"},
           "sexual": {"filtered": False, "severity": "safe"}, "violence": {"filtered": False, "severity": "safe"}}

DIALECTS: dict[str, Dialect] = {d.name: d for d in (
    Dialect("openai", "chunk", usage_null=True, extra={"system_fingerprint": "fp_fake"},
            rate_limited=ErrorShape(429, {"error": {"message": "Rate limit reached for requests", "type": "requests",
                                                    "param": None, "code": "rate_limit_exceeded"}},
                                    {"retry-after-ms": "1500", "x-ratelimit-limit-requests": "500",
                                     "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1.5s"}),
            server_error=ErrorShape(503, {"error": {"message": "The engine is currently overloaded, please try "
                                                    "again later", "type": "server_error", "param": None,
                                                    "code": None}})),
    Dialect("azure", "chunk",
            first_chunk={"choices": [], "created": 0, "id": "", "model": "", "object": "",
                         "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": _FILTER}]},
            rate_limited=ErrorShape(429, {"error": {"code": "429", "message": "Requests to the "
                                                    "ChatCompletions_Create Operation have exceeded the call rate "
                                                    "limit. Please retry after 2 seconds."}},
                                    {"retry-after": "2", "retry-after-ms": "2000",
                                     "x-ratelimit-remaining-requests": "0"}),
            server_error=ErrorShape(500, {"error": {"code": "InternalServerError", "message": "The service is "
                                                    "temporarily unable to process your request."}}),
            content_filter=ErrorShape(400, {"error": {
                "message": "The response was filtered due to the prompt triggering Azure OpenAI's content "
                           "management policy.", "type": None, "param": "prompt", "code": "content_filter",
                "status": 400, "innererror": {"code": "ResponsibleAIPolicyViolation", "content_filter_result": {
                    **_FILTER, "violence": {"filtered": True, "severity": "high"}}}}})),
    Dialect("deepseek", "chunk", reasoning=True, comments=(b": keep-alive",), extra={"system_fingerprint": "fp_ds"},
            rate_limited=ErrorShape(429, {"error": {"message": "Rate Limit Reached", "type": "rate_limit_error",
                                                    "param": None, "code": "rate_limit_reached"}}),
            server_error=ErrorShape(503, {"error": {"message": "Server overloaded", "type": "server_error",
                                                    "param": None, "code": "server_overloaded"}})),
    Dialect("openrouter", "chunk", comments=(b": OPENROUTER PROCESSING", b": OPENROUTER PROCESSING"),
            extra={"provider": "FakeUpstream"},
            # its X-RateLimit-Reset is an epoch time in ms, not a wait: the gateway does not read it
            rate_limited=ErrorShape(429, {"error": {"message": "Rate limit exceeded: limit_rpm/fake", "code": 429,
                                                    "metadata": {"provider_name": None}}},
                                    {"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "0",
                                     "X-RateLimit-Reset": "1764763200000"}),
            server_error=ErrorShape(502, {"error": {"code": 502, "message": "Provider returned error",
                                                    "metadata": {"provider_name": "FakeUpstream", "raw": "oops"}}})),
    Dialect("together", "last", usage_null=True,
            rate_limited=ErrorShape(429, {"error": {"message": "You have reached the rate limit",
                                                    "type": "rate_limit_exceeded", "param": None, "code": None}},
                                    {"retry-after": "1", "x-ratelimit-remaining": "0"}),
            server_error=ErrorShape(503, {"error": {"message": "The server is overloaded or not ready yet.",
                                                    "type": "server_error", "param": None, "code": None}})),
    Dialect("fireworks", "last",
            rate_limited=ErrorShape(429, {"error": {"object": "error", "type": "rate_limit_error",
                                                    "code": "RATE_LIMIT_EXCEEDED", "message": "Request rate "
                                                    "limit exceeded, please try again later"}},
                                    {"x-ratelimit-limit-requests": "600", "x-ratelimit-remaining-requests": "0",
                                     "x-ratelimit-reset-requests": "3s"}),
            server_error=ErrorShape(500, {"error": {"object": "error", "type": "internal_server_error",
                                                    "message": "server had an error"}})),
    Dialect("groq", "x_groq",
            rate_limited=ErrorShape(429, {"error": {"message": "Rate limit reached for model `fake` on tokens per "
                                                    "minute (TPM). Please try again in 7.66s.", "type": "tokens",
                                                    "code": "rate_limit_exceeded"}},
                                    {"retry-after": "2", "x-ratelimit-limit-tokens": "6000",
                                     "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "7.66s",
                                     "x-ratelimit-remaining-requests": "14399",
                                     "x-ratelimit-reset-requests": "2m59.56s"}),
            server_error=ErrorShape(503, {"error": {"message": "Service Unavailable",
                                                    "type": "internal_server_error"}})),
)}

_DIRECTIVE = re.compile(r"\[fake:(429|5xx|filter)(?:\*(\d+))?(?:#\w+)?\]")
TOOL_ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
"""The arguments of every tool call a dialect answers with (streamed in three pieces)."""
REASONING = " Let me think. The answer is short."


class Handler(asyncio.Protocol):
    fail_counts: dict[str, int] = {}
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
        if self.opts.dialect:
            await self.respond_dialect(DIALECTS[self.opts.dialect], chat, req)
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
    def failure(self, d: Dialect, prompt: str) -> ErrorShape | None:
        """The error a prompt's ``[fake:...]`` directive asks for, while its count lasts."""
        m = _DIRECTIVE.search(prompt)
        if m is None:
            return None
        seen = self.fail_counts[m.group(0)] = self.fail_counts.get(m.group(0), 0) + 1
        if m.group(2) is not None and seen > int(m.group(2)):
            return None
        kind = m.group(1)
        if kind == "filter":
            return d.content_filter or ErrorShape(400, {"error": {"message": "content filtered",
                                                                  "type": "invalid_request_error"}})
        return d.rate_limited if kind == "429" else d.server_error

    def tool_name(self, req: dict[str, Any]) -> str | None:
        """The function a tool call goes to: the one ``tool_choice`` names, else the first tool (None: no
        call, when there are no tools or ``tool_choice`` is "none")."""
        tools, choice = req.get("tools") or [], req.get("tool_choice")
        if not tools or choice == "none":
            return None
        if isinstance(choice, dict):
            return choice["function"]["name"]
        return tools[0]["function"]["name"]

    async def respond_dialect(self, d: Dialect, chat: bool, req: dict[str, Any]) -> None:
        t = self.transport
        assert t is not None
        messages = req.get("messages") or []
        prompt = str(req.get("prompt") or " ".join(str(m.get("content") or "") for m in messages))
        err = self.failure(d, prompt)
        if err is not None:
            payload = json.dumps(err.body).encode()
            t.write(self.head(err.status, "application/json", len(payload), err.headers) + payload)
            return
        n = max(1, min(int(req.get("max_tokens") or 16), self.opts.max_tokens))
        tool = self.tool_name(req) if chat else None
        reasoning = d.reasoning and chat
        words = [" tok"] * n
        completion = (len(TOOL_ARGUMENTS.split()) if tool else n) + (len(REASONING.split()) if reasoning else 0)
        prompt_tokens = len(prompt.split())
        usage = None if self.opts.no_usage else {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                                 "total_tokens": prompt_tokens + completion}
        model = self.opts.answer_model or req.get("model") or self.opts.model
        base = {"id": "chatcmpl-fake", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model, **d.extra}
        finish = "tool_calls" if tool else "length"
        if self.opts.ttft_ms:
            await asyncio.sleep(self.opts.ttft_ms / 1000)
        if not req.get("stream"):
            if chat:
                msg: dict[str, Any] = {"role": "assistant", "content": None if tool else "".join(words)}
                if tool:
                    msg["tool_calls"] = [{"id": "call_fake", "type": "function",
                                          "function": {"name": tool, "arguments": TOOL_ARGUMENTS}}]
                if reasoning:
                    msg["reasoning_content"] = REASONING
                choice = {"index": 0, "message": msg, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": "".join(words), "finish_reason": finish}
            if d.first_chunk is not None:  # Azure: filter results in the answer too
                base["prompt_filter_results"] = d.first_chunk["prompt_filter_results"]
                choice["content_filter_results"] = _FILTER
            obj = {**base, "choices": [choice]}
            if usage is not None:
                obj["usage"] = usage
            if d.usage_in == "x_groq":
                obj["x_groq"] = {"id": "req_fake"}
            payload = json.dumps(obj).encode()
            t.write(self.head(200, "application/json", len(payload)) + payload)
            return
        include = bool((req.get("stream_options") or {}).get("include_usage"))
        base["object"] = "chat.completion.chunk" if chat else "text_completion"
        if d.usage_null and include:
            base["usage"] = None
        events: list[bytes] = [c + b"\n\n" for c in d.comments]
        if d.first_chunk is not None and chat:
            events.append(_data(d.first_chunk))

        def chunk(delta: dict[str, Any] | None, text: str | None = None, finish_reason: str | None = None,
                  **more: Any) -> bytes:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
            if chat:
                c["delta"] = delta or {}
            else:
                c["text"] = text or ""
            if d.first_chunk is not None:
                c["content_filter_results"] = _FILTER
            return _data({**base, "choices": [c], **more})

        first = {"x_groq": {"id": "req_fake"}} if d.usage_in == "x_groq" else {}
        if chat:
            events.append(chunk({"role": "assistant", "content": ""}, **first))
            if reasoning:
                events += [chunk({"content": None, "reasoning_content": w}) for w in re.findall(r" ?\S+", REASONING)]
            if tool:
                a = TOOL_ARGUMENTS
                pieces = [a[:5], a[5:20], a[20:]]
                events.append(chunk({"tool_calls": [{"index": 0, "id": "call_fake", "type": "function",
                                                     "function": {"name": tool, "arguments": ""}}]}))
                events += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}) for p in pieces]
            else:
                events += [chunk({"content": w}) for w in words]
        else:
            events += [chunk(None, w, **first) for w in words]
        last: dict[str, Any] = {}
        if usage is not None and d.usage_in == "last":
            last["usage"] = usage
        elif usage is not None and d.usage_in == "x_groq":
            last["x_groq"] = {"id": "req_fake", "usage": usage}
        events.append(chunk({}, "", finish, **last))
        if usage is not None and d.usage_in == "chunk" and include:
            events.append(_data({**base, "choices": [], "usage": usage}))
        events.append(b"data: [DONE]\n\n")
        t.write(self.head(200, "text/event-stream", None))
        for e in events:
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


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


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
