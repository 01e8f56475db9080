"""A lean HTTP/1.1 client for the relay's streams over plain HTTP (the local replicas; providers on http://).

    pool = StreamPool(max_connections=256, connect_timeout_s=5.0)
    resp = await pool.post(yarl.URL("http://127.0.0.1:8001/v1/chat/completions"), body, headers)
    resp.status, resp.headers                  # lower-case header names
    while chunk := await resp.content.readany():   # body bytes as they arrive, de-chunked
        ...
    resp.release()                              # whole answer read: the connection goes back to the pool
    resp.close()                                # cut short: the connection is closed

Why not aiohttp here: every token event of a stream arrives as its own HTTP chunk, and aiohttp's reader does
about ten Python calls per chunk (protocol, stream reader, flow control; ~35 us each under cProfile on the
CI machine: the largest single share of the relay's CPU in benchmarks/bench_relay.py). Here one chunk costs
``data_received`` -> llhttp (httptools, C) -> ``on_body``: the bytes are appended and the reader woken.
Unary calls and https (providers: TLS, proxies, redirects are aiohttp's business) stay on aiohttp.

Behaviour kept from aiohttp: a connection limit per pool (callers beyond it wait), keep-alive reuse, a
reused connection that the server had closed before answering is retried once on a fresh one (nothing of
the request was processed: no response byte came back), bounded buffering (reading pauses while more than
:data:`HIGH_WATER` bytes wait to be read), and every failure is an ``OSError`` (the callers' transport
errors). The body is never decompressed (no ``Accept-Encoding`` is sent).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import httptools
import yarl

from lmfleet.errors import LmfleetError

__all__ = ["HIGH_WATER", "StreamPool", "StreamProtocolError", "StreamResponse"]

HIGH_WATER = 256 * 1024
"""Body bytes waiting to be read past which the socket is no longer read (resumed below a quarter of it)."""


class StreamProtocolError(LmfleetError, ConnectionError):
    """The server's bytes are not a valid HTTP/1.1 response, or the connection ended mid-answer."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection and the response being read on it."""

    def __init__(self, pool: "StreamPool", key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.counted_out = False  # its slot in the pool's limit was given back
        self.resp: StreamResponse | None = None
        self._parser: Any = None
        self._header_name = b""

    # ---- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._parser is None:  # bytes nobody asked for (a server talking out of turn): the connection is done
            self._drop(StreamProtocolError("unexpected bytes from the server between requests"))
            return
        resp = self.resp
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._drop(StreamProtocolError("the server switched protocols"))
            return
        except httptools.HttpParserError as e:
            self._drop(StreamProtocolError(f"invalid HTTP response ({e})"))
            return
        if resp is not None and resp._chunks:  # once per read, however many chunks it carried
            resp._arrived()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        resp = self.resp
        if resp is None:
            return
        self.resp = None
        if resp._headers_done and not resp._framed:
            resp._finish()  # a body delimited by the connection's end: this is its end
        else:
            resp._fail(StreamProtocolError(
                "the server closed the connection " + ("mid-answer" if resp._headers_done else "before answering")),
                before_answer=not resp._headers_done)

    def pause_writing(self) -> None:  # requests are small; nothing to throttle
        pass

    def resume_writing(self) -> None:
        pass

    # ---- llhttp callbacks ---------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.resp
        if resp is not None:
            resp.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is None:
            return
        resp.status = self._parser.get_status_code()
        h = resp.headers
        resp._framed = "content-length" in h or "chunked" in h.get("transfer-encoding", "").lower()
        resp._keep_alive = self._parser.should_keep_alive()
        resp._headers_done = True
        w = resp._headers_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        if resp is not None:
            resp._chunks.append(body)  # the reader is woken once per read (data_received), not per chunk

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp is not None:
            self.resp = None
            self._parser = None
            resp._finish()

    # ---- use ------------------------------------------------------------------------------------------
    def start(self, request: bytes, resp: "StreamResponse") -> None:
        self.resp = resp
        self._parser = httptools.HttpResponseParser(self)
        assert self.transport is not None
        self.transport.write(request)

    def _drop(self, exc: Exception) -> None:
        resp, self.resp = self.resp, None
        if resp is not None:
            resp._fail(exc, before_answer=False)
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        self.pool._forget(self)


class _Content:
    """``resp.content``: the reader side, named as aiohttp's so that callers read either the same way."""

    __slots__ = ("_r",)

    def __init__(self, resp: "StreamResponse") -> None:
        self._r = resp

    async def readany(self) -> bytes:
        return await self._r.readany()

    def at_eof(self) -> bool:
        return self._r._eof and not self._r._chunks

    def set_exception(self, exc: BaseException) -> None:
        self._r._fail(exc, before_answer=False)


class StreamResponse:
    """One response on a pooled connection. Exactly one of :meth:`release` / :meth:`close` ends it."""

    def __init__(self, conn: _Conn, loop: asyncio.AbstractEventLoop) -> None:
        self._conn: _Conn | None = conn
        self._loop = loop
        self.status = 0
        self.headers: dict[str, str] = {}
        self.content = _Content(self)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._paused = False
        self._eof = False
        self._exc: BaseException | None = None
        self._before_answer = False
        self._framed = True
        self._keep_alive = False
        self._headers_done = False
        self._headers_waiter: asyncio.Future[None] | None = loop.create_future()
        self._waiter: asyncio.Future[None] | None = None

    # ---- fed by the connection ----------------------------------------------------------------------
    def _arrived(self) -> None:
        """After a read that brought body bytes: pause past the high-water mark, wake the reader."""
        if not self._paused and self._conn is not None and self._conn.transport is not None \
                and sum(map(len, self._chunks)) > HIGH_WATER:
            self._paused = True
            self._conn.transport.pause_reading()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _finish(self) -> None:
        self._eof = True
        self._wake()

    def _fail(self, exc: BaseException, before_answer: bool) -> None:
        if self._eof and not self._chunks:
            return
        self._exc = exc
        self._before_answer = before_answer
        self._wake()
        hw = self._headers_waiter
        if hw is not None and not hw.done():
            hw.set_exception(exc)
            hw.exception()  # retrieved here: whoever waits re-raises it

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ---- read ------------------------------------------------------------------------------------------
    async def _wait_headers(self) -> None:
        hw = self._headers_waiter
        assert hw is not None
        try:
            await hw
        finally:
            self._headers_waiter = None

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); ``b""`` at the end."""
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if self._paused and self._conn is not None and self._conn.transport is not None:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    # ---- end ---------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Done with a response read to its end: its connection is reused when both sides allow it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._eof and self._exc is None and self._keep_alive and self._framed and not conn.closed:
            if self._paused and conn.transport is not None:
                conn.transport.resume_reading()
            conn.pool._put_back(conn)
        else:
            conn.close()
            conn.pool._done(conn)

    def close(self) -> None:
        """Done before the end (or after a failure): the connection is closed, never reused."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.resp = None
            conn.close()
            conn.pool._done(conn)


