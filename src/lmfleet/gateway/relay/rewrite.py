"""The relay's slow path, as pure functions over SSE bytes: read the usage event (and drop it unless the client
asked), put the client's model name back over a provider's, notice error events."""

from __future__ import annotations

import json
from typing import Any

from lmfleet.gateway.relay import sse


def take_usage(block: bytes, usage: tuple[int, int] | None,
               wants_usage: bool) -> tuple[bytes, tuple[int, int] | None]:
    """Read the usage of the events in ``block`` that carry one (and drop it unless the client asked), leaving
    the other events' bytes as they are (``wants_usage``: the client asked for it). Returns (bytes to send, usage)."""
    out = []
    pos = 0
    while (i := find_usage(block, pos)) >= 0:
        start = block.rfind(b"\n\n", pos, i)
        start = pos if start < 0 else start + 2
        end = block.find(b"\n\n", i)
        end = len(block) if end < 0 else end + 2
        event = block[start:end]
        obj = sse.event_json(event)
        usage = sse.usage_of(obj) or usage
        out.append(block[pos:start])
        if wants_usage or obj is None:
            out.append(event)
        elif obj.get("choices"):
            obj.pop("usage", None)
            out.append(event_bytes(obj))
        pos = end
    out.append(block[pos:])
    return b"".join(out), usage


def rewrite(batch: list[bytes], usage: tuple[int, int] | None, done: bool, rename: str | None,
            wants_usage: bool) -> tuple[bytes, int, tuple[int, int] | None, bool, bool]:
    """The slow path, event by event: read usage (and drop it unless the client asked), put the client's model
    name back (``rename``: that name; None: unchanged), notice errors. Returns (bytes to send, choice events,
    usage, done, failed)."""
    out = []
    chunks = 0
    failed = False
    for e in batch:
        if b'"usage":{' in e or b'"usage": {' in e:
            obj = sse.event_json(e)
            usage = sse.usage_of(obj) or usage
            if not wants_usage and obj is not None:
                if not obj.get("choices"):
                    continue
                obj.pop("usage", None)
                e = event_bytes(obj)
        if rename is not None and b'"model"' in e:
            obj = sse.event_json(e)
            if obj is not None:
                obj["model"] = rename
                if not wants_usage and "usage" in obj and obj["usage"] is None:  # sent because the gateway asked
                    del obj["usage"]
                e = event_bytes(obj)
        if sse.has_choices(e):
            chunks += 1
        elif sse.is_done(e):
            done = True
        elif b'"error"' in e and (obj := sse.event_json(e)) is not None and "error" in obj:
            failed = True
        out.append(e)
    return b"".join(out), chunks, usage, done, failed


def find_usage(block: bytes, pos: int) -> int:
    """Where the next usage object starts at or after ``pos`` (-1: none); ``"usage":null`` does not count."""
    a, b = block.find(b'"usage":{', pos), block.find(b'"usage": {', pos)
    return b if a < 0 else a if b < 0 else min(a, b)


def event_bytes(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
