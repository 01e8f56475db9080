"""The relay's lean HTTP/1.1 stream client (gateway/relay/streamclient.py) against scripted raw-socket servers:
framing (chunked, length, connection close), keep-alive reuse, a stale pooled connection, breaks, the
connection limit, back-pressure and bad bytes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable

import pytest
import yarl

from lmfleet.gateway.relay import streamclient
from lmfleet.gateway.relay.streamclient import StreamPool, StreamProtocolError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server:
    """A raw TCP server; ``handler(reader, writer, n)`` answers the n-th request of all connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests = 0
        self.bodies: list[bytes] = []
        self.heads: list[bytes] = []
        self._srv: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> "Server":
        self._srv = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._srv is not None
        self._srv.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._srv.wait_closed(), 2)

    @property
    def url(self) -> yarl.URL:
        assert self._srv is not None
        port = self._srv.sockets[0].getsockname()[1]
        return yarl.URL(f"http://127.0.0.1:{port}/v1/chat/completions")

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                self.heads.append(head)
                self.bodies.append(await reader.readexactly(length))
                self.requests += 1
                await self.handler(reader, writer, self.requests)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client left, or the test ended while a handler still waited
        finally:
            writer.close()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"choices":[{"delta":{"content":"%d"}}]}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]


async def streamed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    writer.write(SSE_HEAD)
    for e in EVENTS:
        writer.write(chunk(e))
        await writer.drain()
        await asyncio.sleep(0.001)
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def read_all(resp: streamclient.StreamResponse) -> bytes:
    out = b""
    while c := await resp.content.readany():
        out += c
    return out


async def test_a_chunked_stream_arrives_whole_and_the_connection_is_reused() -> None:
    async with Server(streamed) as srv:
        pool = StreamPool(max_connections=4, connect_timeout_s=2)
        for _ in range(3):
            resp = await pool.post(srv.url, b'{"x":1}', {"content-type": "application/json", "authorization": "k"})
            assert resp.status == 200 and resp.headers["content-type"] == "text/event-stream"
            assert await read_all(resp) == b"".join(EVENTS)
            assert resp.content.at_eof()
            resp.release()
        assert srv.connections == 1 and srv.requests == 3
        assert srv.bodies == [b'{"x":1}'] * 3
        assert b"authorization: k" in srv.heads[0] and b"Host: 127.0.0.1:" in srv.heads[0]
        assert pool.open_connections == 1 and pool.idle_connections == 1
        await pool.close()
        assert pool.idle_connections == 0


