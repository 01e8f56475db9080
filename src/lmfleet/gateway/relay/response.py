"""The relay response: a streamed answer as plain ASGI sends, and the helper that sends a whole one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from lmfleet.gateway.relay import sse
from lmfleet.gateway.relay.disconnect import DisconnectWatch

LAST_EVENT = sse.DONE + b"\n\n"
"""How a relayed stream's last block ends."""


class RelayResponse(Response):
    """A streamed answer: every block the relay yields is one ASGI send, and a client that goes away cancels the
    relay (and with it the upstream call). Starlette's StreamingResponse does the same through an anyio task
    group per response, which cost a noticeable share of the gateway's CPU (benchmarks/bench_relay.py)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str]):
        self.body_iterator = body
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.current_task()
        assert relay is not None
        watch = DisconnectWatch(receive, relay)
        try:
            await self.send_to(send, watch.answered)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            relay.uncancel()  # the client left: nothing more to do
        finally:
            watch.stop()

    async def send_to(self, send: Send, answered: Callable[[], None] | None = None) -> None:
        """Send the answer. Whoever calls it watches for the client leaving (and cancels this); ``answered`` is
        called once the response is complete, when the client may close its end while the relay still
        finishes its bookkeeping (reading the upstream to its end)."""
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            blocks = self.body_iterator
            async for block in blocks:
                if block.endswith(LAST_EVENT):  # the response's end goes out in the same write as its last event
                    await send({"type": "http.response.body", "body": block, "more_body": False})
                    if answered is not None:
                        answered()
                    async for _ in blocks:  # the relay's own ending (bookkeeping); nothing more is sent
                        pass
                    return
                await send({"type": "http.response.body", "body": block, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if answered is not None:
                answered()
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def send_whole(send: Send, r: Response) -> None:
    """Send a complete (non-streamed) response."""
    await send({"type": "http.response.start", "status": r.status_code, "headers": r.raw_headers})
    await send({"type": "http.response.body", "body": r.body})
