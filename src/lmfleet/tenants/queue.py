"""The local dispatch queue: at most ``capacity`` requests of a model run locally; the rest wait here, and
when a slot frees up :func:`next_to_dispatch` picks who goes (class order, then the least-recently-served
tenant, then arrival).

    q = DispatchQueue(capacity=8)
    if not q.try_enter():                                   # fast path: a free slot, nobody waiting
        if not await q.wait(tenant, cls.order, timeout_s):  # parked; False: its time ran out, no slot
            ...                                             # deadline passed (429 or a provider)
    try: ... run the request locally ...
    finally: q.leave()                                      # the slot goes to the next one chosen

One per model and gateway process; the gateway builds them only when tenants are configured. With several
gateway processes (workers, or gateways on other nodes) each reports how many local slots it holds through the
gateway registry (:mod:`lmfleet.gateway.routing.peers`) and :meth:`DispatchQueue.set_peer_running` takes the others' out
of this one's capacity, so together they run about ``capacity`` at once and the rest waits here, in class order,
instead of in Ray Serve's FIFO queue. Each process keeps at least one slot (reports are up to a period old; a
process with none would wait on a stale count), and a count older than ``peer_ttl_s`` no longer counts.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

from lmfleet.errors import LmfleetError
from lmfleet.tenants.fairness import Waiting, next_to_dispatch

__all__ = ["DispatchQueue", "QueueFull"]


class QueueFull(LmfleetError):
    """``max_waiting`` requests already wait for this model."""


class DispatchQueue:
    """A bounded priority queue in front of one model's local slots (see the module docstring)."""

    peer_ttl_s = 2.0
    """Other processes' slot count older than this no longer counts (their registry reports stopped)."""

    def __init__(self, capacity: int, max_waiting: int = 1024, clock: Callable[[], float] = time.monotonic):
        if capacity < 1 or max_waiting < 0:
            raise ValueError(f"{capacity=} must be >= 1 and {max_waiting=} >= 0")
        self.capacity = capacity
        self.max_waiting = max_waiting
        self.running = 0
        self.peer_running = 0
        """Local slots the other gateway processes of the fleet held at their last report."""
        self._peer_at = -math.inf
        self._clock = clock
        self.waiting: dict[Waiting, asyncio.Future[None]] = {}
        self.last_served: dict[str, int] = {}
        self._by_order: dict[int, int] = {}
        """How many wait per class order (few classes: counting those behind a class is O(classes))."""
        self._by_order_view: Mapping[int, int] = MappingProxyType(self._by_order)
        self._arrivals = itertools.count()
        self._dispatches = itertools.count()

    @property
    def share(self) -> int:
        """The slots this process may hold now: the capacity less the other processes' fresh count, at least 1."""
        if self.peer_running and self._clock() - self._peer_at <= self.peer_ttl_s:
            return max(1, self.capacity - self.peer_running)
        return self.capacity

    def set_peer_running(self, n: int, now: float | None = None) -> None:
        """The other gateway processes' local slots in use (summed, from the registry); a larger share
        dispatches waiting requests at once."""
        self.peer_running = max(0, int(n))
        self._peer_at = self._clock() if now is None else now
        self._dispatch()

    def try_enter(self) -> bool:
        """Take a slot now if one is free and nobody waits (no await: the uncontended path costs nothing)."""
        if self.running < self.share and not self.waiting:
            self.running += 1
            return True
        return False

    async def wait(self, tenant: str, order: int, timeout_s: float | None) -> bool:
        """Wait for a slot: True once dispatched (the caller holds it and must :meth:`leave`), False when
        ``timeout_s`` ran out first. Raises :class:`QueueFull` when the queue is at ``max_waiting``; a
        cancelled waiter leaves no trace (a slot dispatched to it meanwhile is passed on)."""
        if self.try_enter():
            return True
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests already wait for a local slot")
        w = Waiting(next(self._arrivals), tenant, order)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting[w] = fut
        self._by_order[order] = self._by_order.get(order, 0) + 1
        dispatched = False
        try:
            if timeout_s is not None and timeout_s <= 0:
                return False
            if self.running < self.share:  # the share grew (the peers' count went stale) with requests waiting
                self._dispatch()
            async with asyncio.timeout(timeout_s):
                await fut
            dispatched = True
            return True
        except TimeoutError:
            return False
        finally:
            self._drop(w)
            if not dispatched and fut.done() and not fut.cancelled():  # a slot came with the timeout or cancel
                self.leave()

    def _drop(self, w: Waiting) -> None:
        if self.waiting.pop(w, None) is not None:
            n = self._by_order.get(w.order, 0) - 1
            if n > 0:
                self._by_order[w.order] = n
            else:
                self._by_order.pop(w.order, None)

    @property
    def waiting_by_order(self) -> Mapping[int, int]:
        """How many requests wait now, per class order (a read-only live view; orders with none are absent): what
        :func:`lmfleet.gateway.routing.router.class_wait_ms` needs to leave the less urgent classes out of an
        estimate."""
        return self._by_order_view

    def leave(self) -> None:
        """Give a slot back; it goes to the waiting request :func:`next_to_dispatch` chooses."""
        self.running = max(0, self.running - 1)
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots (within :attr:`share`) to the waiting requests :func:`next_to_dispatch` chooses."""
        if not self.waiting:
            return
        share = self.share
        while self.running < share and self.waiting:
            w = next_to_dispatch(self.waiting, self.last_served)
            assert w is not None
            fut = self.waiting[w]
            self._drop(w)
            if fut.done():  # its wait ended (timeout, cancellation) before it could run
                continue
            self.last_served[w.tenant] = next(self._dispatches)
            self.running += 1
            fut.set_result(None)
