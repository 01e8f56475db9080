"""Server-sent events from OpenAI-compatible streams: split into events, read usage. Pure functions."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]"


class SSESplitter:
    """Feed raw bytes, get back complete events (each ending in a blank line), in order."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data.replace(b"\r\n", b"\n")
        if b"\n\n" not in self._buf:
            return []
        *events, self._buf = self._buf.split(b"\n\n")
        return [e + b"\n\n" for e in events if e.strip()]

    def rest(self) -> bytes:
        return self._buf


def event_json(event: bytes) -> dict[str, Any] | None:
    """The JSON payload of a ``data:`` event, or None for [DONE], comments and non-JSON."""
    payload = b"".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not payload or payload == b"[DONE]":
        return None
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def is_done(event: bytes) -> bool:
    return event.strip() == DONE


def has_choices(event: bytes) -> bool:
    """Cheap test for an event that carries a choice (text or delta), without parsing JSON."""
    return b'"choices":[{' in event or b'"choices": [{' in event


def usage_of(obj: dict[str, Any] | None) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) from a response or chunk, if it carries usage."""
    if not obj:
        return None
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    return int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)


def error_event(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    """An explicit in-stream error (the openai client raises APIError on it), then [DONE]."""
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})
    return f"data: {body}\n\n".encode() + DONE + b"\n\n"
