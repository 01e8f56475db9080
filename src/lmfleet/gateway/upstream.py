"""Talking to backends: the local Ray Serve deployment of a model, or an external provider.

Both are OpenAI-compatible HTTP endpoints, so one :class:`Upstream` serves both; a :class:`Target`
says where to send and with which model name and credentials. Failures become :class:`UpstreamError`
(retryable or not) here and nowhere else.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from lmfleet.gateway.errors import UpstreamError
from lmfleet.gateway.sse import SSESplitter, has_choices
from lmfleet.overflow.breaker import parse_retry_after


@dataclass(frozen=True)
class Target:
    """Where one attempt goes."""

    kind: str  # "local" or "provider"
    name: str  # model name (local) or provider name
    served_by: str  # "local/MODEL" or "provider/NAME": the provenance header and ledger label
    base_url: str  # ends in /v1
    upstream_model: str
    client: httpx.AsyncClient = field(repr=False, compare=False)
    headers: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    first_token_timeout_s: float | None = None
    total_timeout_s: float | None = None
    idle_timeout_s: float | None = None  # longest gap between stream chunks before the stream counts as stalled

    @property
    def is_local(self) -> bool:
        return self.kind == "local"


_SERVE_MSG = re.compile(r"^Message:\s*(?P<msg>.*?)(?:\s*\(Request ID:.*|\s*Internal exception:.*)?$", re.S)


def clean_message(message: str) -> str:
    """Strip Ray Serve's wrapping ("Message: ... (Request ID ...), Internal exception: ...")."""
    m = _SERVE_MSG.match(message.strip())
    msg = m.group("msg") if m else message
    return msg.strip() or message.strip()


def redact(message: str, target: Target) -> str:
    """Remove the target's credentials from text that came back from it (a provider may echo them)."""
    for v in target.headers.values():
        secret = v.split(" ", 1)[-1]
        if len(secret) >= 4:
            message = message.replace(secret, "***")
    return message


def _error_from_response(target: Target, status: int, raw: bytes, headers: httpx.Headers) -> UpstreamError:
    try:
        err = json.loads(raw).get("error") or {}
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        message = None
    message = redact(clean_message(message or raw[:300].decode(errors="replace") or f"HTTP {status}"), target)
    retry_after = parse_retry_after(headers.get("retry-after")) if status == 429 else None
    # 404 from the local Serve proxy means the app is (re)deploying, not that the client is wrong
    retryable = status >= 500 or status in (408, 429) or (target.is_local and status == 404)
    return UpstreamError(message, retryable=retryable, status=status, retry_after_s=retry_after)


def _transport_error(target: Target, e: Exception) -> UpstreamError:
    what = "local deployment" if target.is_local else f"provider {target.name}"
    if isinstance(e, (httpx.TimeoutException, asyncio.TimeoutError)):
        return UpstreamError(f"{what} timed out ({type(e).__name__})", retryable=True, timeout=True)
    return UpstreamError(f"{what} unreachable ({type(e).__name__})", retryable=True)


def prepare_body(target: Target, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    out = dict(body)
    out["model"] = target.upstream_model
    if stream:
        opts = dict(out.get("stream_options") or {})
        opts["include_usage"] = True  # the ledger needs token counts; stripped again if the client did not ask
        out["stream_options"] = opts
    return out


async def complete(target: Target, path: str, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """Non-streaming call. Returns the raw body and its parsed JSON."""
    try:
        resp = await asyncio.wait_for(
            target.client.post(f"{target.base_url}{path}", json=prepare_body(target, body, False), headers=target.headers),
            timeout=target.total_timeout_s,
        )
    except (httpx.HTTPError, asyncio.TimeoutError, OSError) as e:
        raise _transport_error(target, e) from None
    if resp.status_code != 200:
        raise _error_from_response(target, resp.status_code, resp.content, resp.headers)
    try:
        obj = resp.json()
    except ValueError:
        raise UpstreamError("backend returned a body that is not JSON", retryable=True, status=resp.status_code) from None
    return resp.content, obj


class OpenStream:
    """A streaming response whose first event with a choice has already arrived.

    Until then nothing was sent to the client, so a failure can still go to another target.
    """

    def __init__(self, target: Target, resp: httpx.Response, it: AsyncIterator[bytes],
                 splitter: SSESplitter, head: list[bytes]):
        self.target = target
        self._resp = resp
        self._it = it
        self._splitter = splitter
        self.head = head

    async def batches(self) -> AsyncIterator[list[bytes]]:
        """Complete events, grouped as they arrived (one list per read from the backend)."""
        if self.head:
            yield self.head
        idle = self.target.idle_timeout_s
        while True:
            try:
                chunk = await asyncio.wait_for(anext(self._it), idle) if idle else await anext(self._it)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise httpx.ReadTimeout(f"no data from {self.target.served_by} for {idle:g} s") from None
            events = self._splitter.feed(chunk)
            if events:
                yield events
        rest = self._splitter.rest()
        if rest.strip():
            yield [rest + b"\n\n"]

    async def aclose(self) -> None:
        await self._resp.aclose()


async def open_stream(target: Target, path: str, body: dict[str, Any]) -> OpenStream:
    """Start a streaming call and wait for its first event carrying a choice (or its end)."""
    req = target.client.build_request(
        "POST", f"{target.base_url}{path}", json=prepare_body(target, body, True), headers=target.headers
    )
    resp: httpx.Response | None = None

    async def _first() -> OpenStream:
        nonlocal resp
        resp = await target.client.send(req, stream=True)
        if resp.status_code != 200:
            raw = await resp.aread()
            raise _error_from_response(target, resp.status_code, raw, resp.headers)
        it = resp.aiter_raw()
        splitter = SSESplitter()
        head: list[bytes] = []
        async for chunk in it:
            events = splitter.feed(chunk)
            head.extend(events)  # all of them: one read may carry the first token, the rest and [DONE]
            if any(has_choices(e) or e.startswith(b"data: [DONE]") or b'"error"' in e for e in events):
                return OpenStream(target, resp, it, splitter, head)
        return OpenStream(target, resp, it, splitter, head)

    try:
        return await asyncio.wait_for(_first(), timeout=target.first_token_timeout_s)
    except UpstreamError:
        if resp is not None:
            await resp.aclose()
        raise
    except (httpx.HTTPError, asyncio.TimeoutError, OSError) as e:
        if resp is not None:
            await resp.aclose()
        if isinstance(e, asyncio.TimeoutError):
            raise UpstreamError(f"no first token within {target.first_token_timeout_s:g} s", retryable=True,
                                timeout=True) from None
        raise _transport_error(target, e) from None
    except BaseException:
        if resp is not None:
            await resp.aclose()
        raise
