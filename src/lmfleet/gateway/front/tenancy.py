"""The tenant stage: who sent a request, what it may ask for, its place in the local queue, and its release.

    tenant = directory.resolve(key)                         authenticate: the client key names the tenant
    cls = tenancy.admit(tenant, model, headers)             the model is allowed (403), the priority class (400)
    plan = await router.route(model, tenant, cls, tokens)   the tenant's limits, counted with the route (429)
    slot = LocalSlot(queue, cls, tenant, t0)                its place in the model's local priority queue
    release(plan.ticket, slot)                              whatever the end: its slot in flight and in the queue

The limits are checked inside :meth:`lmfleet.gateway.routing.router.Router.route` because admission and the
routing decision are one step there: a batch request's admission depends on the route (local within its deadline,
a provider only when its tenant allows it), and a request is counted only once it cannot be refused any more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from lmfleet.config.tenants import PriorityClass
from lmfleet.gateway.front.errors import GatewayError
from lmfleet.tenants import PRIORITY_HEADER, PriorityHeaderError, Tenant, Ticket, model_refusal, requested_class
from lmfleet.tenants.queue import DispatchQueue

TENANT_SCOPE_KEY = "lmfleet.tenant"
"""Where authentication leaves the caller's :class:`~lmfleet.tenants.Tenant` in the ASGI scope of a /v1 request."""


class Tenancy:
    """The checks a tenant's request passes before it is routed (the fleet's priority classes)."""

    def __init__(self, classes: Sequence[PriorityClass]):
        self.classes = classes
        """The fleet's classes (the tenant book's own sequence, not a copy)."""

    def admit(self, tenant: Tenant | None, model: str, headers: Mapping[str, str]) -> PriorityClass | None:
        """The request's priority class (None: no tenant). 403 when the tenant may not use ``model``, 400 for a
        priority header it may not ask for."""
        if tenant is None:
            return None
        if (refusal := model_refusal(tenant, model)) is not None:
            raise GatewayError(403, refusal["error"]["message"], param="model", code="model_not_allowed")
        try:
            return requested_class(headers.get(PRIORITY_HEADER), tenant, self.classes)
        except PriorityHeaderError as e:
            raise GatewayError(400, e.message, param=PRIORITY_HEADER, code="invalid_priority") from None


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
