"""How the fake OpenAI server answers in a provider's dialect (``fast_openai_server --dialect NAME``).

What the gateway must know of a provider is its entry in :data:`lmfleet.dialects.DIALECTS`, and the fake reads
the same entry: where a stream's usage goes and whether it must be asked for, whether ``stream_options`` is
refused, the key reasoning comes under, the header the key must come in, and the names of its rate-limit
headers. What only a real answer shows (error texts, comment lines, extra fields, the values in the headers) is
sample data here, per dialect (:data:`EMULATIONS`; a dialect without one answers as :data:`PLAIN` does).
:func:`answer` builds a whole answer, or a stream's events, from a request: pure, no I/O.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from lmfleet.dialects import DIALECTS, Dialect

TOOL_ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
"""The arguments of every tool call a dialect answers with (streamed in three pieces)."""
REASONING = " Let me think. The answer is short."
_DIRECTIVE = re.compile(r"\[fake:(429|5xx|filter|credit)(?:\*(\d+))?(?:#[\w-]+)?\]")


@dataclass(frozen=True)
class ErrorShape:
    """One error answer as a provider sends it: status, headers, JSON body."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Emulation:
    """What one provider's answers look like beyond what its dialect entry says (sample data)."""

    rate_limited: ErrorShape
    """Its 429: body, and headers the gateway does not read (``limits`` adds those it does)."""
    limits: dict[str, str]
    """Values of its 429's rate-limit headers, by :class:`~lmfleet.dialects.RateLimitHeaders` field (the
    header names are the dialect's)."""
    server_error: ErrorShape
    content_filter: ErrorShape | None = None
    out_of_credit: ErrorShape | None = None
    """Its answer once the account's quota or balance is spent (None: not emulated)."""
    comments: tuple[bytes, ...] = ()
    """SSE comment lines sent before the first chunk."""
    first_chunk: dict[str, Any] | None = None
    """A chunk with empty ``choices`` sent before the first answer chunk."""
    reasoning: bool = False
    """Reasoning arrives first (as a reasoning model's does), under the dialect's first reasoning key."""
    usage_null: bool = False
    """Every chunk carries ``"usage": null`` until the one with the usage (when usage was asked for)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields every chunk and whole answer carries."""

    def rate_limited_headers(self, d: Dialect) -> dict[str, str]:
        out = dict(self.rate_limited.headers)
        for role, value in self.limits.items():
            name = getattr(d.rate_limits, role)
            if name is None:
                raise ValueError(f"dialect {d.name!r} sends no {role} header; its emulation gives it a value")
            out[name] = value
        return out


def _error(message: str, type_: str | None, code: Any, **more: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code, **more}}


_FILTER = {"hate": {"filtered": False, "severity": "safe"}, "self_harm": {"filtered": False, "severity": "safe"},
           "sexual": {"filtered": False, "severity": "safe"}, "violence": {"filtered": False, "severity": "safe"}}

PLAIN = Emulation(ErrorShape(429, _error("Too many requests", "rate_limit_error", None)), {"retry_after": "1"},
                  ErrorShape(500, _error("Internal server error", "server_error", None)))
"""An OpenAI-compatible server's answers (vLLM's, a dialect's without an emulation of its own)."""

