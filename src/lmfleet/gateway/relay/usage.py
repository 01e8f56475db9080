"""Token counts for an answer that came without usage: the text it generated, read from a whole answer or a
stream's events (pure), counted with the model's own tokenizer.

A provider (or a proxy in front of it) that omits ``usage`` must not make its answers free: the relay counts
the prompt as sent and the completion from the answer's text, reasoning and tool-call arguments, and records
the figures as estimated (``usage_source="estimated"``) rather than as the provider's.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable
from typing import Any

from lmfleet.dialects import REASONING_KEYS
from lmfleet.gateway.relay import sse
from lmfleet.gateway.core.tokens import count_chat, count_completion

PROVIDER = "provider"
"""Usage source: the backend's own ``usage``."""
ESTIMATED = "estimated"
"""Usage source: the gateway's count."""

_TEXT_KEYS = ("content", *REASONING_KEYS)
"""The keys of a message or delta that carry generated text: content, and reasoning as any dialect sends it."""

_OFFLOAD_CHARS = 16_000
"""Answers longer than this many characters are tokenized in a worker thread, off the event loop."""

_MODEL = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.)+)"')


def _message_text(m: Any) -> list[str]:
    """The generated text of one choice's ``message`` or ``delta``: content, reasoning, tool-call names and
    arguments (what the provider bills as completion tokens)."""
    if not isinstance(m, dict):
        return []
    out = [t for k in _TEXT_KEYS if isinstance(t := m.get(k), str)]
    for call in m.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            if isinstance(fn.get("name"), str):
                out.append(fn["name"] + "\n")  # a token apart from the arguments, as providers count it
            if isinstance(fn.get("arguments"), str):
                out.append(fn["arguments"])
    return out


def choice_text(obj: Any) -> list[str]:
    """The generated text pieces of a whole answer or one stream chunk (chat or completions)."""
    if not isinstance(obj, dict):
        return []
    out: list[str] = []
    for c in obj.get("choices") or ():
        if not isinstance(c, dict):
            continue
        if isinstance(c.get("text"), str):  # completions
            out.append(c["text"])
        out += _message_text(c.get("message"))
        out += _message_text(c.get("delta"))
    return out


def stream_text(blocks: Iterable[bytes]) -> str:
    """The generated text of a stream's blocks of whole events (``[DONE]``, comments and errors carry none)."""
    out: list[str] = []
    for block in blocks:
        for e in sse.split_events(block):
            if sse.has_choices(e):
                out += choice_text(sse.event_json(e))
    return "".join(out)


def answer_text(obj: Any) -> str:
    return "".join(choice_text(obj))


class StreamText:
    """A stream's blocks kept (references, no copies) to count its answer should no usage arrive. Past
    ``compact_bytes`` of kept events they are boiled down to their text, so a long answer holds about its
    text, not its SSE framing; a short one is never parsed unless it is counted."""

    def __init__(self, compact_bytes: int = 256 * 1024) -> None:
        self.compact_bytes = compact_bytes
        self._blocks: list[bytes] = []
        self._kept = 0
        self._text: list[str] = []

    def add(self, block: bytes) -> None:
        self._blocks.append(block)
        self._kept += len(block)
        if self._kept > self.compact_bytes:
            self._text.append(stream_text(self._blocks))
            self._blocks.clear()
            self._kept = 0

    def text(self) -> str:
        return "".join(self._text) + stream_text(self._blocks)


def answered_model(head: bytes) -> str | None:
    """The model an answer names in its first ``"model"`` field (None: none), read without parsing JSON."""
    m = _MODEL.search(head)
    if m is None:
        return None
    try:
        name = json.loads(b'"' + m.group(1) + b'"')
    except ValueError:
        return None
    return name if isinstance(name, str) else None


def count_text(tok: Any, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False)) if text else 0


def prompt_extra(body: dict[str, Any]) -> str:
    """What a chat request sends besides its messages that the provider bills as prompt: tool definitions."""
    tools = body.get("tools")
    return json.dumps(tools, separators=(",", ":")) if tools else ""


def count_usage(tok: Any | None, kind: str, body: dict[str, Any], text: str | None, prompt_guess: int,
                chunks: int = 0, prompt_counted: int | None = None) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of an answer without usage: the prompt as sent (messages and tool
    definitions) and ``text`` (what was generated) counted with the model's tokenizer. Without one:
    ``prompt_guess`` and 4 characters a token (at least one token per streamed chunk). ``text`` None (not
    kept): one token per streamed chunk, as a local engine streams. ``prompt_counted``: the prompt's messages
    (or completions prompt) already counted with this tokenizer
    (:func:`~lmfleet.gateway.core.tokens.count_prompt_tokens`), not tokenized again."""
    if text is None:
        completion = chunks
    elif tok is None:
        completion = max(chunks, (len(text) + 3) // 4)
    else:
        completion = count_text(tok, text)
    if tok is None:
        return prompt_guess, completion
    if kind == "chat":
        messages = body.get("messages")
        if prompt_counted is not None:
            prompt = prompt_counted
        else:
            prompt = count_chat(tok, messages) if isinstance(messages, list) else prompt_guess
        prompt += count_text(tok, prompt_extra(body))
    else:
        prompt = prompt_counted if prompt_counted is not None else count_completion(tok, body.get("prompt"))
    return prompt, completion


async def estimate(tok: Any | None, kind: str, body: dict[str, Any], text: str | None, prompt_guess: int,
                   chunks: int = 0, prompt_counted: int | None = None) -> tuple[int, int]:
    """:func:`count_usage`, in a worker thread when what is left to tokenize is long (off the event loop)."""
    size = len(text or "")
    if prompt_counted is None:
        size += len(json.dumps(body.get("messages") or body.get("prompt")))
    if tok is not None and size > _OFFLOAD_CHARS:
        return await asyncio.to_thread(count_usage, tok, kind, body, text, prompt_guess, chunks, prompt_counted)
    return count_usage(tok, kind, body, text, prompt_guess, chunks, prompt_counted)
