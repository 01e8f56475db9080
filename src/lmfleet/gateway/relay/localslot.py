"""A request's place in its model's local priority queue (:class:`LocalSlot`), and the end of a request
(:func:`release`): its tenant's slot in flight and its place in the queue, freed whatever happened."""

from __future__ import annotations

import time
from collections.abc import Callable

from lmfleet.config.tenants import PriorityClass
from lmfleet.tenants import Ticket
from lmfleet.tenants.queue import DispatchQueue


class LocalSlot:
    """One request's place in its model's local priority queue (:class:`~lmfleet.tenants.queue.DispatchQueue`):
    taken before each local attempt, given back when the attempt fails or the request ends."""

    def __init__(self, queue: DispatchQueue, cls: PriorityClass, tenant: str, t0: float):
        self.queue, self.cls, self.tenant, self.t0 = queue, cls, tenant, t0
        self.held = False
        self.expired = False
        """The class's deadline in the queue passed before a slot came: only a later backend may serve."""

    async def take(self, remaining_s: Callable[[], float]) -> bool:
        """Wait for a local slot (held until :meth:`leave`); False when the class's deadline there (or the
        request's time, ``remaining_s()``) passed first. Raises :class:`~lmfleet.tenants.queue.QueueFull`."""
        q, cls = self.queue, self.cls
        if q.try_enter():
            self.held = True
            return True
        timeout = remaining_s()
        if cls.max_wait_s is not None:
            timeout = min(timeout, self.t0 + cls.max_wait_s - time.monotonic())
        self.held = await q.wait(self.tenant, cls.order, timeout)
        if not self.held and cls.max_wait_s is not None and remaining_s() > 0:
            self.expired = True
        return self.held

    def leave(self) -> None:
        """Give the slot back (idempotent)."""
        if self.held:
            self.held = False
            self.queue.leave()


def release(ticket: Ticket | None, slot: LocalSlot | None) -> None:
    """The request has ended (answered, failed or abandoned): free its tenant's slot in flight and its place in
    the local queue. Idempotent."""
    if ticket is not None:
        ticket.release()
    if slot is not None:
        slot.leave()
