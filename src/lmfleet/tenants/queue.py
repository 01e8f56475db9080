"""The local dispatch queue: at most ``capacity`` requests of a model run locally; the rest wait here, and
when a slot frees up :func:`next_to_dispatch` picks who goes (class order, then the least-recently-served
tenant, then arrival).

    q = DispatchQueue(capacity=8)
    if not q.try_enter(cls.order, yield_s):                          # fast path: a free slot, nobody waiting
        if not await q.wait(tenant, cls.order, timeout_s, yield_s):  # parked; False: its time ran out, no slot
            ...                                                      # deadline passed (429 or a provider)
    q.begin_start(cls.order)                                         # dispatched: starting until its first token
    try: ... run the request locally; q.end_start(cls.order) at its first token (or when it ends) ...
    finally: q.leave()                                               # the slot goes to the next one chosen

``yield_s`` (the class's ``first_token_yield_ms``): while a request of a more urgent class is starting (between
``begin_start`` and ``end_start``), this one is not dispatched for up to ``yield_s`` (fairness.yields); a timer
dispatches it when that time is up, and the urgent request's first token dispatches it at once. The starting
count is this process's own (other gateway processes' starting requests are not seen).

One per model and gateway process; the gateway builds them only when tenants are configured. With several
gateway processes (workers, or gateways on other nodes) each reports how many local slots it holds through the
gateway registry (:mod:`lmfleet.gateway.peers`) and :meth:`DispatchQueue.set_peer_running` takes the others' out
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

from lmfleet.tenants.fairness import Waiting, next_to_dispatch, yields

__all__ = ["DispatchQueue", "QueueFull"]


class QueueFull(Exception):
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
        self.starting: dict[int, int] = {}
        """Class order -> requests dispatched here that have no first token yet (:meth:`begin_start`)."""
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at = math.inf

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

    def try_enter(self, order: int = 0, yield_s: float = 0.0) -> bool:
        """Take a slot now if one is free, nobody waits and (with ``yield_s``) no more urgent request is starting
        (no await: the uncontended path costs nothing)."""
        if self.running < self.share and not self.waiting and not (yield_s > 0 and yields(order, self.starting)):
            self.running += 1
            return True
        return False

    def begin_start(self, order: int) -> None:
        """A request of class ``order`` was dispatched and waits for its first token: the classes that yield
        hold back (up to their yield time) until :meth:`end_start`."""
        self.starting[order] = self.starting.get(order, 0) + 1

    def end_start(self, order: int) -> None:
        """That request's first token came (or it ended without one): whoever yielded to it may go."""
        n = self.starting.get(order, 0) - 1
        if n > 0:
            self.starting[order] = n
        else:
            self.starting.pop(order, None)
            self._dispatch()

    async def wait(self, tenant: str, order: int, timeout_s: float | None, yield_s: float = 0.0) -> bool:
        """Wait for a slot: True once dispatched (the caller holds it and must :meth:`leave`), False when
        ``timeout_s`` ran out first. Raises :class:`QueueFull` when the queue is at ``max_waiting``; a
        cancelled waiter leaves no trace (a slot dispatched to it meanwhile is passed on). ``yield_s``: see the
        module docstring."""
        if self.try_enter(order, yield_s):
            return True
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests already wait for a local slot")
        w = Waiting(next(self._arrivals), tenant, order,
                    yield_until=self._clock() + yield_s if yield_s > 0 else -math.inf)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting[w] = fut
        self._by_order[order] = self._by_order.get(order, 0) + 1
        dispatched = False
        try:
            if timeout_s is not None and timeout_s <= 0:
                return False
            if self.running < self.share:  # free slots held back for yielding requests: this one may go first
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
        :func:`lmfleet.gateway.router.class_wait_ms` needs to leave the classes that yield out of an estimate."""
        return self._by_order_view

    def waiting_behind(self, order: int) -> int:
        """Requests waiting in a class that a request of class ``order`` is dispatched before (a larger order):
        they do not delay it, so its wait estimate leaves them out."""
        return sum(n for o, n in self._by_order.items() if o > order)

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
            if not fut.done() and self.starting and yields(w.order, self.starting):
                now = self._clock()
                if w.yield_until > now:  # it yields (and so does everyone behind it) until then, or a first token
                    self._wake_up_at(w.yield_until, now)
                    return
            self._drop(w)
            if fut.done():  # its wait ended (timeout, cancellation) before it could run
                continue
            self.last_served[w.tenant] = next(self._dispatches)
            self.running += 1
            fut.set_result(None)

    def _wake_up_at(self, t: float, now: float) -> None:
        """Run :meth:`_dispatch` again at clock time ``t`` (one timer: the earliest asked for)."""
        if self._wake is not None and self._wake_at <= t:
            return
        if self._wake is not None:
            self._wake.cancel()
        self._wake_at = t
        self._wake = asyncio.get_running_loop().call_later(max(0.0, t - now), self._woken)

    def _woken(self) -> None:
        self._wake, self._wake_at = None, math.inf
        self._dispatch()
