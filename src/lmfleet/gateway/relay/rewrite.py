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
    name back (``rename``: that name; None: unchanged; a plain token event's as bytes, :func:`rename_model`),
    notice errors. Returns (bytes to send, choice events,
    usage, done, failed)."""
    out = []
    chunks = 0
    failed = False
    name = json.dumps(rename).encode() if rename is not None else b""
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
            fast = rename_model(e, name, drop_null_usage=not wants_usage)
            if fast is not None:
                e = fast
            elif (obj := sse.event_json(e)) is not None:
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


_MODEL_KEYS = (b'"model":"', b'"model": "')
_NULL_USAGE = (b'"usage":null', b'"usage": null')


def rename_model(event: bytes, name: bytes, drop_null_usage: bool) -> bytes | None:
    """``event`` with its top-level ``"model"`` set to ``name`` (a JSON string, quotes included), edited as bytes
    (no JSON parse: a provider's every token event passes here); ``drop_null_usage``: a top-level ``"usage":null``
    (the gateway asked for usage, the client did not) is removed too. Pure.

    None where that cannot be done safely and the caller parses the event: not one plain ``data: {...}`` line;
    the name not a plain string named once; a field found after a nested value, or a usage other than a null
    seen at the top level. A field is known to be top-level when it is the object's last (a ``"usage":null``
    before the closing brace) or when nothing before it opened or closed a nesting.
    """
    if not event.endswith(b"}\n\n") or event.count(b"\n") != 2 or event.count(b'"model"') != 1:
        return None
    start = 6 if event.startswith(b"data: {") else 5 if event.startswith(b"data:{") else -1
    if start < 0:
        return None
    for key in _MODEL_KEYS:
        if (i := event.find(key, start)) >= 0:
            break
    else:
        return None
    if not _top_level(event, start, i):
        return None
    value = i + len(key)
    end = event.find(b'"', value)
    if end < 0 or b"\\" in event[value:end]:
        return None
    out = event[:value - 1] + name + event[end + 1:]
    if not drop_null_usage or b'"usage"' not in out:
        return out
    if out.count(b'"usage"') != 1:
        return None
    for null in _NULL_USAGE:
        if (u := out.find(null, start)) >= 0:
            break
    else:
        return None
    after = u + len(null)
    if out.startswith(b"}\n\n", after):  # the last field: its comma goes with it
        cut = u - 1 if out[u - 1:u] == b"," else u - 2 if out[u - 2:u] == b", " else -1
        return out[:cut] + out[after:] if cut >= 0 else None
    if out.startswith(b",", after) and _top_level(out, start, u):  # a field before any nesting
        after += 1
        while out[after:after + 1] == b" ":
            after += 1
        return out[:u] + out[after:]
    return None


def _top_level(event: bytes, start: int, at: int) -> bool:
    """Nothing between the object's opening brace (``start``) and ``at`` opened or closed a nesting."""
    head = event[start:at]
    return head.count(b"{") == 1 and b"}" not in head and b"[" not in head


def find_usage(block: bytes, pos: int) -> int:
    """Where the next usage object starts at or after ``pos`` (-1: none); ``"usage":null`` does not count."""
    a, b = block.find(b'"usage":{', pos), block.find(b'"usage": {', pos)
    return b if a < 0 else a if b < 0 else min(a, b)


def event_bytes(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
