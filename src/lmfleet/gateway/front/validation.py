"""Checks on OpenAI requests that the gateway makes before anything is sent upstream. Pure functions.

Every failure is a :class:`GatewayError` with status 400 naming the parameter, so a client mistake
never costs an engine slot and never comes back as a 500.
"""

from __future__ import annotations

import json
import math
from typing import Any

from lmfleet.gateway.core.errors import GatewayError, bad_request
from lmfleet.gateway.core.request import Kind, ParsedRequest, check_context

__all__ = ["Kind", "ParsedRequest", "check_content_parts", "check_context", "check_prompt_count", "check_size",
           "parse_json", "validate_request"]

ROLES = {"system", "user", "assistant", "tool", "developer", "function"}

# name -> (type check, lower bound, upper bound, inclusive lower)
_NUMBERS: dict[str, tuple[type | tuple[type, ...], float, float, bool]] = {
    "temperature": ((int, float), 0.0, 2.0, True),
    "top_p": ((int, float), 0.0, 1.0, False),
    "presence_penalty": ((int, float), -2.0, 2.0, True),
    "frequency_penalty": ((int, float), -2.0, 2.0, True),
    "repetition_penalty": ((int, float), 0.0, math.inf, False),
    "min_p": ((int, float), 0.0, 1.0, True),
    "top_k": (int, -1, math.inf, True),
    "n": (int, 1, 128, True),
    "max_tokens": (int, 1, math.inf, True),
    "max_completion_tokens": (int, 1, math.inf, True),
    "top_logprobs": (int, 0, 20, True),
    "seed": (int, -(2**63), 2**63 - 1, True),
}


