"""Talking to one backend over HTTP: the local Ray Serve deployment of a model, or an external provider.

Both are OpenAI-compatible endpoints, so one pair of calls (:func:`complete`, :func:`open_stream`) serves
both; an :class:`Endpoint` says where to send, with which model name, credentials, time limits and in which
:mod:`dialect <lmfleet.dialects>` (what is sent in a stream's body, how a 429 and an error code are read).
Failures are classified into the :class:`~lmfleet.gateway.front.errors.UpstreamError` tree here and nowhere else.

The HTTP client is aiohttp: on this data path it costs ~0.3 ms of CPU per 32-token stream where httpx cost
~5.9 ms (measured on the 2-core CI machine against ``lmfleet.testing.fast_openai_server``; see
docs/benchmarks.md), and every streamed token passes through here.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import yarl

from lmfleet.dialects import GENERIC, Dialect, RateLimitHeaders
from lmfleet.errors import LmfleetError
from lmfleet.gateway.core.errors import (
    UpstreamError,
    UpstreamMisconfigured,
    UpstreamRateLimited,
    UpstreamRejected,
    UpstreamServerError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from lmfleet.gateway.relay.sse import SSEEventTooLarge, SSESplitter, first_answer_in
from lmfleet.gateway.relay.streamclient import StreamPool
from lmfleet.overflow.breaker import parse_retry_after


class HttpPool:
    """Keep-alive connection pools to one kind of backend, opened on the gateway's event loop by :meth:`open`
    (the app's lifespan) or at first use: streams over plain http (the local replicas) through the lean
    :class:`~lmfleet.gateway.relay.streamclient.StreamPool`, everything else (unary calls, https) through aiohttp.
    Each pool holds at most ``max_connections``."""

    def __init__(self, *, max_connections: int, connect_timeout_s: float | None = None):
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._streams: StreamPool | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, ttl_dns_cache=300),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
                auto_decompress=False, skip_auto_headers=("User-Agent",))
        return self._session

    def open(self) -> None:
        _ = self.session

    async def post_stream(self, url: yarl.URL, body: bytes, headers: dict[str, str]) -> Any:
        """Send a streaming request; the response has ``status``, ``headers``, ``read()``, ``content.readany()``,
        ``content.at_eof()``, ``content.set_exception()``, ``release()`` and ``close()`` whichever client sent it."""
        if url.scheme == "http":
            if self._streams is None:
                self._streams = StreamPool(max_connections=self.max_connections,
                                           connect_timeout_s=self.connect_timeout_s)
            return await self._streams.post(url, body, headers)
        return await self.session.post(url, data=body, headers=headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._streams is not None:
            await self._streams.close()
            self._streams = None


@dataclass(frozen=True)
class Endpoint:
    """Where one attempt goes, built by a backend for each attempt."""

    label: str
    """Provenance: ``local/MODEL`` or ``provider/NAME`` (header, ledger, metrics)."""
    what: str
    """How error messages name it: "local deployment", "provider NAME"."""
    base_url: str  # ends in /v1
    upstream_model: str
    client: HttpPool = field(repr=False, compare=False)
    headers: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    first_token_timeout_s: float | None = None
    total_timeout_s: float | None = None
    idle_timeout_s: float | None = None  # longest gap between stream chunks before the stream counts as stalled
    not_found_is_transient: bool = False
    """A 404 means the app is (re)deploying (Ray Serve's proxy), not that the client asked for something wrong."""
    dialect: Dialect = field(default=GENERIC, repr=False, compare=False)
    """The provider's quirks (a local deployment is vLLM: :data:`~lmfleet.dialects.GENERIC`)."""

    def within(self, remaining_s: float) -> "Endpoint":
        """The same endpoint with every time limit cut to what is left of the request's deadline."""
        remaining_s = max(0.001, remaining_s)
        ftt = min(self.first_token_timeout_s, remaining_s) if self.first_token_timeout_s else remaining_s
        total = min(self.total_timeout_s, remaining_s) if self.total_timeout_s else remaining_s
        return replace(self, first_token_timeout_s=ftt, total_timeout_s=total)


_SERVE_MSG = re.compile(r"^Message:\s*(?P<msg>.*?)(?:\s*\(Request ID:.*|\s*Internal exception:.*)?$", re.S)


MAX_MESSAGE_CHARS = 2000
"""Upstream error texts are cut to this before cleaning: the pattern is quadratic on long whitespace runs."""


def clean_message(message: str) -> str:
    """Strip Ray Serve's wrapping ("Message: ... (Request ID ...), Internal exception: ..."), after cutting the
    text to :data:`MAX_MESSAGE_CHARS`."""
    message = message[:MAX_MESSAGE_CHARS]
    m = _SERVE_MSG.match(message.strip())
    msg = m.group("msg") if m else message
    return msg.strip() or message.strip()


def redact(message: str, ep: Endpoint) -> str:
    """Remove the endpoint's credentials from text that came back from it (a provider may echo them)."""
    for v in ep.headers.values():
        secret = v.split(" ", 1)[-1]
        if len(secret) >= 4:
            message = message.replace(secret, "***")
    return message


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_duration(value: str | None) -> float | None:
    """Seconds from a rate-limit reset as providers write it: ``"1s"``, ``"6m0s"``, ``"20ms"``, ``"2m59.56s"``
    (OpenAI, Groq) or a bare number of seconds; None if absent or unparseable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    parts = _DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def retry_after_from(headers: Any, names: RateLimitHeaders = GENERIC.rate_limits) -> float | None:
    """How long a provider asks to be left alone, from its answer's headers (None: it does not say), reading only
    the headers its dialect sends (``names``; by default every one known), in order of precision:
    ``retry-after-ms``, ``retry-after`` (seconds or an HTTP date), then the longest reset of an exhausted window
    (``x-ratelimit-remaining-…`` is ``0``), else the soonest reset."""
    ms = headers.get(names.retry_after_ms) if names.retry_after_ms else None
    if ms:
        try:
            v = float(ms) / 1000
            if v == v and v >= 0:  # not NaN
                return parse_retry_after(str(v))
        except ValueError:
            pass
    v = parse_retry_after(headers.get(names.retry_after)) if names.retry_after else None
    if v is not None:
        return v
    resets = [(rem, parse_duration(headers.get(reset))) for rem, reset in names.windows()]
    exhausted = [r for rem, r in resets if r is not None and rem is not None and headers.get(rem) == "0"]
    if exhausted:
        return parse_retry_after(str(max(exhausted)))
    known = [r for _, r in resets if r is not None]
    return parse_retry_after(str(min(known))) if known else None


def _error_from_response(ep: Endpoint, status: int, raw: bytes, headers: Any) -> UpstreamError:
    code = None
    try:
        err = json.loads(raw).get("error") or {}
        message = err.get("message") if isinstance(err, dict) else str(err)
        code = err.get("code") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        message = None
    message = redact(clean_message(message or raw[:300].decode(errors="replace") or f"HTTP {status}"), ep)
    fault = ep.dialect.fault(status, code)
    if fault == "client":
        return UpstreamRejected(message, status=status if 400 <= status < 500 else 400)
    if fault == "provider":
        return UpstreamMisconfigured(message, status=status)
    if status == 429:
        return UpstreamRateLimited(message, status=status,
                                   retry_after_s=retry_after_from(headers, ep.dialect.rate_limits))
    if status >= 500 or status == 408 or (status == 404 and ep.not_found_is_transient):
        return UpstreamServerError(message, status=status)
    if status in (401, 403, 404):  # we chose the key, the path and the upstream model name, not the client
        return UpstreamMisconfigured(message, status=status)
    return UpstreamRejected(message, status=status)


def _transport_error(ep: Endpoint, e: Exception) -> UpstreamError:
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamTimeout(f"{ep.what} timed out ({type(e).__name__})")
    return UpstreamUnreachable(f"{ep.what} unreachable ({type(e).__name__})")


TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
"""What a broken or silent connection raises, before or during a response (a stream cut mid-way included)."""

_JSON = {"content-type": "application/json"}


@functools.lru_cache(maxsize=1024)
def _url(base_url: str, path: str) -> yarl.URL:
    """The parsed URL of one backend route (aiohttp parses a string on every request)."""
    return yarl.URL(f"{base_url}{path}")


class StreamStalled(LmfleetError):
    """A stream sent nothing for longer than its endpoint's ``idle_timeout_s``."""


STREAM_ERRORS = (aiohttp.ClientError, OSError, SSEEventTooLarge, StreamStalled)
"""What a relay may meet once the stream is open (the request's own deadline is a ``TimeoutError`` apart)."""


def prepare_body(ep: Endpoint, body: dict[str, Any], stream: bool) -> bytes:
    """The request as sent to ``ep``: its model name, and a stream's ``stream_options`` as its dialect takes
    them (:meth:`~lmfleet.dialects.Dialect.stream_body`)."""
    out = ep.dialect.stream_body(body) if stream else body
    out = {**out, "model": ep.upstream_model}
    return json.dumps(out, separators=(",", ":")).encode()


async def complete(ep: Endpoint, path: str, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """Non-streaming call. Returns the raw body and its parsed JSON object."""
    try:
        async with asyncio.timeout(ep.total_timeout_s):
            async with ep.client.session.post(_url(ep.base_url, path), data=prepare_body(ep, body, False),
                                              headers={**_JSON, **ep.headers}) as resp:
                raw = await resp.read()
                status, headers = resp.status, resp.headers
    except TRANSPORT_ERRORS as e:
        raise _transport_error(ep, e) from None
    if status != 200:
        raise _error_from_response(ep, status, raw, headers)
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise UpstreamServerError(f"{ep.what} returned a body that is not a JSON object", status=status)
    return raw, obj


class _IdleWatchdog:
    """Fails a stream's reader with :class:`StreamStalled` once nothing has arrived for the endpoint's
    ``idle_timeout_s``. The reader only stamps :attr:`last` per read; one timer per stream re-arms itself for
    what is left of the quiet period (an ``asyncio.timeout`` around each read cost ~5 % of the relay's CPU)."""

    def __init__(self, content: Any, ep: Endpoint) -> None:
        self.loop = asyncio.get_running_loop()
        self.content, self.ep = content, ep
        self.idle = float(ep.idle_timeout_s or 0)
        self.last = self.loop.time()
        self._timer: asyncio.TimerHandle | None = self.loop.call_at(self.last + self.idle, self._check)

    def _check(self) -> None:
        due = self.last + self.idle
        if self.loop.time() < due:
            self._timer = self.loop.call_at(due, self._check)
            return
        self._timer = None
        self.content.set_exception(StreamStalled(f"no data from {self.ep.label} for {self.idle:g} s"))

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class OpenStream:
    """A streaming response whose first event with a choice has already arrived.

    Until then nothing was sent to the client, so a failure can still go to another backend.
    """

    def __init__(self, ep: Endpoint, resp: Any, splitter: SSESplitter, head: list[bytes]):
        self.endpoint = ep
        self._resp = resp
        self._splitter = splitter
        self.head = head

    async def blocks(self) -> AsyncIterator[bytes]:
        """Complete events as they arrived, joined (one block per read from the backend; blank events kept).

        Raises one of :data:`STREAM_ERRORS` when the stream breaks or stays silent for ``idle_timeout_s``.
        """
        if self.head:
            yield b"".join(self.head)
        content = self._resp.content
        watchdog = _IdleWatchdog(content, self.endpoint) if self.endpoint.idle_timeout_s else None
        feed = self._splitter.feed_block
        try:
            while chunk := await content.readany():
                if watchdog is not None:
                    watchdog.last = watchdog.loop.time()
                block = feed(chunk)
                if block:
                    yield block
        finally:
            if watchdog is not None:
                watchdog.cancel()
        rest = self._splitter.rest()
        if rest.strip():
            yield rest + b"\n\n"

    async def aclose(self) -> None:
        if self._resp.content.at_eof():
            self._resp.release()  # the connection goes back to the pool
        else:
            self._resp.close()  # cut short: this connection is not reusable


async def open_stream(ep: Endpoint, path: str, body: dict[str, Any]) -> OpenStream:
    """Start a streaming call and wait for its first event carrying a choice (or its end)."""
    resp: Any = None

    async def _first() -> OpenStream:
        nonlocal resp
        resp = await ep.client.post_stream(_url(ep.base_url, path), prepare_body(ep, body, True),
                                           {**_JSON, **ep.headers})
        if resp.status != 200:
            raw = await resp.read()
            raise _error_from_response(ep, resp.status, raw, resp.headers)
        splitter = SSESplitter()
        head: list[bytes] = []  # whole events as read (one read may carry the first token, the rest and [DONE])
        while chunk := await resp.content.readany():
            block = splitter.feed_block(chunk)
            head.append(block)
            if block and first_answer_in(block):
                break
        return OpenStream(ep, resp, splitter, head)

    try:
        async with asyncio.timeout(ep.first_token_timeout_s):
            return await _first()
    except UpstreamError:
        if resp is not None:
            resp.close()
        raise
    except SSEEventTooLarge as e:
        if resp is not None:
            resp.close()
        raise UpstreamServerError(f"{ep.what} sent a broken stream: {e}") from None
    except TRANSPORT_ERRORS as e:
        if resp is not None:
            resp.close()
        if isinstance(e, asyncio.TimeoutError) and ep.first_token_timeout_s is not None:
            raise UpstreamTimeout(f"no first token within {ep.first_token_timeout_s:g} s") from None
        raise _transport_error(ep, e) from None
    except BaseException:
        if resp is not None:
            resp.close()
        raise
