"""The local dispatch queue: at most ``capacity`` requests of a model run locally; the rest wait here, and
when a slot frees up :func:`next_to_dispatch` picks who goes (class order, then the least-recently-served
tenant, then arrival).

    q = DispatchQueue(capacity=8)
    if not q.try_enter():                                   # fast path: a free slot and nobody waiting
        if not await q.wait(tenant, cls.order, timeout_s):  # parked; False: its time ran out, no slot
            ...                                             # deadline passed (429 or a provider)
    try: ... run the request locally ...
    finally: q.leave()                                      # the slot goes to the next one chosen

One per model and gateway process; the gateway builds them only when tenants are configured. With several
gateway processes each admits ``capacity``, so Ray Serve's own FIFO queue takes the excess (docs/tenants.md).
"""

from __future__ import annotations

import asyncio
import itertools

from lmfleet.tenants.fairness import Waiting, next_to_dispatch

__all__ = ["DispatchQueue", "QueueFull"]


class QueueFull(Exception):
    """``max_waiting`` requests already wait for this model."""


class DispatchQueue:
    """A bounded priority queue in front of one model's local slots (see the module docstring)."""

    def __init__(self, capacity: int, max_waiting: int = 1024):
        if capacity < 1 or max_waiting < 0:
            raise ValueError(f"{capacity=} must be >= 1 and {max_waiting=} >= 0")
        self.capacity = capacity
        self.max_waiting = max_waiting
        self.running = 0
        self.waiting: dict[Waiting, asyncio.Future[None]] = {}
        self.last_served: dict[str, int] = {}
        self._by_order: dict[int, int] = {}
        """How many wait per class order (few classes: counting those behind a class is O(classes))."""
        self._arrivals = itertools.count()
        self._dispatches = itertools.count()

    def try_enter(self) -> bool:
        """Take a slot now if one is free and nobody waits (no await: the uncontended path costs nothing)."""
        if self.running < self.capacity and not self.waiting:
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

    def waiting_behind(self, order: int) -> int:
        """Requests waiting in a class that a request of class ``order`` is dispatched before (a larger order):
        they do not delay it, so its wait estimate leaves them out."""
        return sum(n for o, n in self._by_order.items() if o > order)

    def leave(self) -> None:
        """Give a slot back; it goes to the waiting request :func:`next_to_dispatch` chooses."""
        self.running = max(0, self.running - 1)
        while self.running < self.capacity and self.waiting:
            w = next_to_dispatch(self.waiting, self.last_served)
            assert w is not None
            fut = self.waiting[w]
            self._drop(w)
            if fut.done():  # its wait ended (timeout, cancellation) before it could run
                continue
            self.last_served[w.tenant] = next(self._dispatches)
            self.running += 1
            fut.set_result(None)