@pytest.mark.parametrize("response, body, reused", [
    pytest.param(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", b"hello", True, id="content-length"),
    pytest.param(b"HTTP/1.1 429 Too Many\r\nretry-after: 7\r\ncontent-length: 2\r\n\r\n{}", b"{}", True,
                 id="error-status"),
    pytest.param(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end", b"until the end", False,
                 id="close-delimited"),
    pytest.param(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n", b"", False,
                 id="connection-close"),
])
async def test_framing(response: bytes, body: bytes, reused: bool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(response)
        await writer.drain()
        if b"connection: close" in response:
            writer.close()

    async with Server(handler) as srv:
        pool = StreamPool(max_connections=2)
        for _ in range(2):
            resp = await pool.post(srv.url, b"{}", {})
            assert await resp.read() == body
            resp.release()
        assert srv.connections == (1 if reused else 2)
        if b"retry-after" in response:
            assert resp.status == 429 and resp.headers["retry-after"] == "7"
        await pool.close()


async def test_a_pooled_connection_the_server_closed_is_replaced_once() -> None:
    async def answer_then_hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await streamed(reader, writer, n)
        writer.close()  # keep-alive announced, but the server drops the idle connection anyway

    async with Server(answer_then_hang_up) as srv:
        pool = StreamPool(max_connections=2)
        for _ in range(3):
            resp = await pool.post(srv.url, b"{}", {})
            assert await read_all(resp) == b"".join(EVENTS)
            resp.release()
            await asyncio.sleep(0.05)  # the close reaches us: the idle connection leaves the pool
        assert srv.requests == 3 and srv.connections == 3
        assert pool.open_connections == 0
        await pool.close()


async def test_a_stale_connection_that_fails_on_reuse_is_retried_on_a_fresh_one() -> None:
    async def first_answers_second_hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                            n: int) -> None:
        if n == 2:
            writer.close()  # read the request, closed without a byte of answer: nothing was processed
            return
        await streamed(reader, writer, n)

    async with Server(first_answers_second_hangs_up) as srv:
        pool = StreamPool(max_connections=2)
        resp = await pool.post(srv.url, b"{}", {})
        await read_all(resp)
        resp.release()
        resp = await pool.post(srv.url, b"{}", {})  # reuses the first connection, which hangs up: retried
        assert await read_all(resp) == b"".join(EVENTS)
        resp.release()
        assert srv.requests == 3 and srv.connections == 2
        await pool.close()


async def test_a_fresh_connection_closed_before_an_answer_fails_without_retrying() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.close()

    async with Server(hang_up) as srv:
        pool = StreamPool(max_connections=2)
        with pytest.raises(StreamProtocolError, match="before answering"):
            await pool.post(srv.url, b"{}", {})
        assert srv.requests == 1 and pool.open_connections == 0
        await pool.close()


async def test_a_stream_cut_mid_way_fails_the_reader_with_an_oserror() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(SSE_HEAD + chunk(EVENTS[0]))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    async with Server(cut) as srv:
        pool = StreamPool(max_connections=2)
        resp = await pool.post(srv.url, b"{}", {})
        assert await resp.content.readany() == EVENTS[0]
        with pytest.raises(OSError, match="mid-answer"):
            await resp.content.readany()
        assert not resp.content.at_eof()
        resp.close()
        assert pool.open_connections == 0
        await pool.close()


@pytest.mark.parametrize("garbage", [b"SMTP ready\r\n\r\n", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"])
async def test_bytes_that_are_not_http_fail_cleanly(garbage: bytes) -> None:
    async def bad(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(garbage)
        await writer.drain()
        await asyncio.sleep(0.2)

    async with Server(bad) as srv:
        pool = StreamPool(max_connections=2)
        with pytest.raises(StreamProtocolError, match="invalid HTTP response"):
            resp = await pool.post(srv.url, b"{}", {})
            await resp.read()
        assert pool.open_connections == 0
        await pool.close()


async def test_the_connection_limit_makes_callers_wait_for_a_release() -> None:
    gate = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            await gate.wait()
        await streamed(reader, writer, n)

    async with Server(slow) as srv:
        pool = StreamPool(max_connections=1)
        first = asyncio.ensure_future(pool.post(srv.url, b"{}", {}))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(pool.post(srv.url, b"{}", {}))
        await asyncio.sleep(0.05)
        assert not second.done() and srv.requests == 1 and pool.open_connections == 1
        gate.set()
        r1 = await first
        await read_all(r1)
        r1.release()
        r2 = await second  # took the released connection
        assert await read_all(r2) == b"".join(EVENTS)
        r2.release()
        assert srv.connections == 1
        await pool.close()


async def test_a_cancelled_waiter_passes_its_turn_on() -> None:
    async with Server(streamed) as srv:
        pool = StreamPool(max_connections=1)
        r1 = await pool.post(srv.url, b"{}", {})
        waiter = asyncio.ensure_future(pool.post(srv.url, b"{}", {}))
        third = asyncio.ensure_future(pool.post(srv.url, b"{}", {}))
        await asyncio.sleep(0.02)
        waiter.cancel()
        await read_all(r1)
        r1.release()
        r3 = await asyncio.wait_for(third, 2)
        await read_all(r3)
        r3.release()
        assert pool.open_connections == 1
        await pool.close()


async def test_a_slow_reader_pauses_the_socket_and_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streamclient, "HIGH_WATER", 4096)
    block = b"x" * 1000

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(200):
            writer.write(chunk(block))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with Server(flood) as srv:
        pool = StreamPool(max_connections=1)
        resp = await pool.post(srv.url, b"{}", {})
        await asyncio.sleep(0.2)  # not reading: at most a few kB beyond the mark are held
        assert resp._paused and sum(map(len, resp._chunks)) < 4096 + 64 * 1024
        assert await read_all(resp) == block * 200
        resp.release()
        assert pool.idle_connections == 1
        await pool.close()


async def test_set_exception_wakes_a_waiting_reader() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(SSE_HEAD)
        await writer.drain()
        await asyncio.sleep(5)

    async with Server(silent) as srv:
        pool = StreamPool(max_connections=1)
        resp = await pool.post(srv.url, b"{}", {})
        reading = asyncio.ensure_future(resp.content.readany())
        await asyncio.sleep(0.02)
        resp.content.set_exception(TimeoutError("stalled"))
        with pytest.raises(TimeoutError, match="stalled"):
            await asyncio.wait_for(reading, 2)
        resp.close()
        await pool.close()


async def test_unreachable_and_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = StreamPool(max_connections=1, connect_timeout_s=2)
    with pytest.raises(OSError):
        await pool.post(yarl.URL(f"http://127.0.0.1:{port}/v1/x"), b"{}", {})
    assert pool.open_connections == 0
    with pytest.raises(ValueError, match="plain http"):
        await pool.post(yarl.URL("https://example.com/v1/x"), b"{}", {})
    with pytest.raises(ValueError, match="line breaks"):
        await pool.post(yarl.URL(f"http://127.0.0.1:{port}/v1/x"), b"{}", {"x": "a\r\nInjected: 1"})
    await pool.close()
