"""The disconnect watcher: a client that leaves before its answer is complete cancels the request's task."""

from __future__ import annotations

import asyncio

from starlette.types import Receive


class DisconnectWatch:
    """Cancels ``task`` when the client disconnects before its answer is complete (and with it the upstream
    call); a disconnect after :meth:`answered` is the client closing a finished exchange and changes nothing."""

    def __init__(self, receive: Receive, task: asyncio.Task) -> None:
        self.gone = False
        self._done = False
        self._receive, self._task = receive, task
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self._done:
            self.gone = True
            self._task.cancel()

    def answered(self) -> None:
        self._done = True

    def stop(self) -> None:
        self._watcher.cancel()
