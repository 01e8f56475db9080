"""Server-sent events from OpenAI-compatible streams: split into events, read usage. Pure functions."""

from __future__ import annotations

import json
from typing import Any

from lmfleet.dialects import USAGE_PATHS
from lmfleet.errors import LmfleetError, openai_error_body

DONE = b"data: [DONE]"


class SSEEventTooLarge(LmfleetError, ValueError):
    """An upstream event grew past the splitter's limit without ending (a broken or hostile stream)."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"stream event of {size} bytes or more exceeds the {limit}-byte limit "
                         "(no blank line ends it); the upstream stream is broken")
        self.size = size
        self.limit = limit


class SSESplitter:
    """Feed raw bytes, get back complete events (each ending in a blank line), in order.

    Line ends are normalised to ``\n`` (a ``\r\n`` split across two reads included). Each byte is
    scanned once: the search for the blank line resumes where the last one stopped, and only the
    unfinished event is kept between reads. An event longer than ``max_event_bytes`` raises
    :class:`SSEEventTooLarge` (and the splitter drops what it held), so a stream that never ends
    an event cannot grow the gateway's memory without bound.
    """

    def __init__(self, max_event_bytes: int = 1 << 20) -> None:
        if max_event_bytes < 1:
            raise ValueError(f"max_event_bytes={max_event_bytes} must be >= 1")
        self.max_event_bytes = max_event_bytes
        self._buf = bytearray()  # the unfinished event, already normalised
        self._cr = False  # the last read ended in "\r": its "\n" may come with the next one

    def feed(self, data: bytes) -> list[bytes]:
        if self._cr:
            data = b"\r" + data
            self._cr = False
        if data.endswith(b"\r"):
            data = data[:-1]
            self._cr = True
        data = data.replace(b"\r\n", b"\n")
        if self._buf:
            scan_from = len(self._buf) - 1  # the blank line may straddle the old tail and the new bytes
            self._buf += data
            events, end = self._split(self._buf, scan_from)
            del self._buf[:end]
        else:  # the usual case in a relay: whole events per read, nothing held, no copy into the buffer
            events, end = self._split(data, 0)
            if end < len(data):
                self._buf += memoryview(data)[end:]
        if len(self._buf) > self.max_event_bytes:
            size = len(self._buf)
            self._buf.clear()
            raise SSEEventTooLarge(size, self.max_event_bytes)
        return events

    def feed_block(self, data: bytes) -> bytes:
        """Like :meth:`feed`, but the complete events come back joined in one ``bytes`` (``b""``: none yet),
        found with one search from the end instead of one per event: what a relay that forwards them together
        needs (:func:`split_events` takes a block apart where an event must be read). Blank events are kept;
        only the unfinished event is bounded by ``max_event_bytes`` (complete ones are not held)."""
        if self._cr:
            data = b"\r" + data
            self._cr = False
        if data.endswith(b"\r"):
            data = data[:-1]
            self._cr = True
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        block = b""
        if self._buf:
            scan_from = len(self._buf) - 1
            self._buf += data
            end = self._buf.rfind(b"\n\n", scan_from)
            if end >= 0:
                block = bytes(self._buf[:end + 2])
                del self._buf[:end + 2]
        else:
            end = data.rfind(b"\n\n")
            if end >= 0 and end + 2 == len(data):
                return data  # the usual case: whole events, nothing held, no copy
            if end >= 0:
                block = data[:end + 2]
                self._buf += memoryview(data)[end + 2:]
            else:
                self._buf += data
        if len(self._buf) > self.max_event_bytes:
            size = len(self._buf)
            self._buf.clear()
            raise SSEEventTooLarge(size, self.max_event_bytes)
        return block

    def _split(self, buf: bytes | bytearray, scan_from: int) -> tuple[list[bytes], int]:
        """Complete non-blank events in ``buf`` and the offset where the unfinished rest starts."""
        events = []
        start = 0
        find = buf.find
        while (i := find(b"\n\n", scan_from)) >= 0:
            end = i + 2
            if end - start > self.max_event_bytes:
                self._buf.clear()
                raise SSEEventTooLarge(end - start, self.max_event_bytes)
            event = bytes(buf[start:end])
            if not event.isspace():
                events.append(event)
            start = scan_from = end
        return events, start

    def rest(self) -> bytes:
        """What was fed after the last complete event (an event the stream did not end)."""
        return bytes(self._buf) + (b"\r" if self._cr else b"")


def split_events(block: bytes) -> list[bytes]:
    """The non-blank events of a block of whole, normalised events (:meth:`SSESplitter.feed_block`)."""
    return [e + b"\n\n" for e in block.split(b"\n\n") if e and not e.isspace()]


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


def count_choices(block: bytes) -> int:
    """Events in ``block`` (one or more whole events) that carry a choice, without parsing JSON."""
    return block.count(b'"choices":[{') + block.count(b'"choices": [{')


def first_answer_in(block: bytes) -> bool:
    """Whether a block of whole events holds an event that ends the wait for a first answer: one carrying a
    choice, ``[DONE]`` or an error. Events are looked at one by one only up to the first such one (an engine's
    first read is one event; a fast upstream's may be the whole answer, which is not taken apart)."""
    start = 0
    find = block.find
    while (i := find(b"\n\n", start)) >= 0:
        event = block[start:i]
        if has_choices(event) or event.lstrip().startswith(DONE) or b'"error"' in event:
            return True
        start = i + 2
    return False


def has_choices(event: bytes) -> bool:
    """Cheap test for an event that carries a choice (text or delta), without parsing JSON."""
    return b'"choices":[{' in event or b'"choices": [{' in event


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def usage_of(obj: Any, paths: tuple[tuple[str, ...], ...] = USAGE_PATHS) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) from a response or chunk, if it carries usage as non-negative integers
    (an upstream that sends anything else is treated as sending no usage), at the first of ``paths`` that holds
    an object: by default wherever a dialect puts it (:data:`lmfleet.dialects.USAGE_PATHS`: ``usage``, Groq's
    ``x_groq.usage``)."""
    if not isinstance(obj, dict):
        return None
    for path in paths:
        if isinstance(u := _at(obj, path), dict):
            break
    else:
        return None
    counts = [u.get("prompt_tokens") or 0, u.get("completion_tokens") or 0]
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        return None
    return counts[0], counts[1]


def error_event(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    """An explicit in-stream error (the openai client raises APIError on it), then [DONE]."""
    body = json.dumps(openai_error_body(message, type, None, code))
    return f"data: {body}\n\n".encode() + DONE + b"\n\n"
