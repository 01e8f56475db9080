"""Local attempts waiting in Serve's queue for a replica that is not there (:class:`WaitingForReplica`).

Serve sends a request to a replica that runs; with none running it holds the request in its router until one
does. When a model's deployment has no replica running and none finishing requests (the only replica being
replaced by ``lmfleet apply``, or lost with its node, and its successor still starting), every local request
without an answer yet is in that queue: none reached an engine, so none was prefilled. Those with a provider
after them move to it at once (:meth:`WaitingForReplica.release`, called when Serve's status shows the
deployment so) instead of waiting for the successor (an engine start: a minute or more) into their request
timeout. A request moved there is not sent twice: the local attempt is closed before the provider's starts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from lmfleet.gateway.core.errors import UpstreamError

__all__ = ["NoReplica", "WaitingForReplica"]


class NoReplica(UpstreamError):
    """The local deployment had no replica to take or hold the request (it had not reached an engine)."""


class WaitingForReplica:
    """One model's local attempts that may move to a provider when its deployment has no replica (see the
    module docstring): the tasks awaiting a local answer inside :meth:`watch`."""

    def __init__(self) -> None:
        self._tasks: dict[asyncio.Task, bool] = {}
        """Task -> released (cancelled by :meth:`release`, to raise :class:`NoReplica` in it)."""

    def __len__(self) -> int:
        return len(self._tasks)

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Around the await of a local answer (or first token): :class:`NoReplica` is raised in it when
        :meth:`release` is called meanwhile. A cancellation of the request itself (the client went away) stays a
        cancellation."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks[task] = False
        try:
            yield
        except asyncio.CancelledError:
            if self._tasks.pop(task, False) and task.uncancel() == 0:
                raise NoReplica("the local deployment had no replica running or finishing requests (its successor "
                                "still starting); the request had not reached an engine") from None
            raise
        else:
            if self._tasks.pop(task, False):  # the answer came as it was released: that cancellation is moot
                task.uncancel()
        finally:
            self._tasks.pop(task, None)

    def release(self) -> int:
        """Move every attempt waiting in :meth:`watch` on (each raises :class:`NoReplica`); returns how many."""
        n = 0
        for task, released in list(self._tasks.items()):
            if not released and not task.done():
                self._tasks[task] = True
                task.cancel()
                n += 1
        return n
