"""Checks on OpenAI requests that the gateway makes before anything is sent upstream. Pure functions.

Every failure is a :class:`GatewayError` with status 400 naming the parameter, so a client mistake
never costs an engine slot and never comes back as a 500.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from lmfleet.gateway.errors import GatewayError, bad_request

Kind = Literal["chat", "completion"]
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


@dataclass(frozen=True)
class ParsedRequest:
    kind: Kind
    model: str
    body: dict[str, Any]
    stream: bool
    max_tokens: int | None
    wants_usage: bool
    """The client asked for usage in the stream (stream_options.include_usage)."""


def parse_json(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _check_number(body: dict[str, Any], name: str) -> None:
    if name not in body or body[name] is None:
        return
    kind, lo, hi, lo_inclusive = _NUMBERS[name]
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, kind):
        want = "an integer" if kind is int else "a number"
        raise bad_request(f"{name} must be {want}, got {json.dumps(v)}", param=name)
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
            raise bad_request(f"messages[{i}].role must be one of {sorted(ROLES)}, got {json.dumps(role)}",
                              param=f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(f"messages[{i}].content must be a string or an array of parts",
                              param=f"messages[{i}].content")


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
        raise bad_request(f"stream must be a boolean, got {json.dumps(stream)}", param="stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("stream_options must be an object", param="stream_options")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise bad_request("stop must be a string or an array of strings", param="stop")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    return ParsedRequest(kind, model, body, bool(stream), max_tokens, bool((opts or {}).get("include_usage")))


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Reject prompts that cannot fit: prompt + max_tokens must stay within max_model_len."""
    if max_tokens is None:
        if prompt_tokens >= max_model_len:
            raise GatewayError(
                400,
                f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                f"{prompt_tokens} tokens, which leaves no room for output. Shorten the prompt.",
                param="messages", code="context_length_exceeded")
        return
    if prompt_tokens + max_tokens > max_model_len:
        raise GatewayError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt and {max_tokens} for the "
            f"completion). Reduce the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded")