MAX_DEPTH = 64
"""Deepest nesting of objects/arrays a request may have (OpenAI bodies need < 10; deep nesting only exhausts the
parser's and the encoder's recursion)."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} is out of range (numbers must be finite)")
    return v


def _check_tree(body: Any) -> None:
    """Depth <= MAX_DEPTH and every string (keys included) valid Unicode text (no lone surrogates, which JSON's
    ``\\ud800`` escapes allow but UTF-8 cannot carry upstream). Iterative: no recursion to exhaust."""
    stack = [(body, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            if depth > MAX_DEPTH:
                break
            for k, x in v.items():
                _check_text(k)
                if isinstance(x, (dict, list)):
                    stack.append((x, depth + 1))
                elif isinstance(x, str):
                    _check_text(x)
        elif isinstance(v, list):
            if depth > MAX_DEPTH:
                break
            for x in v:
                if isinstance(x, (dict, list)):
                    stack.append((x, depth + 1))
                elif isinstance(x, str):
                    _check_text(x)
    else:
        return
    raise bad_request(f"request body is nested more than {MAX_DEPTH} levels deep", code="invalid_json")


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"request body has a lone UTF-16 surrogate ({s[e.start]!r} at character {e.start} of a "
                          "string); send valid Unicode text", code="invalid_json") from None


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; 400 for anything a later step could choke on: invalid JSON, NaN or
    Infinity, numbers out of float range, nesting deeper than :data:`MAX_DEPTH`, lone surrogates."""
    if not raw:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise bad_request(f"request body is nested more than {MAX_DEPTH} levels deep", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    if _may_need_tree_check(raw):
        _check_tree(body)
    return body


def _may_need_tree_check(raw: bytes) -> bool:
    """False when the raw text proves the tree check would pass, found with three C-level scans instead of a
    walk over every value (~0.1 ms of a typical chat request): nesting is at most the number of opening
    brackets, and a lone surrogate can only come from a ``\\uD800``-``\\uDFFF`` escape (the UTF-8 decoder
    refuses encoded ones; a body in UTF-16/32, which has NUL bytes, is always walked)."""
    return (raw.count(b"{") + raw.count(b"[") > MAX_DEPTH or b"\\ud" in raw or b"\\uD" in raw
            or b"\x00" in raw)


def _check_number(body: dict[str, Any], name: str) -> None:
    if name not in body or body[name] is None:
        return
    kind, lo, hi, lo_inclusive = _NUMBERS[name]
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, kind):
        want = "an integer" if kind is int else "a number"
        raise bad_request(f"{name} must be {want}, got {_short(v)}", param=name)
    if isinstance(v, float) and not math.isfinite(v):
        raise bad_request(f"{name} must be finite, got {v}", param=name)
    low_ok = v >= lo if lo_inclusive else v > lo
    if not low_ok or v > hi:
        lo_s = f"{'>=' if lo_inclusive else '>'} {lo:g}"
        hi_s = "" if hi == math.inf else f" and <= {hi:g}"
        raise bad_request(f"{name} must be {lo_s}{hi_s}, got {v}", param=name)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array of message objects", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {sorted(ROLES)}, got {_short(role)}",
                              param=f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(f"messages[{i}].content must be a string or an array of parts",
                              param=f"messages[{i}].content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise bad_request(f"{where} must be an object with a string `type`", param=where)
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise bad_request(f"{where}.text must be a string, got {_short(part.get('text'))}",
                                      param=f"{where}.text")


def check_content_parts(messages: list[dict[str, Any]], allowed: list[str]) -> None:
    """Only the content-part types the model accepts (``content_parts`` in its config; default text only):
    another type would make the engine fetch or decode media the operator did not ask for."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part["type"] not in allowed:
                raise bad_request(f"messages[{i}].content[{j}] is a {_short(part['type'])} part; this model "
                                  f"accepts {allowed}", param=f"messages[{i}].content[{j}].type",
                                  code="unsupported_content_part")


def check_prompt_count(body: dict[str, Any], max_prompts: int) -> None:
    """/v1/completions: prompts x n (each a generation) at most ``max_prompts`` (``gateway.max_prompts``)."""
    prompt = body.get("prompt")
    count = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    n = body.get("n") or 1
    if count * n > max_prompts:
        raise bad_request(f"{count} prompt(s) x n={n} is {count * n} generations; at most {max_prompts} per request",
                          param="prompt")


CHARS_PER_TOKEN_BOUND = 1024
"""No known tokenizer has a token that covers more characters than this (the longest in common LLM vocabularies
are ~100-250 bytes): text longer than ``max_model_len x`` this cannot fit, whatever the tokenizer."""


def check_size(req: ParsedRequest, max_model_len: int | None,
               chars_per_token: int = CHARS_PER_TOKEN_BOUND) -> None:
    """Reject, before any tokenizing, a prompt whose length alone proves it cannot fit: text longer than
    ``max_model_len x chars_per_token`` characters, or more token ids than ``max_model_len - 1``. Only counts
    text every chat template keeps (assistant turns are left out: some templates drop their reasoning)."""
    if not max_model_len:
        return
    body = req.body
    if req.kind == "chat":
        chars = sum(len(_text(m.get("content"))) for m in body["messages"] if m.get("role") != "assistant")
        param = "messages"
    else:
        p = body["prompt"]
        param = "prompt"
        if isinstance(p, list) and p and isinstance(p[0], (int, list)):
            longest = len(p) if isinstance(p[0], int) else max(len(x) for x in p)
            if longest >= max_model_len:
                raise GatewayError(400, f"This model's maximum context length is {max_model_len} tokens, but the "
                                        f"prompt has {longest} token ids.", param=param,
                                   code="context_length_exceeded")
            return
        chars = len(p) if isinstance(p, str) else max(len(x) for x in p)
    if chars > max_model_len * chars_per_token:
        raise GatewayError(400, f"This model's maximum context length is {max_model_len} tokens, but the prompt "
                                f"has {chars} characters, more than any tokenizer fits in that many tokens. "
                                "Shorten the prompt.", param=param, code="context_length_exceeded")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if p.get("type") == "text")
    return ""


def _short(v: Any) -> str:
    """A client's value in a message: JSON, cut short."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_prompt(prompt: Any) -> None:
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt) or all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
            or all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt)
        )
    )
    if not ok:
        raise bad_request("prompt must be a string, an array of strings, or an array of token ids", param="prompt")


def validate_request(kind: Kind, body: dict[str, Any]) -> ParsedRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required and must be a string", param="model")
    if kind == "chat":
        _check_messages(body.get("messages"))
    else:
        if "prompt" not in body:
            raise bad_request("prompt is required", param="prompt")
        _check_prompt(body["prompt"])
    for name in _NUMBERS:
        _check_number(body, name)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"stream must be a boolean, got {_short(stream)}", param="stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("stream_options must be an object", param="stream_options")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise bad_request("stop must be a string or an array of strings", param="stop")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    return ParsedRequest(kind, model, body, bool(stream), max_tokens, bool((opts or {}).get("include_usage")))
