"""The tenant stage before routing (Tenancy.admit) as a table, and LocalSlot against a real DispatchQueue."""

from __future__ import annotations

import asyncio
import time

import pytest

from lmfleet.config.tenants import PriorityClass, TenantLimits
from lmfleet.gateway.front.errors import GatewayError
from lmfleet.gateway.front.tenancy import Tenancy
from lmfleet.gateway.relay.localslot import LocalSlot, release
from lmfleet.tenants import Tenant
from lmfleet.tenants.queue import DispatchQueue

INTERACTIVE = PriorityClass(name="interactive", order=0)
BATCH = PriorityClass(name="batch", order=10, max_wait_s=0.05)
TENANCY = Tenancy([INTERACTIVE, BATCH])


def _tenant(models=frozenset(), priority=BATCH, max_priority=INTERACTIVE) -> Tenant:
    return Tenant("a", TenantLimits(), priority, max_priority, frozenset(models))


@pytest.mark.parametrize("tenant, model, header, want, status, code", [
    (None, "m", None, None, None, None),                                       # no tenant: no class
    (_tenant(), "m", None, "batch", None, None),                               # the tenant's default class
    (_tenant(), "m", "Interactive ", "interactive", None, None),               # the header, case and spaces ignored
    (_tenant(max_priority=BATCH), "m", "interactive", "batch", None, None),    # capped at its max_priority
    (_tenant(models={"x"}), "m", None, None, 403, "model_not_allowed"),       # a model it may not use
    (_tenant(), "m", "urgent", None, 400, "invalid_priority"),                 # a class that does not exist
])
def test_admit(tenant, model, header, want, status, code):
    headers = {"x-lmfleet-priority": header} if header is not None else {}
    if status is None:
        cls = TENANCY.admit(tenant, model, headers)
        assert (cls.name if cls is not None else None) == want
        return
    with pytest.raises(GatewayError) as e:
        TENANCY.admit(tenant, model, headers)
    assert (e.value.status, e.value.code) == (status, code)


async def test_a_local_slot_is_taken_left_once_and_expires_at_its_class_deadline():
    q = DispatchQueue(capacity=1)
    first = LocalSlot(q, BATCH, "a", time.monotonic())
    assert await first.take(lambda: 10.0) and first.held and q.running == 1
    second = LocalSlot(q, BATCH, "b", time.monotonic())
    assert not await asyncio.wait_for(second.take(lambda: 10.0), 2)  # the class's 50 ms deadline passed first
    assert second.expired and not second.held
    release(None, first)
    release(None, first)  # idempotent
    assert q.running == 0 and not first.held