class StreamPool:
    """Keep-alive HTTP/1.1 connections per host, at most ``max_connections`` open or being opened at once."""

    def __init__(self, *, max_connections: int, connect_timeout_s: float | None = None) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections} must be >= 1")
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], collections.deque[_Conn]] = {}
        self._open = 0  # connections open (idle or in use) or being opened
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    @property
    def idle_connections(self) -> int:
        return sum(len(q) for q in self._idle.values())

    async def post(self, url: yarl.URL, body: bytes, headers: dict[str, str]) -> StreamResponse:
        """Send ``POST url`` and wait for the response's status and headers (not its body)."""
        if url.scheme != "http" or url.host is None:
            raise ValueError(f"StreamPool speaks plain http only, not {url.scheme!r} ({url.host})")
        if self._closed:
            raise StreamProtocolError("the connection pool is closed")
        host, port = url.host, url.port or 80
        request = _request_bytes(url, host, port, body, headers)
        for attempt in (0, 1):
            conn, reused = await self._connection((host, port))
            resp = StreamResponse(conn, asyncio.get_running_loop())
            conn.start(request, resp)
            try:
                await resp._wait_headers()
            except StreamProtocolError:
                resp.close()
                if reused and attempt == 0 and resp._before_answer:
                    continue  # the server had closed this idle connection: nothing was processed, try a new one
                raise
            except BaseException:
                resp.close()
                raise
            return resp
        raise AssertionError("unreachable")

    async def close(self) -> None:
        self._closed = True
        for q in self._idle.values():
            for c in list(q):
                c.close()
        self._idle.clear()
        while self._slot_waiters:
            w = self._slot_waiters.popleft()
            if not w.done():
                w.set_exception(StreamProtocolError("the connection pool is closed"))

    # ---- connections -------------------------------------------------------------------------------------
    async def _connection(self, key: tuple[str, int]) -> tuple[_Conn, bool]:
        q = self._idle.get(key)
        while q:
            c = q.pop()  # the most recently used: the least likely to have been closed by the server
            if not c.closed:
                return c, True
            self._done(c)
        while self._open >= self.max_connections:
            if self._free_an_idle_slot():
                break
            w = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(w)
            try:
                await w
            except BaseException:
                if w.done() and not w.cancelled() and w.exception() is None:
                    self._pass_slot()  # we were handed a slot we will not use
                raise
            q = self._idle.get(key)
            while q:
                c = q.pop()
                if not c.closed:
                    return c, True
                self._done(c)
        self._open += 1
        try:
            return await self._connect(key), False
        except BaseException:
            self._open -= 1
            self._pass_slot()
            raise

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        conn = _Conn(self, key)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(lambda: conn, key[0], key[1])
        except TimeoutError:
            raise ConnectionError(f"connect to {key[0]}:{key[1]} timed out after {self.connect_timeout_s:g} s") from None
        return conn

    def _free_an_idle_slot(self) -> bool:
        """At the limit with idle connections to other hosts: close one of them to make room."""
        for q in self._idle.values():
            if q:
                c = q.popleft()
                c.close()
                self._done(c)
                return self._open < self.max_connections
        return False

    def _put_back(self, conn: _Conn) -> None:
        if self._closed:
            conn.close()
            self._done(conn)
            return
        self._idle.setdefault(conn.key, collections.deque()).append(conn)
        self._pass_slot()  # a waiter may take this idle connection (same host) or, closing it, its slot

    def _forget(self, conn: _Conn) -> None:
        """A connection closed (by either side): out of the idle lists, its slot free for another."""
        q = self._idle.get(conn.key)
        if q is not None and conn in q:
            q.remove(conn)
        self._done(conn)

    def _done(self, conn: _Conn) -> None:
        if conn.counted_out:
            return
        conn.counted_out = True
        self._open -= 1
        self._pass_slot()

    def _pass_slot(self) -> None:
        """Wake the longest waiter for a connection; it checks again (another caller may have been quicker)."""
        while self._slot_waiters:
            w = self._slot_waiters.popleft()
            if not w.done():
                w.set_result(None)
                return


def _request_bytes(url: yarl.URL, host: str, port: int, body: bytes, headers: dict[str, str]) -> bytes:
    target = url.raw_path_qs or "/"
    hostport = host if port == 80 else f"{host}:{port}"
    lines = [f"POST {target} HTTP/1.1", f"Host: {hostport}", f"Content-Length: {len(body)}"]
    for k, v in headers.items():
        if "\r" in k or "\n" in k or "\r" in v or "\n" in v:
            raise ValueError(f"header {k!r}: line breaks are not allowed in HTTP headers")
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