EMULATIONS: dict[str, Emulation] = {
    "openai": Emulation(
        ErrorShape(429, _error("Rate limit reached for requests", "requests", "rate_limit_exceeded"),
                   {"x-ratelimit-limit-requests": "500"}),
        {"retry_after_ms": "1500", "remaining_requests": "0", "reset_requests": "1.5s"},
        ErrorShape(503, _error("The engine is currently overloaded, please try again later", "server_error", None)),
        out_of_credit=ErrorShape(429, _error("You exceeded your current quota, please check your plan and billing "
                                             "details.", "insufficient_quota", "insufficient_quota")),
        usage_null=True, extra={"system_fingerprint": "fp_fake"}),
    "azure": Emulation(
        ErrorShape(429, {"error": {"code": "429", "message": "Requests to the ChatCompletions_Create Operation have "
                                   "exceeded the call rate limit. Please retry after 2 seconds."}}),
        {"retry_after": "2", "retry_after_ms": "2000", "remaining_requests": "0"},
        ErrorShape(500, {"error": {"code": "InternalServerError",
                                   "message": "The service is temporarily unable to process your request."}}),
        content_filter=ErrorShape(400, _error(
            "The response was filtered due to the prompt triggering Azure OpenAI's content management policy.",
            None, "content_filter", status=400, innererror={
                "code": "ResponsibleAIPolicyViolation",
                "content_filter_result": {**_FILTER, "violence": {"filtered": True, "severity": "high"}}})),
        first_chunk={"choices": [], "created": 0, "id": "", "model": "", "object": "",
                     "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": _FILTER}]}),
    "deepseek": Emulation(
        ErrorShape(429, _error("Rate Limit Reached", "rate_limit_error", "rate_limit_reached")), {},
        ErrorShape(503, _error("Server overloaded", "server_error", "server_overloaded")),
        out_of_credit=ErrorShape(402, _error("Insufficient Balance", "unknown_error", "invalid_request_error")),
        reasoning=True, comments=(b": keep-alive",), extra={"system_fingerprint": "fp_ds"}),
    "openrouter": Emulation(
        # its X-RateLimit-Reset is an epoch time in ms, not a wait: the gateway does not read it
        ErrorShape(429, {"error": {"message": "Rate limit exceeded: limit_rpm/fake", "code": 429,
                                   "metadata": {"provider_name": None}}},
                   {"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "1764763200000"}),
        {},
        ErrorShape(502, {"error": {"code": 502, "message": "Provider returned error",
                                   "metadata": {"provider_name": "FakeUpstream", "raw": "oops"}}}),
        out_of_credit=ErrorShape(402, {"error": {"code": 402, "message": "Insufficient credits"}}),
        comments=(b": OPENROUTER PROCESSING", b": OPENROUTER PROCESSING"), extra={"provider": "FakeUpstream"}),
    "together": Emulation(
        ErrorShape(429, _error("You have reached the rate limit", "rate_limit_exceeded", None),
                   {"x-ratelimit-remaining": "0"}),
        {"retry_after": "1"},
        ErrorShape(503, _error("The server is overloaded or not ready yet.", "server_error", None)),
        usage_null=True),
    "fireworks": Emulation(
        ErrorShape(429, {"error": {"object": "error", "type": "rate_limit_error", "code": "RATE_LIMIT_EXCEEDED",
                                   "message": "Request rate limit exceeded, please try again later"}},
                   {"x-ratelimit-limit-requests": "600"}),
        {"remaining_requests": "0", "reset_requests": "3s"},
        ErrorShape(500, {"error": {"object": "error", "type": "internal_server_error",
                                   "message": "server had an error"}})),
    "groq": Emulation(
        ErrorShape(429, {"error": {"message": "Rate limit reached for model `fake` on tokens per minute (TPM). "
                                   "Please try again in 7.66s.", "type": "tokens", "code": "rate_limit_exceeded"}},
                   {"x-ratelimit-limit-tokens": "6000"}),
        {"retry_after": "2", "remaining_tokens": "0", "reset_tokens": "7.66s", "remaining_requests": "14399",
         "reset_requests": "2m59.56s"},
        ErrorShape(503, {"error": {"message": "Service Unavailable", "type": "internal_server_error"}})),
}


def emulation(name: str) -> Emulation:
    return EMULATIONS.get(name, PLAIN)


@dataclass
class Answer:
    """What to send: a whole body (``body``), or a stream's events (``events``, each ``data: ...\\n\\n``)."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    events: list[bytes] = field(default_factory=list)


def _json_answer(status: int, obj: dict[str, Any], headers: dict[str, str] | None = None) -> Answer:
    return Answer(status, headers or {}, json.dumps(obj).encode())


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class Directives:
    """The ``[fake:...]`` directives a server process has seen (``[fake:5xx*2#id]``: only the first 2 fail)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def failure(self, d: Dialect, emu: Emulation, prompt: str) -> Answer | None:
        m = _DIRECTIVE.search(prompt)
        if m is None:
            return None
        seen = self.seen[m.group(0)] = self.seen.get(m.group(0), 0) + 1
        if m.group(2) is not None and seen > int(m.group(2)):
            return None
        kind = m.group(1)
        if kind == "429":
            return _json_answer(429, emu.rate_limited.body, emu.rate_limited_headers(d))
        shape = {"5xx": emu.server_error, "filter": emu.content_filter, "credit": emu.out_of_credit}[kind]
        if shape is None:  # a plain 400 where the dialect has no such answer of its own
            shape = ErrorShape(400, {"error": {"message": "content filtered" if kind == "filter" else
                                               f"[fake:{kind}] is not emulated", "type": "invalid_request_error"}})
        return _json_answer(shape.status, shape.body, shape.headers)


def refusal(d: Dialect, headers: dict[str, str], req: dict[str, Any]) -> Answer | None:
    """The 4xx a provider of this dialect gives a request it does not take: a key in another header than its own,
    ``stream_options`` where it refuses them."""
    keyed = [h for h in ("authorization", "api-key") if h in headers]
    if keyed and (keyed != [d.auth_header] or not headers[d.auth_header].startswith(d.auth_prefix)):
        return _json_answer(401, _error(f"expected the key in {d.auth_header!r}, got {', '.join(keyed)}",
                                        "invalid_request_error", "invalid_api_key"))
    if not d.stream_options and "stream_options" in req:
        return _json_answer(400, _error("Unrecognized request argument supplied: stream_options",
                                        "invalid_request_error", None))
    return None


def tool_name(req: dict[str, Any]) -> str | None:
    """The function a tool call goes to: the one ``tool_choice`` names, else the first tool (None: no call, when
    there are no tools or ``tool_choice`` is "none")."""
    tools, choice = req.get("tools") or [], req.get("tool_choice")
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        return choice["function"]["name"]
    return tools[0]["function"]["name"]


def answer(name: str, chat: bool, req: dict[str, Any], headers: dict[str, str], directives: Directives, *,
           max_tokens: int, model: str, no_usage: bool = False) -> Answer:
    """The answer of a provider speaking dialect ``name`` to ``req`` (``headers``: the request's, lower-case)."""
    d, emu = DIALECTS[name], emulation(name)
    messages = req.get("messages") or []
    prompt = str(req.get("prompt") or " ".join(str(m.get("content") or "") for m in messages))
    refused = refusal(d, headers, req) or directives.failure(d, emu, prompt)
    if refused is not None:
        return refused
    n = max(1, min(int(req.get("max_tokens") or 16), max_tokens))
    tool = tool_name(req) if chat else None
    reasoning_key = d.reasoning_keys[0] if emu.reasoning and chat and d.reasoning_keys else None
    words = [" tok"] * n
    completion = (len(TOOL_ARGUMENTS.split()) if tool else n) + (len(REASONING.split()) if reasoning_key else 0)
    prompt_tokens = len(prompt.split())
    usage = None if no_usage else {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                   "total_tokens": prompt_tokens + completion}
    base = {"id": "chatcmpl-fake", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, **emu.extra}
    finish = "tool_calls" if tool else "length"
    if not req.get("stream"):
        if chat:
            msg: dict[str, Any] = {"role": "assistant", "content": None if tool else "".join(words)}
            if tool:
                msg["tool_calls"] = [{"id": "call_fake", "type": "function",
                                      "function": {"name": tool, "arguments": TOOL_ARGUMENTS}}]
            if reasoning_key:
                msg[reasoning_key] = REASONING
            choice = {"index": 0, "message": msg, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": "".join(words), "finish_reason": finish}
        if emu.first_chunk is not None:  # Azure: filter results in the answer too
            base["prompt_filter_results"] = emu.first_chunk["prompt_filter_results"]
            choice["content_filter_results"] = _FILTER
        obj = {**base, "choices": [choice]}
        if usage is not None:
            obj["usage"] = usage
        if d.stream_usage == "x_groq":
            obj["x_groq"] = {"id": "req_fake"}
        return _json_answer(200, obj)
    include = bool((req.get("stream_options") or {}).get("include_usage"))
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    if emu.usage_null and include:
        base["usage"] = None
    events: list[bytes] = [c + b"\n\n" for c in emu.comments]
    if emu.first_chunk is not None and chat:
        events.append(_data(emu.first_chunk))

    def chunk(delta: dict[str, Any] | None, text: str | None = None, finish_reason: str | None = None,
              **more: Any) -> bytes:
        c: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if chat:
            c["delta"] = delta or {}
        else:
            c["text"] = text or ""
        if emu.first_chunk is not None:
            c["content_filter_results"] = _FILTER
        return _data({**base, "choices": [c], **more})

    first = {"x_groq": {"id": "req_fake"}} if d.stream_usage == "x_groq" else {}
    if chat:
        events.append(chunk({"role": "assistant", "content": ""}, **first))
        if reasoning_key:
            events += [chunk({"content": None, reasoning_key: w}) for w in re.findall(r" ?\S+", REASONING)]
        if tool:
            a = TOOL_ARGUMENTS
            events.append(chunk({"tool_calls": [{"index": 0, "id": "call_fake", "type": "function",
                                                 "function": {"name": tool, "arguments": ""}}]}))
            events += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]})
                       for p in (a[:5], a[5:20], a[20:])]
        else:
            events += [chunk({"content": w}) for w in words]
    else:
        events += [chunk(None, w, **first) for w in words]
    last: dict[str, Any] = {}
    if usage is not None and d.stream_usage == "last":
        last["usage"] = usage
    elif usage is not None and d.stream_usage == "x_groq":
        last["x_groq"] = {"id": "req_fake", "usage": usage}
    events.append(chunk({}, "", finish, **last))
    if usage is not None and d.stream_usage == "chunk" and include:
        events.append(_data({**base, "choices": [], "usage": usage}))
    events.append(b"data: [DONE]\n\n")
    return Answer(200, events=events)
